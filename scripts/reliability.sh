#!/usr/bin/env bash
# Runs the fault scenarios on real servers and writes RELIABILITY.md from what they measured.
# Each scenario prints one `RELIABILITY|…` line (see tests/rig/scenario.rs `report`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-test-deps.sh >/dev/null
log=$(mktemp)
# The fault-schedule section (scripts/soak.sh) is written by hand from its runs: kept as it is.
soak_section=$(awk '/^## Fault schedule/{keep=1} keep' RELIABILITY.md 2>/dev/null || true)
cargo test --locked -j 2 --features failpoints \
  --test integration -- faults:: failpoints:: mysql_pipeline:: postgres_pipeline:: replicas:: \
  --nocapture 2>&1 | tee "$log" | grep -E '^test result|RELIABILITY' || true
if grep -q 'test result: FAILED' "$log"; then
  echo "reliability: a scenario failed; RELIABILITY.md not updated" >&2
  exit 1
fi
{
  echo "# Reliability"
  echo
  echo "Every scenario ran against real servers (private MariaDB 10.11 / PostgreSQL 15, Apache Kafka 4.3)"
  echo "on $(nproc) cores, $(date -u +%Y-%m-%d). Reproduce with \`./scripts/reliability.sh\`."
  echo "\"Recovery\" is seconds from the end of the fault (or the restart) until every row had been"
  echo "consumed back, and includes about 4 s of the test consumer's polling."
  echo
  echo "| scenario | what was done | rows committed | records received | lost | duplicates | recovery (s) |"
  echo "|---|---|---:|---:|---:|---:|---:|"
  grep -h '^RELIABILITY|' "$log" | sort -u | while IFS='|' read -r _ scenario action sent received lost dups secs; do
    echo "| $scenario | $action | $sent | $received | $lost | $dups | $secs |"
  done
  echo
  echo "Lost must be 0 in every row; duplicates are the replay window (acknowledged but not yet"
  echo "checkpointed, plus in flight, plus the open transaction) and carry the \`id\` header."
  if [ -n "$soak_section" ]; then
    echo
    echo "$soak_section"
  fi
} > RELIABILITY.md
rm -f "$log"
echo "reliability: RELIABILITY.md written"
