#!/usr/bin/env bash
# Apache Kafka (KRaft, one node that is broker and controller) for the tests, the benchmark and anyone
# who wants a throwaway broker on loopback. Assembled from the released jars on Maven Central
# (scripts/apache-kafka/pom.xml pins the version); Java 17+ and Maven run it, outboxd never does.
#
#   apache-kafka.sh install                      assemble the jars into the cache (idempotent); prints the home
#   apache-kafka.sh run DIR PORT CPORT [PROPS]   a fresh broker in DIR, in the foreground (exec: the caller's
#                                                child is the JVM, so it can signal it; the JVM's own output
#                                                goes to the caller's); PROPS: a file of extra
#                                                server.properties lines (listeners, SASL, ACLs)
#   apache-kafka.sh start DIR PORT CPORT         the same in the background; waits until it serves, prints its pid
#   apache-kafka.sh resume DIR                   the broker `run` made in DIR again, with its data (a restart)
#   apache-kafka.sh archive                      the class-data archive `install` wrote for this JDK, if any
#                                                (for other JVMs on the same classpath: -XX:SharedArchiveFile)
#
# KAFKA_NODE_ID (default 1) gives the node another id, for a cluster of several: each node's PROPS then
# name the same controller.quorum.voters (later lines override the one-node defaults).
#
# PORT is the PLAINTEXT client listener, CPORT the controller's; both on 127.0.0.1. The broker logs to
# DIR/server.log and is ready when that file says "Kafka Server started". JVM options follow Kafka's own
# start script: KAFKA_HEAP_OPTS (default -Xmx1G -Xms1G) and KAFKA_JVM_PERFORMANCE_OPTS (default G1 as
# kafka-run-class.sh sets it); the test rig passes smaller ones.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
POM="$HERE/apache-kafka/pom.xml"
VERSION=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$POM")
CACHE="${OUTBOXD_TEST_CACHE:-$HOME/.cache/outboxd-test}"
KAFKA_HOME="$CACHE/kafka-$VERSION"

die() { echo "apache-kafka: $*" >&2; exit 1; }

# The JDK's build (from its release file, without starting a JVM): a class-data archive is only
# valid for the build that wrote it.
java_build() {
  local home
  home=$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")
  sed -n 's/^JAVA_RUNTIME_VERSION="\(.*\)"/\1/p' "$home/release" 2>/dev/null | tr -c 'A-Za-z0-9.+\n-' '_'
}

# A class-data archive (AppCDS) of the classes a broker loads, written once per JDK build: every JVM
# started on this classpath (brokers, and the Kafka tools the tests run) maps those classes instead
# of reading and verifying them from the jars. A test broker's start took 2.3 CPU s without it and
# 1.5 with it here (2026-11-28). Best effort: without an archive the JVMs start as before.
archive() {
  local build
  build=$(java_build)
  [ -n "$build" ] && echo "$KAFKA_HOME/cds/kafka-$build.jsa"
}

