#!/usr/bin/env bash
# outboxd in one command: a private MariaDB with a ROW binlog, a throwaway Kafka-protocol broker and
# outboxd forwarding an outbox table between them, all on 127.0.0.1 in a temp dir, torn down at exit.
# It inserts a few outbox rows, prints the Kafka records they became, and shows the checkpoint.
#
# The broker is noida-db, a prebuilt Kafka-protocol server from PyPI (a 5 MB wheel, installed into
# ~/.cache/outboxd-quickstart in seconds). Where pip cannot fetch it, the script runs Apache Kafka,
# the broker the test suite uses, assembled once from Maven Central (needs Java 17 and Maven).
set -euo pipefail
cd "$(dirname "$0")/.."

START=$(date +%s)
step() { echo "== [$(( $(date +%s) - START ))s] $*"; }

if ! command -v cargo >/dev/null 2>&1; then
  echo "quickstart: cargo (Rust 1.94.1 or newer) is needed to build outboxd. Install it with:" >&2
  echo "  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y && . \"\$HOME/.cargo/env\"" >&2
  exit 1
fi

step "installing what is missing (MariaDB, build tools)"
./scripts/install-test-deps.sh --quickstart

CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/outboxd-quickstart"
VENV="$CACHE/noida-venv"
NOIDA_VERSION=0.2.3
# The server binary inside the wheel (run directly: its Python wrapper would leave it behind when
# stopped).
noida_binary() {
  "$VENV/bin/python" -c 'import importlib.resources as r; print(r.files("noida_db") / "noida-db")' 2>/dev/null
}
install_noida() {
  rm -rf "$VENV"
  python3 -m venv "$VENV" \
    && "$VENV/bin/pip" install --quiet --disable-pip-version-check --only-binary=:all: \
         --timeout 15 --retries 1 "noida-db==$NOIDA_VERSION"
}
step "installing the broker (noida-db $NOIDA_VERSION from PyPI into $VENV)"
NOIDA=""
if [ -x "$(noida_binary)" ] || install_noida; then
  NOIDA=$(noida_binary)
fi
if [ -n "$NOIDA" ] && [ -x "$NOIDA" ]; then
  BROKER_KIND=noida
else
  rm -rf "$VENV"
  step "noida-db is not installable here; assembling Apache Kafka from Maven Central instead (once)"
  ./scripts/install-test-deps.sh --broker
  BROKER_KIND=apache-kafka
fi

step "building outboxd (release; the longest step on a fresh machine)"
# Kafka's client alone (the sinks are cargo features), in a folder of its own so a full build in
# target/release stays as it is.
TARGET=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')/quickstart
cargo build --release --locked --no-default-features --features quickstart --target-dir "$TARGET" --bin outboxd --bin consume

