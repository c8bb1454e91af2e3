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

# Each sink is a cargo feature: every one alone (and none) must build without a warning (clippy
# where it is installed), and a build without them refuses a config naming one, by name. The
# whole run only: a run of some tests (arguments) skips this.
if [ "$#" -eq 0 ]; then
  at=$SECONDS
  lint=(clippy --locked -j 2 --quiet)
  cargo clippy --version >/dev/null 2>&1 || lint=(check --locked -j 2 --quiet)
  for feature in "" rabbitmq nats redis aws; do
    if [ "${lint[0]}" = clippy ]; then
      cargo "${lint[@]}" --no-default-features ${feature:+--features "$feature"} -- -D warnings
    else
      RUSTFLAGS="${RUSTFLAGS:-} -D warnings" cargo "${lint[@]}" --no-default-features ${feature:+--features "$feature"}
    fi
  done
  cargo test --locked -j 2 --quiet --lib --no-default-features -- a_sink_this_build_lacks_is_refused_naming_its_feature
  phase "building each sink feature alone" "$at"
fi

at=$SECONDS
status=0
cargo test --locked -j 2 --features failpoints "$@" || status=$?
phase "running the tests" "$at"
phase "the whole run" "$started"
exit "$status"