make_archive() {
  local jsa dir port cport pid
  jsa=$(archive) || return 0
  [ -e "$jsa" ] || [ -e "$jsa.tried" ] && return 0
  [ -w "$KAFKA_HOME" ] || return 0
  command -v flock >/dev/null 2>&1 || return 0
  mkdir -p "$KAFKA_HOME/cds"
  exec 9>"$KAFKA_HOME/cds/.lock"
  flock 9
  if [ -e "$jsa" ] || [ -e "$jsa.tried" ]; then exec 9>&-; return 0; fi
  # One attempt per JDK build: a failed one is not repeated by every later install.
  touch "$jsa.tried"
  echo "apache-kafka: writing a class-data archive for faster broker starts ($jsa)" >&2
  dir=$(mktemp -d)
  port=$((20000 + RANDOM % 20000)); cport=$((port + 1))
  configure "$dir" "$port" "$cport"
  java_command "$dir"
  "${JAVA_CMD[@]:0:1}" -XX:ArchiveClassesAtExit="$jsa.tmp" "${JAVA_CMD[@]:1}" >"$dir/stdout.log" 2>&1 9>&- &
  pid=$!
  # Interrupted meanwhile: the broker goes too.
  trap 'kill -9 "$pid" 2>/dev/null; rm -rf "$dir" "$jsa.tmp"' INT TERM
  for _ in $(seq 1 1200); do
    grep -q "Kafka Server started" "$dir/server.log" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  # A clean exit writes the archive; one that does not end within 30 s is killed and discarded.
  kill "$pid" 2>/dev/null
  for _ in $(seq 1 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null; rm -f "$jsa.tmp"; fi
  wait "$pid" 2>/dev/null || true
  trap - INT TERM
  # Kept only if a JVM on this classpath maps it (-Xshare:on refuses a bad or truncated one).
  if [ -s "$jsa.tmp" ] && java -XX:SharedArchiveFile="$jsa.tmp" -Xshare:on -cp "$KAFKA_HOME/lib/*" \
      -version >/dev/null 2>&1; then
    mv "$jsa.tmp" "$jsa"
  else
    rm -f "$jsa.tmp"; echo "apache-kafka: no class-data archive (brokers start without it)" >&2
  fi
  rm -rf "$dir"
  exec 9>&-
}

install() {
  if [ -e "$KAFKA_HOME/lib/.complete" ] && [ -e "$KAFKA_HOME/template/meta.properties" ]; then
    ( make_archive ) || echo "apache-kafka: no class-data archive (brokers start without it)" >&2
    echo "$KAFKA_HOME"; return
  fi
  command -v java >/dev/null 2>&1 || die "java (17 or newer) is missing: apt-get install default-jre-headless"
  local major
  major=$(java -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java.specification.version = //p')
  [ "${major%%.*}" -ge 17 ] 2>/dev/null || die "Apache Kafka $VERSION needs Java 17 or newer; java here is ${major:-unknown}"
  command -v mvn >/dev/null 2>&1 || die "mvn is missing: apt-get install maven"
  echo "apache-kafka: assembling Apache Kafka $VERSION from Maven Central into $KAFKA_HOME" >&2
  rm -rf "$KAFKA_HOME.tmp"
  mkdir -p "$KAFKA_HOME.tmp"
  mvn -q -B -f "$POM" org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
    -DoutputDirectory="$KAFKA_HOME.tmp/lib" >&2 \
    || die "Maven could not fetch Apache Kafka $VERSION (is Maven Central reachable?)"
  touch "$KAFKA_HOME.tmp/lib/.complete"
  # One formatted log directory, copied for every broker: formatting starts a JVM of its own (about
  # a second of CPU). Formatted for a static quorum (controller.quorum.voters), it holds no port.
  mkdir -p "$KAFKA_HOME.tmp/template"
  cat > "$KAFKA_HOME.tmp/format.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:1
listeners=PLAINTEXT://127.0.0.1:2,CONTROLLER://127.0.0.1:1
controller.listener.names=CONTROLLER
log.dirs=$KAFKA_HOME.tmp/template
EOF
  java -cp "$KAFKA_HOME.tmp/lib/*" kafka.tools.StorageTool format -t "$(java -cp "$KAFKA_HOME.tmp/lib/*" \
    kafka.tools.StorageTool random-uuid)" -c "$KAFKA_HOME.tmp/format.properties" >/dev/null \
    || die "formatting a log directory failed (Kafka's message is above)"
  rm -rf "$KAFKA_HOME"
  mv "$KAFKA_HOME.tmp" "$KAFKA_HOME"
  ( make_archive ) || echo "apache-kafka: no class-data archive (brokers start without it)" >&2
  echo "$KAFKA_HOME"
}

configure() {
  local dir=$1 port=$2 cport=$3 extra=${4:-}
  [ -e "$KAFKA_HOME/lib/.complete" ] || die "Apache Kafka $VERSION is not assembled: run $0 install"
  mkdir -p "$dir"
  rm -rf "$dir/data" "$dir/server.log"
  cp -r "$KAFKA_HOME/template" "$dir/data"
  local node=${KAFKA_NODE_ID:-1}
  if [ "$node" != 1 ]; then
    # The template was formatted as node 1; a log directory's id must be its own.
    local id
    id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')
    sed -i "s/^node.id=.*/node.id=$node/; s/^directory.id=.*/directory.id=$id/" "$dir/data/meta.properties"
  fi
  {
    echo "process.roles=broker,controller"
    echo "node.id=${KAFKA_NODE_ID:-1}"
    echo "controller.quorum.voters=${KAFKA_NODE_ID:-1}@127.0.0.1:$cport"
    echo "controller.listener.names=CONTROLLER"
    echo "log.dirs=$dir/data"
    # One node: every internal topic has one replica.
    echo "offsets.topic.replication.factor=1"
    echo "offsets.topic.num.partitions=1"
    echo "transaction.state.log.replication.factor=1"
    echo "transaction.state.log.min.isr=1"
    echo "transaction.state.log.num.partitions=1"
    echo "share.coordinator.state.topic.replication.factor=1"
    echo "share.coordinator.state.topic.min.isr=1"
    echo "group.initial.rebalance.delay.ms=0"
    if [ -n "$extra" ]; then
      cat "$extra"
    else
      echo "listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport"
      echo "advertised.listeners=PLAINTEXT://127.0.0.1:$port"
      echo "inter.broker.listener.name=PLAINTEXT"
      echo "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    fi
  } > "$dir/server.properties"
  cat > "$dir/log4j2.properties" <<EOF
status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = $dir/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
EOF
}

java_command() {
  local dir=$1
  # shellcheck disable=SC2206
  local heap=(${KAFKA_HEAP_OPTS:--Xmx1G -Xms1G})
  # shellcheck disable=SC2206
  local perf=(${KAFKA_JVM_PERFORMANCE_OPTS:--server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -XX:MaxInlineLevel=15})
  local share=()
  local jsa
  jsa=$(archive) && [ -e "$jsa" ] && share=(-XX:SharedArchiveFile="$jsa")
  JAVA_CMD=(java "${heap[@]}" "${perf[@]}" "${share[@]}" -Djava.awt.headless=true
    "-Dlog4j2.configurationFile=$dir/log4j2.properties" -cp "$KAFKA_HOME/lib/*"
    kafka.Kafka "$dir/server.properties")
}

case "${1:-}" in
  install)
    install
    ;;
  archive)
    jsa=$(archive) && [ -e "$jsa" ] && echo "$jsa"
    exit 0
    ;;
  run)
    [ $# -ge 4 ] || die "usage: $0 run DIR PORT CONTROLLER_PORT [EXTRA_PROPERTIES_FILE]"
    configure "$2" "$3" "$4" "${5:-}"
    java_command "$2"
    exec "${JAVA_CMD[@]}"
    ;;
  resume)
    [ $# -eq 2 ] && [ -e "$2/server.properties" ] || die "usage: $0 resume DIR (a DIR that $0 run made)"
    java_command "$2"
    exec "${JAVA_CMD[@]}"
    ;;
  start)
    [ $# -eq 4 ] || die "usage: $0 start DIR PORT CONTROLLER_PORT"
    configure "$2" "$3" "$4"
    java_command "$2"
    "${JAVA_CMD[@]}" > "$2/stdout.log" 2>&1 &
    pid=$!
    # Interrupted while waiting: the broker goes too.
    trap 'kill "$pid" 2>/dev/null' INT TERM
    for _ in $(seq 1 1200); do
      if grep -q "Kafka Server started" "$2/server.log" 2>/dev/null; then trap - INT TERM; echo "$pid"; exit 0; fi
      kill -0 "$pid" 2>/dev/null || { tail -20 "$2/server.log" "$2/stdout.log" >&2; die "the broker exited"; }
      sleep 0.05
    done
    kill "$pid"; die "the broker did not start within 60 s (see $2/server.log)"
    ;;
  *)
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
