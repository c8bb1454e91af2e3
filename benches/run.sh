#!/usr/bin/env bash
# The benchmark: ./benches/run.sh [--quick]. Installs what is missing (like the tests), builds in release,
# starts a private MariaDB and broker, and prints the tables BENCHMARKS.md is made of.
# --quick: 20k rows per measurement and 5 s per offered rate (the full run: 200k rows, 20 s).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-test-deps.sh >/dev/null
cargo bench --locked --bench throughput -- "$@"
