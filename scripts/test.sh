#!/usr/bin/env bash
# The one test command: installs what is missing, then runs every test (unit + integration against
# private MariaDB and broker instances on loopback). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-test-deps.sh
# `failpoints` compiles the fault-injection points into this test build (never into releases).
cargo test --locked -j 2 --features failpoints "$@"
