#!/usr/bin/env bash
# Writes the generated references into docs/reference/ from the code: the configuration (from the
# config structs' JSON Schema), the command line and man page (from the clap definitions) and the
# metrics (from the registry). `cargo test docs::` fails when a checked-in file differs from them.
set -euo pipefail
cd "$(dirname "$0")/.."
# The features of the test build (scripts/test.sh), so this does not rebuild the binary the tests run.
cargo build --quiet --locked --features failpoints --bin outboxd
bin=target/debug/outboxd
out=docs/reference
mkdir -p "$out"
"$bin" reference config > "$out/configuration.md"
"$bin" reference schema > "$out/outboxd.schema.json"
"$bin" reference cli > "$out/cli.md"
"$bin" reference man > "$out/outboxd.1"
"$bin" reference metrics > "$out/metrics.md"
echo "gen-docs.sh: wrote $out/{configuration.md,outboxd.schema.json,cli.md,outboxd.1,metrics.md}" >&2
