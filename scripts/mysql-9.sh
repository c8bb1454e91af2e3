#!/usr/bin/env bash
# Oracle MySQL 9 for the tests and the benchmark, from Debian's unstable suite, in a private root: its
# binaries need a newer glibc and libstdc++ than Debian 12 has, so they run with their own libraries
# through their own loader. Nothing is installed system-wide and no service is started; outboxd never
# runs any of it.
#
#   mysql-9.sh install        download and unpack once (idempotent), then write an initialized data
#                             directory the rig copies per server; prints the root. Exits 1 with the
#                             reason when the suite cannot be reached; the reason is also kept in
#                             mysql-9.unavailable (in the cache) so the MySQL tests skip visibly instead of failing.
#   mysql-9.sh mysqld ARGS    the server, in the foreground (exec: the caller's child is mysqld)
#   mysql-9.sh mysql ARGS     the client
#   mysql-9.sh mysqlbinlog ARGS
#   mysql-9.sh root           the root, when installed
#
# The dependency list is resolved from the suite itself (`apt-cache depends --recurse` of the two
# MySQL packages, libraries only): the suite rolls, and soname-named packages change names.
set -euo pipefail
CACHE="${OUTBOXD_TEST_CACHE:-$HOME/.cache/outboxd-test}"
HOME9="$CACHE/mysql-9"
ROOT="$HOME9/root"
LIBS="$ROOT/usr/lib/x86_64-linux-gnu"

die() { echo "mysql-9: $*" >&2; exit 1; }

# The Debian mirror the machine already uses (deb822 or one-line sources), for the unstable suite.
mirror() {
  local m
  m=$(sed -n 's/^URIs: *\([^ ]*debian\/*\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
  [ -n "$m" ] || m=$(sed -n 's/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*debian\/*\) .*/\2/p' \
    /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -1)
  echo "${m:-http://deb.debian.org/debian}"
}

run() {
  local bin=$1; shift
  [ -e "$HOME9/.complete" ] || die "not installed: run scripts/mysql-9.sh install"
  exec "$LIBS/ld-linux-x86-64.so.2" --library-path "$LIBS" "$bin" "$@"
}

install() {
  if [ -e "$HOME9/.complete" ]; then echo "$ROOT"; return 0; fi
  mkdir -p "$CACHE"
  # One install at a time per cache: a second one waits, then finds the first one's work.
  exec 8>"$HOME9.lock"
  flock 8
  if [ -e "$HOME9/.complete" ]; then echo "$ROOT"; return 0; fi
  local apt="$HOME9/apt" tmp reason
  rm -rf "$HOME9" && mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$HOME9/debs" "$ROOT"
  rm -f "$HOME9.unavailable"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $(mirror) sid main" >"$apt/sources.list"
  local o=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
           -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o APT::Sandbox::User=root
           -o Dir::State::Status=/dev/null -o APT::Update::Error-Mode=any)
  if ! reason=$(apt-get "${o[@]}" update -qq 2>&1); then
    unavailable "apt-get update of the unstable suite failed: $reason"
  fi
  local pkgs
  pkgs=$(apt-cache "${o[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
           --no-replaces --no-enhances mysql-server-core mysql-client-core 2>/dev/null \
         | grep -v '^ ' | grep -E '^(lib|mysql-)' | grep -v '^libperl' | sort -u) || true
  # Not a network problem: fail rather than skip (the recipe needs a look).
  echo "$pkgs" | grep -qx mysql-server-core || die "the unstable suite lists no mysql-server-core (apt-cache depends)"
  # shellcheck disable=SC2086
  if ! reason=$(cd "$HOME9/debs" && apt-get "${o[@]}" download $pkgs 2>&1); then
    unavailable "apt-get download failed: $reason"
  fi
  for d in "$HOME9"/debs/*.deb; do dpkg-deb -x "$d" "$ROOT"; done
  rm -rf "$HOME9/debs" "$apt"
  # One initialized data directory (3-6 s): each server the rig starts copies it instead.
  tmp="$HOME9/template"
  mkdir -p "$tmp"
  if ! reason=$("$LIBS/ld-linux-x86-64.so.2" --library-path "$LIBS" "$ROOT/usr/sbin/mysqld" --no-defaults \
      --basedir="$ROOT/usr" --lc-messages-dir="$ROOT/usr/share/mysql" --plugin-dir="$ROOT/usr/lib/mysql/plugin" \
      --user=root --secure-file-priv="$tmp" --datadir="$tmp/data" --innodb-buffer-pool-size=32M \
      --innodb-redo-log-capacity=8M \
      --initialize-insecure 2>&1); then
    die "mysqld --initialize-insecure failed: $reason"
  fi
  # A copy must get its own server_uuid: mysqld writes a new auto.cnf when it is missing.
  rm -f "$tmp/data/auto.cnf"
  "$LIBS/ld-linux-x86-64.so.2" --library-path "$LIBS" "$ROOT/usr/sbin/mysqld" --version >"$HOME9/version"
  touch "$HOME9/.complete"
  echo "$ROOT"
}

# The suite could not be fetched (network, mirror): recorded, so the MySQL tests skip and say why.
unavailable() {
  mkdir -p "$CACHE"
  local why="$*"
  printf '%s\n' "${why:0:2000}" >"$HOME9.unavailable"
  rm -rf "$HOME9/debs" "$HOME9/apt"
  die "$*"
}

case "${1:-}" in
  install) install ;;
  mysqld) shift; run "$ROOT/usr/sbin/mysqld" "$@" ;;
  mysql) shift; run "$ROOT/usr/bin/mysql" "$@" ;;
  mysqlbinlog) shift; run "$ROOT/usr/bin/mysqlbinlog" "$@" ;;
  root) [ -e "$HOME9/.complete" ] || die "not installed: run scripts/mysql-9.sh install"; echo "$ROOT" ;;
  *) die "usage: mysql-9.sh install | mysqld ARGS | mysql ARGS | mysqlbinlog ARGS | root" ;;
esac
