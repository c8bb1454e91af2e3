#!/usr/bin/env bash
# Installs what outboxd's tests and quickstart need and a fresh machine lacks. Idempotent.
#  - Debian packages: MariaDB server/client (the live binlog source), PostgreSQL 15 server/client (the
#    logical-replication source; the tests run private servers, the package's own service is not needed),
#    build deps of librdkafka, a Java runtime and Maven (Apache Kafka), rabbitmq-server,
#    nats-server and redis-server (the RabbitMQ, NATS and Redis sinks' tests run private servers).
#  - moto's server from PyPI (the SQS and SNS sinks' tests), into a virtualenv in the test cache.
#  - Apache Kafka (KRaft), assembled once from its released jars on Maven Central into a cache dir
#    outside the repo by scripts/apache-kafka.sh (Java 17+ and Maven: installed from Debian when
#    missing); every test that produces to Kafka starts a private one.
#  - Oracle MySQL 9 from Debian's unstable suite, into a private root by scripts/mysql-9.sh.
#  - PostgreSQL 13, 14, 16, 17 and 18 server binaries from Maven Central by scripts/postgres-majors.sh.
#  - Debezium 3.5 and Kafka Connect, from Maven Central by scripts/debezium.sh (the tests that run it
#    beside outboxd).
set -euo pipefail

# --quickstart: only what deploy/quickstart.sh needs (MariaDB and the build tools); no PostgreSQL, no
# Apache Kafka (the quickstart installs a prebuilt broker from PyPI).
# --broker: only Apache Kafka (the quickstart's fallback when PyPI is out of reach).
QUICKSTART=0
BROKER_ONLY=0
if [ "${1:-}" = "--quickstart" ]; then QUICKSTART=1; fi
if [ "${1:-}" = "--broker" ]; then BROKER_ONLY=1; fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    SUDO="missing-sudo"
  fi
fi

packages=()
[ -x /usr/sbin/mariadbd ] || packages+=(mariadb-server)
command -v mariadb >/dev/null 2>&1 || packages+=(mariadb-client)
command -v mariadb-install-db >/dev/null 2>&1 || packages+=(mariadb-server)
if [ "$QUICKSTART" = 0 ]; then
  [ -x /usr/lib/postgresql/15/bin/initdb ] || packages+=(postgresql-15 postgresql-client-15)
