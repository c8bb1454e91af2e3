#!/usr/bin/env bash
# Debezium (MariaDB and Postgres connectors, the Outbox Event Router) under Kafka Connect standalone,
# for the tests and the benchmark that run it beside outboxd. Assembled from released jars on Maven
# Central (scripts/debezium/pom.xml pins the versions); Java 17+ and Maven run it, outboxd never does.
#
#   debezium.sh install                   assemble the jars into the cache (idempotent); prints the home
#   debezium.sh run WORKER CONNECTOR...   Connect standalone in the foreground (exec), logging to the file
#                                         named by $DEBEZIUM_LOG (default: the worker file's dir/connect.log);
#                                         JVM options: $DEBEZIUM_HEAP_OPTS (default -Xmx512m -Xms128m) and
#                                         $DEBEZIUM_JVM_OPTS (default -XX:+UseSerialGC), small for tests
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
POM="$HERE/debezium/pom.xml"
VERSION=$(sed -n 's:.*<debezium.version>\(.*\)</debezium.version>.*:\1:p' "$POM")
CACHE="${OUTBOXD_TEST_CACHE:-$HOME/.cache/outboxd-test}"
HOME_DIR="$CACHE/debezium-$VERSION"

die() { echo "debezium: $*" >&2; exit 1; }

install() {
  if [ -e "$HOME_DIR/lib/.complete" ]; then echo "$HOME_DIR"; return; fi
  command -v java >/dev/null 2>&1 || die "java (17 or newer) is missing: apt-get install default-jre-headless"
  local major
  major=$(java -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java.specification.version = //p')
  [ "${major%%.*}" -ge 17 ] 2>/dev/null || die "Debezium $VERSION needs Java 17 or newer; java here is ${major:-unknown}"
  command -v mvn >/dev/null 2>&1 || die "mvn is missing: apt-get install maven"
  echo "debezium: assembling Debezium $VERSION and Kafka Connect from Maven Central into $HOME_DIR" >&2
  rm -rf "$HOME_DIR.tmp"
  mkdir -p "$HOME_DIR.tmp"
  mvn -q -B -f "$POM" org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
    -DoutputDirectory="$HOME_DIR.tmp/lib" >&2 \
    || die "Maven could not fetch Debezium $VERSION (is Maven Central reachable?)"
  touch "$HOME_DIR.tmp/lib/.complete"
  rm -rf "$HOME_DIR"
  mv "$HOME_DIR.tmp" "$HOME_DIR"
  echo "$HOME_DIR"
}

run() {
  [ -e "$HOME_DIR/lib/.complete" ] || die "Debezium $VERSION is not assembled: run $0 install"
  local worker=$1; shift
  local log=${DEBEZIUM_LOG:-$(dirname "$worker")/connect.log}
  local props="$log.log4j2.properties"
  cat > "$props" <<PROPS
rootLogger.level=INFO
rootLogger.appenderRef.file.ref=file
appender.file.type=File
appender.file.name=file
appender.file.fileName=$log
appender.file.layout.type=PatternLayout
appender.file.layout.pattern=%d %p %c{1} %m%n
PROPS
  # shellcheck disable=SC2086
  exec java ${DEBEZIUM_HEAP_OPTS:--Xmx512m -Xms128m} ${DEBEZIUM_JVM_OPTS:--XX:+UseSerialGC} \
    -Dlog4j2.configurationFile="$props" -cp "$HOME_DIR/lib/*" \
    org.apache.kafka.connect.cli.ConnectStandalone "$worker" "$@"
}

case "${1:-}" in
  install) install ;;
  run) shift; [ $# -ge 2 ] || die "usage: $0 run WORKER.properties CONNECTOR.properties..."; run "$@" ;;
  *) die "usage: $0 install | run WORKER.properties CONNECTOR.properties..." ;;
esac
