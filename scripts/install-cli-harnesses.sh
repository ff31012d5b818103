#!/usr/bin/env bash
# The coding-agent CLIs the harness tests drive (Claude Code, Codex CLI, OpenCode), pinned, with
# npm into .cache/cli-harnesses (gitignored) - never globally. Their binaries end up in
# .cache/cli-harnesses/node_modules/.bin/{claude,codex,opencode}.
#
# Idempotent: a stamp file records the pinned set of a finished install; re-running with the same
# pins is instant, a changed pin reinstalls. The folder is `.cache/cli-harnesses` in the repo root
# unless REINS_CLI_HARNESSES says otherwise. Needs node >= 18 and npm (node 20 is what we test).
#
# Each package ships a native binary as a platform-specific optional dependency (about 1 GB in all:
# Codex ships binaries for two libcs, OpenCode two builds). The postinstall scripts link them into place; OpenCode's
# runs `opencode --version`, which writes into TMPDIR, so TMPDIR is pointed inside the folder.
set -euo pipefail

CLAUDE_CODE_VERSION="2.1.197"
CODEX_VERSION="0.171.0"
OPENCODE_VERSION="1.18.33"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${REINS_CLI_HARNESSES:-$ROOT/.cache/cli-harnesses}"
STAMP="$DIR/.reins-cli-harnesses-stamp"
LOG="$DIR/npm-install.log"
PACKAGES=(
    "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION"
    "@openai/codex@$CODEX_VERSION"
    "opencode-ai@$OPENCODE_VERSION"
)
WANT="${PACKAGES[*]}"
BINARIES=(claude codex opencode)

ready() {
    [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] || return 1
    for name in "${BINARIES[@]}"; do
        [ -x "$DIR/node_modules/.bin/$name" ] || return 1
    done
}

if ready; then
    echo "cli-harnesses: $DIR is ready ($WANT)" >&2
    exit 0
fi

for tool in node npm; do
    if ! command -v "$tool" >/dev/null; then
        echo "cli-harnesses: $tool is not installed; install Node.js 20 (Debian: apt-get install" \
            "nodejs npm) and run this again" >&2
        exit 1
    fi
done
if ! node -e 'process.exit(Number(process.versions.node.split(".")[0]) < 18 ? 1 : 0)'; then
    echo "cli-harnesses: node $(node --version) is older than 18; these CLIs need node 18+" >&2
    exit 1
fi

start=$SECONDS
rm -f "$STAMP"
mkdir -p "$DIR/tmp"
# A package.json of our own makes the folder an npm project: `npm install` then puts exactly the
# pinned versions in its node_modules and never touches a global prefix.
cat >"$DIR/package.json" <<EOF
{
  "name": "reins-cli-harnesses",
  "private": true,
  "description": "Coding-agent CLIs for reins' harness tests (scripts/install-cli-harnesses.sh)",
  "dependencies": {
    "@anthropic-ai/claude-code": "$CLAUDE_CODE_VERSION",
    "@openai/codex": "$CODEX_VERSION",
    "opencode-ai": "$OPENCODE_VERSION"
  }
}
EOF
echo "cli-harnesses: installing $WANT into $DIR (about 1 GB; under a minute); log: $LOG" >&2
status=0
(cd "$DIR" && TMPDIR="$DIR/tmp" npm install --no-audit --no-fund --save-exact \
    --loglevel=warn >"$LOG" 2>&1) || status=$?
if [ "$status" != 0 ]; then
    echo "cli-harnesses: npm install failed (exit $status); the end of $LOG:" >&2
    tail -n 40 "$LOG" | sed 's/^/    /' >&2
    exit 1
fi
version_of() {
    (cd "$DIR" && TMPDIR="$DIR/tmp" HOME="$DIR/tmp" \
        timeout 60 "node_modules/.bin/$1" --version </dev/null 2>&1)
}
for name in "${BINARIES[@]}"; do
    if ! version_of "$name" >/dev/null; then
        # Seen once with downloads running beside it: the native package was there but the
        # postinstall that links it had not placed it. `npm rebuild` runs those scripts again.
        echo "cli-harnesses: \`$name --version\` failed; running the packages' install scripts again" >&2
        (cd "$DIR" && TMPDIR="$DIR/tmp" npm rebuild --loglevel=warn >>"$LOG" 2>&1) || true
    fi
    if ! version="$(version_of "$name")"; then
        echo "cli-harnesses: $name was installed but \`$name --version\` failed:" >&2
        echo "$version" | tail -n 20 | sed 's/^/    /' >&2
        exit 1
    fi
    echo "cli-harnesses: $name $(echo "$version" | tail -n 1)" >&2
done
rm -rf "$DIR/tmp"
echo "$WANT" >"$STAMP"
echo "cli-harnesses: ready in $((SECONDS - start))s" >&2
