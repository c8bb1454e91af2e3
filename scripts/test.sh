#!/usr/bin/env bash
# The one test command: installs what is missing, then runs every test (unit + integration against
# private servers on loopback). Extra arguments go to `cargo test`. It prints how long each phase
# took (install, build, tests), so a slow machine shows where its time went.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
phase() { printf 'test.sh: %s took %d s\n' "$1" "$(($SECONDS - $2))" >&2; }

at=$SECONDS
./scripts/install-test-deps.sh
phase "installing the test servers" "$at"

# Two tests at a time (libtest's default on two cores). The caller's value wins.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-2}"
# `failpoints` compiles the fault-injection points into this test build (never into releases).
at=$SECONDS
cargo test --locked -j 2 --features failpoints --no-run "$@"
phase "building the tests" "$at"

# Each sink is a cargo feature: every one alone (and none) must build without a warning, and the
# unit tests run once without them (a config naming a sink the build lacks is refused by name).
at=$SECONDS
for feature in "" rabbitmq nats redis aws; do
  cargo clippy --locked -j 2 --quiet --no-default-features ${feature:+--features "$feature"} -- -D warnings
done
cargo test --locked -j 2 --quiet --lib --no-default-features
phase "building each sink feature alone" "$at"

at=$SECONDS
status=0
cargo test --locked -j 2 --features failpoints "$@" || status=$?
phase "running the tests" "$at"
phase "the whole run" "$started"
exit "$status"
