#!/usr/bin/env bash
# A randomized fault schedule against real servers, with an independent checker (tests/soak/).
#
#   scripts/soak.sh [--minutes M] [--seed S] [--source mariadb|postgres] [--sink kafka|redis|nats|rabbitmq]
#                   [--exactly-once] [--faults kill,pause,...] [--out DIR]
#
# Writes DIR/report.json (rows committed, delivered, lost, duplicated, order violations, faults by
# kind with their longest recovery, every outboxd exit, peak RSS), DIR/timeline.png and DIR/logs/.
# Exits non-zero on any loss, phantom or order violation, and with --exactly-once on any duplicate
# a read_committed consumer sees. The same seed draws the same faults (kinds, order, durations).
# Needs root (a network namespace, a tmpfs): RELIABILITY.md "Fault schedule".
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '4,5p' "$0" | sed 's/^# *//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) export OUTBOXD_SOAK_MINUTES="$2"; shift 2 ;;
    --seed) export OUTBOXD_SOAK_SEED="$2"; shift 2 ;;
    --source) export OUTBOXD_SOAK_SOURCE="$2"; shift 2 ;;
    --sink) export OUTBOXD_SOAK_SINK="$2"; shift 2 ;;
    --exactly-once) export OUTBOXD_SOAK_EXACTLY_ONCE=1; shift ;;
    --faults) export OUTBOXD_SOAK_FAULTS="$2"; shift 2 ;;
    --out) export OUTBOXD_SOAK_OUT="$(realpath -m "$2")"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "soak: unknown option $1" >&2; usage ;;
  esac
done
case "${OUTBOXD_SOAK_SINK:-kafka}" in
  kafka|redis|nats|rabbitmq) ;;
  *) echo "soak: --sink ${OUTBOXD_SOAK_SINK}: kafka, redis, nats or rabbitmq so far (README \"Not yet\")" >&2; exit 2 ;;
esac
./scripts/install-test-deps.sh >/dev/null
exec cargo test --locked -j 2 --features failpoints --test integration \
  soak::from_the_command_line -- --ignored --exact --nocapture