WORK=$(mktemp -d /tmp/outboxd-quickstart.XXXXXX)
PIDS=()
cleanup() {
  status=$?
  # Newest first: outboxd before the broker it drains into, the broker before MariaDB.
  for (( i=${#PIDS[@]}-1; i>=0; i-- )); do
    kill "${PIDS[$i]}" 2>/dev/null || true
    wait "${PIDS[$i]}" 2>/dev/null || true
  done
  if [ "$status" -ne 0 ]; then
    for log in "$WORK"/*.log "$WORK"/*.err "$WORK"/broker/server.log; do
      [ -f "$log" ] && { echo "--- $log" >&2; tail -n 20 "$log" >&2; }
    done
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_for() { # wait_for DESCRIPTION PID COMMAND...: until COMMAND succeeds, while PID lives
  local what=$1 pid=$2; shift 2
  for _ in $(seq 1 300); do
    "$@" >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || { echo "quickstart: $what exited (its log follows)" >&2; exit 1; }
    sleep 0.2
  done
  echo "quickstart: timed out waiting for $what" >&2; exit 1
}

DB_PORT=$(free_port)
KAFKA_PORT=$(free_port)
SOCK="$WORK/mysqld.sock"
sql() { mariadb --socket="$SOCK" -uroot --default-character-set=utf8mb4 "$@"; }

step "starting MariaDB on 127.0.0.1:$DB_PORT (binlog ROW, FULL row image)"
cat > "$WORK/my.cnf" <<CNF
[mysqld]
datadir=$WORK/data
port=$DB_PORT
bind-address=127.0.0.1
socket=$SOCK
pid-file=$WORK/mysqld.pid
log-error=$WORK/mysqld.err
tmpdir=$WORK/tmp
log-bin=$WORK/data/mariadb-bin
binlog-format=ROW
binlog-row-image=FULL
binlog-row-metadata=FULL
server-id=1
user=$(id -un)
skip-name-resolve
innodb-buffer-pool-size=64M
CNF
mkdir -p "$WORK/tmp"
mariadb-install-db --defaults-file="$WORK/my.cnf" --user="$(id -un)" \
  --auth-root-authentication-method=normal --skip-test-db >/dev/null
/usr/sbin/mariadbd --defaults-file="$WORK/my.cnf" >/dev/null 2>&1 &
PIDS+=($!)
wait_for "MariaDB" "$!" sql -e "select 1"

sql <<'SQL'
CREATE DATABASE app;
-- The outbox table, with Debezium's column names (what outboxd routes by default).
CREATE TABLE app.outbox (
  id            BINARY(16)   NOT NULL PRIMARY KEY,
  aggregatetype VARCHAR(255) NOT NULL,
  aggregateid   VARCHAR(255) NOT NULL,
  type          VARCHAR(255) NOT NULL,
  payload       JSON,
  created_at    DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
);
-- The reader outboxd connects as.
CREATE USER 'cdc'@'127.0.0.1' IDENTIFIED BY 'quickstart';
GRANT REPLICATION SLAVE, REPLICATION CLIENT, BINLOG MONITOR, SLAVE MONITOR, SELECT ON *.* TO 'cdc'@'127.0.0.1';
SQL

step "starting the Kafka-protocol broker ($BROKER_KIND) on 127.0.0.1:$KAFKA_PORT"
if [ "$BROKER_KIND" = noida ]; then
  # It warns about a missing weak glibc symbol on older systems and runs all the same.
  "$NOIDA" start --data-dir "$WORK/broker" --host 127.0.0.1 --only kafka \
    --kafka-port "$KAFKA_PORT" >"$WORK/broker.log" 2>&1 &
else
  # A small heap: the quickstart sends three records.
  KAFKA_HEAP_OPTS="-Xmx512m" ./scripts/apache-kafka.sh run "$WORK/broker" "$KAFKA_PORT" \
    "$(free_port)" >"$WORK/broker.log" 2>&1 &
fi
PIDS+=($!)
wait_for "the broker" "$!" bash -c "exec 3<>/dev/tcp/127.0.0.1/$KAFKA_PORT"

mkdir -p "$WORK/checkpoints"
cat > "$WORK/outboxd.toml" <<TOML
name = "quickstart"

[source]
kind = "mysql"
url = "mysql://cdc@127.0.0.1:$DB_PORT/app"
tables = ["app.outbox"]
server_id = 4242

[kafka]
brokers = "127.0.0.1:$KAFKA_PORT"

[checkpoint]
dir = "$WORK/checkpoints"

[http]
listen = ""
TOML
step "outboxd.toml"
cat "$WORK/outboxd.toml"

step "starting outboxd"
OUTBOXD_SOURCE__PASSWORD=quickstart "$TARGET"/release/outboxd --config "$WORK/outboxd.toml" run \
  2>"$WORK/outboxd.log" &
OUTBOXD=$!
PIDS+=($OUTBOXD)
wait_for "outboxd" "$OUTBOXD" grep -q "binlog stream opened" "$WORK/outboxd.log"

step "inserting three events in one business transaction"
sql <<'SQL'
BEGIN;
INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES
  (UNHEX(REPLACE(UUID(), '-', '')), 'order', 'order-1', 'OrderCreated',  '{"orderId": 1, "total": 12.50}'),
  (UNHEX(REPLACE(UUID(), '-', '')), 'order', 'order-1', 'OrderPaid',     '{"orderId": 1}'),
  (UNHEX(REPLACE(UUID(), '-', '')), 'order', 'order-2', 'OrderCreated',  '{"orderId": 2, "total": 3.00}');
COMMIT;
SQL

step "records on topic outbox.event.order"
"$TARGET"/release/consume "127.0.0.1:$KAFKA_PORT" outbox.event.order 3 30

step "stopping outboxd (SIGTERM: drains acks, writes the final checkpoint)"
kill -TERM "$OUTBOXD"
wait "$OUTBOXD" || true
step "checkpoint"
"$TARGET"/release/outboxd --config "$WORK/outboxd.toml" checkpoint show
step "quickstart done"