fi
if [ "$QUICKSTART" = 0 ]; then
  # The RabbitMQ sink's tests start private nodes (own ports, own epmd); the package's service is
  # not used.
  [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || packages+=(rabbitmq-server)
  # The NATS sink's tests start private servers with JetStream (no service is used).
  command -v nats-server >/dev/null 2>&1 || packages+=(nats-server)
  # The Redis sink's tests start private servers (the package's service is not used).
  command -v redis-server >/dev/null 2>&1 || packages+=(redis-server)
  # The soak's network faults: a namespace and veth pair (iproute2), packet loss (nftables); its
  # timeline's labels (DejaVu).
  command -v ip >/dev/null 2>&1 || packages+=(iproute2)
  command -v nft >/dev/null 2>&1 || packages+=(nftables)
  [ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || packages+=(fonts-dejavu-core)
  # Apache Kafka runs on Java 17+ and is assembled by Maven.
  command -v java >/dev/null 2>&1 || packages+=(default-jre-headless)
  command -v mvn >/dev/null 2>&1 || packages+=(maven)
  # The PostgreSQL majors come as .txz archives.
  command -v xz >/dev/null 2>&1 || packages+=(xz-utils)
fi
# noida-db (the quickstart's broker) comes from PyPI into a virtualenv.
command -v python3 >/dev/null 2>&1 || packages+=(python3)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || packages+=(python3-venv)
command -v pkg-config >/dev/null 2>&1 || packages+=(pkg-config)
command -v make >/dev/null 2>&1 || packages+=(make)
command -v cc >/dev/null 2>&1 || packages+=(gcc g++)
dpkg -s libssl-dev >/dev/null 2>&1 || packages+=(libssl-dev)
dpkg -s zlib1g-dev >/dev/null 2>&1 || packages+=(zlib1g-dev)

if [ "$BROKER_ONLY" = 1 ]; then
  packages=()
  command -v java >/dev/null 2>&1 || packages+=(default-jre-headless)
  command -v mvn >/dev/null 2>&1 || packages+=(maven)
fi
if [ "${#packages[@]}" -gt 0 ] && [ "$SUDO" = missing-sudo ]; then
  echo "install-test-deps: these Debian packages are missing: ${packages[*]}" >&2
  echo "install-test-deps: run as root (or install sudo): apt-get install ${packages[*]}" >&2
  exit 1
fi
if [ "${#packages[@]}" -gt 0 ]; then
  echo "install-test-deps: installing ${packages[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi

if [ "$QUICKSTART" = 1 ]; then
  echo "install-test-deps: ready for the quickstart"
  exit 0
fi

# promtool, to check deploy/prometheus/alerts.yml (tests/deploy_files.rs): unpacked from Debian's
# prometheus package (no service installed, nothing started). Optional: without it that test checks
# the rules' YAML only.
PROMTOOL="${OUTBOXD_PROMTOOL:-$HOME/.cache/outboxd-test/promtool}"
if [ "$BROKER_ONLY" = 0 ] && [ ! -x "$PROMTOOL" ] && [ ! -e "$PROMTOOL.unavailable" ] \
   && [ "$SUDO" != missing-sudo ]; then
  tmp=$(mktemp -d)
  if (cd "$tmp" && { apt-get download prometheus >/dev/null 2>&1 \
        || { $SUDO apt-get update -qq && apt-get download prometheus >/dev/null 2>&1; }; }) \
     && dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root"; then
    mkdir -p "$(dirname "$PROMTOOL")"
    cp "$tmp/root/usr/bin/promtool" "$PROMTOOL" || true
    echo "install-test-deps: promtool unpacked to $PROMTOOL"
  else
    # Remembered, so later runs do not retry (delete the marker to try again).
    mkdir -p "$(dirname "$PROMTOOL")" && touch "$PROMTOOL.unavailable" || true
    echo "install-test-deps: promtool not available; the alert rules get the YAML check only"
  fi
  rm -rf "$tmp"
fi

# moto's server (SQS and SNS for the AWS sinks' tests), pinned, from PyPI into a virtualenv in the
# test cache (about 30 s once).
MOTO_VERSION=5.2.5
MOTO_HOME="${OUTBOXD_TEST_CACHE:-$HOME/.cache/outboxd-test}/moto-$MOTO_VERSION"
if [ "$BROKER_ONLY" = 0 ] && [ ! -x "$MOTO_HOME/bin/moto_server" ]; then
  rm -rf "$MOTO_HOME"
  python3 -m venv "$MOTO_HOME"
  "$MOTO_HOME/bin/pip" install -q --disable-pip-version-check "moto[server]==$MOTO_VERSION"
  echo "install-test-deps: moto $MOTO_VERSION installed in $MOTO_HOME"
fi

# Oracle MySQL 9 (the live MySQL source tests): from Debian's unstable suite into a private root in
# the test cache, once (about 12 s, 55 MB of packages). When the suite cannot be reached, say so
# loudly and go on: only the MySQL tests then skip, each printing why.
if [ "$BROKER_ONLY" = 0 ] && ! "$(dirname "$0")/mysql-9.sh" install >/dev/null; then
  if [ -e "${OUTBOXD_TEST_CACHE:-$HOME/.cache/outboxd-test}/mysql-9.unavailable" ]; then
    echo "install-test-deps: WARNING: Debian's unstable suite is out of reach; the MySQL 9 tests will SKIP" >&2
  else
    echo "install-test-deps: WARNING: MySQL 9 could not be installed (above); the MySQL 9 tests will FAIL" >&2
  fi
fi
# PostgreSQL 13, 14, 16, 17 and 18 (the Postgres source tests beside Debian's 15): server binaries
# from Maven Central into the test cache, once (about 30 s in all).
if [ "$BROKER_ONLY" = 0 ] && ! "$(dirname "$0")/postgres-majors.sh" install; then
  echo "install-test-deps: WARNING: some PostgreSQL majors are missing (above); their tests will FAIL" >&2
fi
# Apache Kafka: the jars from Maven Central and a formatted log directory, once (about 10 s).
KAFKA_HOME=$("$(dirname "$0")/apache-kafka.sh" install)
# Debezium under Kafka Connect (the conformance and cutover tests run it beside outboxd): its jars
# from Maven Central, once (about 50 MB).
if [ "$BROKER_ONLY" = 0 ]; then
  "$(dirname "$0")/debezium.sh" install >/dev/null
fi
echo "install-test-deps: ready (Apache Kafka: $KAFKA_HOME)"
