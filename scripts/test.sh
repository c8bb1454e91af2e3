#!/usr/bin/env bash
# The one test command: installs what is missing, then runs every test (unit + integration against
# private MariaDB and broker instances on loopback). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-test-deps.sh
# Three tests at a time on two cores: most of a test's time is waiting (for a frozen broker's
# timeout, a consumer's idle poll, a fault schedule's next step), so a third one fills the cores
# (2026-11-28, 199 integration tests: 26.3 min with two at a time, 21.4 min with three; the
# cores were still idle two fifths of the time). RUST_TEST_THREADS set by the caller wins.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-3}"
# `failpoints` compiles the fault-injection points into this test build (never into releases).
cargo test --locked -j 2 --features failpoints "$@"
