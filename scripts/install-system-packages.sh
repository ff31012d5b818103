#!/usr/bin/env bash
# System packages the tests need: Debian's PostgreSQL server (the store's multi-node backend is
# tested against a real one), Debian's chromium (the dashboard's browser tests drive it with
# Playwright) and Debian's bubblewrap (`bwrap`: reins.sandbox isolates agent commands with it).
# Installs only what is missing.
set -euo pipefail

have_postgres() {
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null
}

missing=()
have_postgres || missing+=(postgresql)
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v bwrap >/dev/null || missing+=(bubblewrap)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "missing: ${missing[*]}, and this is not a Debian-like system: install the PostgreSQL" \
         "server (initdb, pg_ctl), chromium (at /usr/bin/chromium) and bubblewrap (bwrap) yourself." >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    SUDO="sudo"
fi
echo "installing Debian's ${missing[*]} (for the store, dashboard and sandbox tests)..." >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
have_postgres
[ -x /usr/bin/chromium ]
command -v bwrap >/dev/null
