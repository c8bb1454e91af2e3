#!/usr/bin/env bash
# What pgoutput's `streaming` option would change for outboxd: ./benches/pg-streaming.sh [MAJOR] [ROWS]
#
# One private PostgreSQL (MAJOR, default 18: 15 from Debian, others from the test cache that
# scripts/install-test-deps.sh fills) with an outbox table in a publication and another table
# outside it. For each of two 1 KiB-per-row transactions of ROWS rows (default 1,000,000: about
# 1 GiB), one into the other table and one into the outbox, a raw pgoutput reader (pg_recvlogical)
# reads the slot twice: with protocol 1, as outboxd does, and with protocol 2 and `streaming on`.
# Printed per run, from pg_stat_replication_slots: the bytes the server spilled to disk, the bytes
# it streamed before the commit (what a reader must hold until the commit, or drop on abort), the
# bytes the reader received, and the seconds from the commit to the reader passing it.
set -euo pipefail
cd "$(dirname "$0")/.."
MAJOR="${1:-18}"
ROWS="${2:-1000000}"
if [ "$MAJOR" = 15 ]; then
  BIN=/usr/lib/postgresql/15/bin
else
  HOME_DIR="${OUTBOXD_TEST_CACHE:-$HOME/.cache/outboxd-test}/postgres-$MAJOR"
  BIN="$HOME_DIR/bin"
  # As root, the server runs as the postgres user, who cannot reach root's home: a copy under the
  # system temp dir, as the test rig makes.
  if [ "$(id -u)" -eq 0 ] && [ -f "$HOME_DIR/.complete" ]; then
    COPY="${TMPDIR:-/tmp}/outboxd-test-postgres-$(cat "$HOME_DIR/.complete")"
    if [ ! -f "$COPY/.complete" ]; then rm -rf "$COPY.partial"; cp -a "$HOME_DIR" "$COPY.partial"; mv "$COPY.partial" "$COPY"; fi
    BIN="$COPY/bin"
  fi
fi
CLIENT=/usr/lib/postgresql/15/bin
[ -x "$BIN/postgres" ] || { echo "PostgreSQL $MAJOR is not installed in $BIN: run scripts/install-test-deps.sh" >&2; exit 1; }
DIR=$(mktemp -d /tmp/pg-streaming.XXXXXX)
chown postgres "$DIR" 2>/dev/null || true
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
as_pg() { if [ "$(id -u)" -eq 0 ]; then su postgres -s /bin/bash -c "$*"; else bash -c "$*"; fi; }
cleanup() { as_pg "$BIN/pg_ctl -D $DIR/data -m immediate stop" >/dev/null 2>&1 || true; rm -rf "$DIR"; }
trap cleanup EXIT
as_pg "$BIN/initdb -D $DIR/data -U postgres -A trust" >/dev/null
as_pg "$BIN/pg_ctl -D $DIR/data -l $DIR/log -w -o \"-p $PORT -k $DIR -c listen_addresses='' -c wal_level=logical -c max_wal_size=4GB -c shared_buffers=128MB\" start" >/dev/null
sql() { "$CLIENT/psql" -h "$DIR" -p "$PORT" -U postgres -d postgres -X -q -t -A -v ON_ERROR_STOP=1 -c "$1"; }
sql "CREATE TABLE outbox (id bigint PRIMARY KEY, aggregatetype text, aggregateid text, type text, payload text);
     CREATE TABLE other (id bigint PRIMARY KEY, body text);
     CREATE PUBLICATION p FOR TABLE outbox WITH (publish = 'insert');"
echo "PostgreSQL $("$BIN/postgres" --version | awk '{print $3}'), $ROWS rows of ~1 KiB in one transaction, logical_decoding_work_mem $(sql 'SHOW logical_decoding_work_mem')"
printf '%-8s %-30s %12s %12s %12s %10s\n' table options spilled_MB streamed_MB received_MB commit→read_s
run=0
for table in other outbox; do
  for options in "proto_version=1" "proto_version=2 streaming=on"; do
    run=$((run + 1))
    slot="s$run"
    sql "SELECT pg_create_logical_replication_slot('$slot', 'pgoutput');" >/dev/null
    opts=(-o publication_names=p)
    for o in $options; do opts+=(-o "$o"); done
    "$CLIENT/pg_recvlogical" -h "$DIR" -p "$PORT" -U postgres -d postgres -S "$slot" --start -F 1 -s 1 \
      -f "$DIR/out$run" "${opts[@]}" 2>"$DIR/recv$run.log" &
    reader=$!
    if [ "$table" = outbox ]; then
      sql "INSERT INTO outbox SELECT g, 'order', 'key-' || (g % 100), 'Created', repeat('x', 1000) FROM generate_series(1, $ROWS) g;"
    else
      sql "INSERT INTO other SELECT g, repeat('x', 1000) FROM generate_series(1, $ROWS) g;"
    fi
    end=$(sql "SELECT pg_current_wal_lsn();")
    committed=$(date +%s.%N)
    until [ "$(sql "SELECT confirmed_flush_lsn >= '$end' FROM pg_replication_slots WHERE slot_name = '$slot';")" = t ]; do
      kill -0 "$reader" 2>/dev/null || { cat "$DIR/recv$run.log" >&2; exit 1; }
      sleep 0.2
    done
    read_s=$(python3 -c "import time; print(f'{time.time() - $committed:.1f}')")
    kill "$reader"; wait "$reader" 2>/dev/null || true
    stats=$(sql "SELECT round(spill_bytes / 1e6), round(stream_bytes / 1e6) FROM pg_stat_replication_slots WHERE slot_name = '$slot';")
    received=$(python3 -c "import os; print(round(os.path.getsize('$DIR/out$run') / 1e6))")
    printf '%-8s %-30s %12s %12s %12s %10s\n' "$table" "$options" "${stats%%|*}" "${stats##*|}" "$received" "$read_s"
    sql "SELECT pg_drop_replication_slot('$slot');" >/dev/null
    sql "TRUNCATE $table; CHECKPOINT;" >/dev/null
  done
done
