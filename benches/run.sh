#!/usr/bin/env bash
# The benchmark: ./benches/run.sh [--quick] [--only SECTIONS] [--profile DIR] [--baseline PATH]. Installs what is missing
# (like the tests), builds in release, starts private servers and prints the tables BENCHMARKS.md is
# made of; the full run also draws benches/latency-vs-rate.png.
# --quick: 20k rows per measurement, 5 s per offered rate, a 100 MiB restart backlog (full: 200k rows,
#          20 s, 1 GiB).
# --only drain,huge,raw,relay,postgres,latency,restart,eos,peer,sinks,aws,debezium,checkpoint,audit: run only these sections
#          (rabbitmq, nats or redis: one of the sinks section).
# --profile DIR: record every timed outboxd run with `perf record --call-graph dwarf` into DIR.
# --baseline PATH[=LABEL]: also drain each backlog with another outboxd binary (e.g. an older
#          commit's release build), interleaved with this build's runs: before/after in one run.
# --pg-majors 15,18: the PostgreSQL majors the postgres section drains, side by side (default 15).
# --peer deltaforge=PATH: also drain a MariaDB backlog with a DeltaForge binary built outside the
#          repository (BENCHMARKS.md says how), interleaved with outboxd on the same backlog.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-test-deps.sh >/dev/null
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
# The plot's labels are drawn with DejaVu Sans.
if [ ! -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]; then
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends fonts-dejavu-core >/dev/null
fi
# The broker is Apache Kafka with the JVM options of Kafka's own start script (the test rig gives its
# brokers a small heap and a quick-starting JIT instead).
export KAFKA_HEAP_OPTS="${KAFKA_HEAP_OPTS:--Xmx1G -Xms1G}"
export KAFKA_JVM_PERFORMANCE_OPTS="${KAFKA_JVM_PERFORMANCE_OPTS:--server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -XX:MaxInlineLevel=15}"
# outboxd runs at its own default log level, as users run it (the tests' rig gives it debug).
export OUTBOXD_RIG_LOG=default
cargo bench --locked --bench throughput -- "$@"
