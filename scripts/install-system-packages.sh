#!/usr/bin/env bash
# System packages the tests need: Debian's PostgreSQL server (the store's multi-node backend is
# tested against a real one). Installs only what is missing.
set -euo pipefail

have_postgres() {
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null
}

if have_postgres; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "PostgreSQL is missing and this is not a Debian-like system: install the PostgreSQL" \
         "server (initdb, pg_ctl) yourself; the PostgreSQL tests need it." >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    SUDO="sudo"
fi
echo "installing Debian's postgresql (for the store tests)..." >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
have_postgres
