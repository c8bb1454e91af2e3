#!/usr/bin/env bash
# The one test command: installs what is missing, then runs every test (unit + integration against
# private MariaDB and broker instances on loopback). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-test-deps.sh
# Two tests at a time (libtest's default on two cores): 22.7 min for the integration tests here
# (2026-11-28). Three finish in about 17 min, but under that load the rolling-restart test can
# lose its lead (a stuck checkpoint write finds too little of the lead left: README "Not yet"),
# so RUST_TEST_THREADS=3 is an option, not the default. The caller's value wins.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-2}"
# `failpoints` compiles the fault-injection points into this test build (never into releases).
cargo test --locked -j 2 --features failpoints "$@"
