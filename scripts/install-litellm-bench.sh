#!/usr/bin/env bash
# A separate venv with LiteLLM's proxy server (`litellm[proxy]`), used only by
# `benchmarks/proxy.py` as the baseline LLM proxy. It is kept apart from .venv so that LiteLLM's
# many pins (openai, pydantic, fastapi, uvicorn, ...) never touch the project's environment.
#
# The version is pinned so that runs compare like with like. 1.106.12 is the newest release whose
# `proxy` extra resolves from the registry this project uses (1.108 and later need
# `litellm-proxy` / newer `litellm-proxy-extras` wheels that it does not carry). It also predates
# 1.107.0, which is reported as a compromised release (e.g. by the description of the PyPI package
# `litellm-check`) and is absent from the index: the script refuses that version. Override with
# LITELLM_VERSION=X.Y.Z.
#
# httptools is added so that LiteLLM's uvicorn parses HTTP with the same C parser as the stub
# engine and the reins gateway (without it uvicorn falls back to the pure-Python h11, which
# would make LiteLLM look slower than it is).
#
# Idempotent: a stamp file in the venv records a finished install; re-running is instant.
# The venv path is `.venv-litellm` in the repo root unless REINS_LITELLM_VENV says otherwise.
set -euo pipefail

LITELLM_VERSION="${LITELLM_VERSION:-1.106.12}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REINS_LITELLM_VENV:-$ROOT/.venv-litellm}"
STAMP="$VENV/.reins-litellm-stamp"
LOG="$VENV/reins-pip-install.log"
WANT="litellm[proxy]==$LITELLM_VERSION httptools"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/litellm" ]; then
    echo "litellm: $VENV is ready ($WANT)" >&2
    exit 0
fi
case "$LITELLM_VERSION" in
    1.107.0*) echo "litellm: $LITELLM_VERSION is reported compromised; refusing" >&2; exit 1 ;;
esac

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 10))'; then
    echo "litellm: $PYTHON is older than Python 3.10" >&2
    exit 1
fi

start=$SECONDS
step() { echo "litellm: [$((SECONDS - start))s] $*" >&2; }

rm -f "$STAMP"
if [ ! -x "$VENV/bin/python" ]; then
    step "creating venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
step "upgrading pip"
"${PIP[@]}" install --quiet --upgrade pip
step "installing $WANT; log: $LOG"
status=0
# shellcheck disable=SC2086  # WANT is a list of requirements
"${PIP[@]}" install --progress-bar off $WANT >"$LOG" 2>&1 || status=$?
if [ "$status" != 0 ]; then
    echo "litellm: pip failed (exit $status); the end of $LOG:" >&2
    grep -v 'is neither a file nor a directory' "$LOG" | tail -n 40 | sed 's/^/    /' >&2
    exit 1
fi

step "checking the install"
"$VENV/bin/python" - <<'EOF' >&2
import importlib.metadata as m
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import httptools  # noqa: F401
import litellm.proxy.proxy_server  # noqa: F401  (the server the benchmark runs)

print(f"    litellm {m.version('litellm')}, httptools {m.version('httptools')}")
EOF
echo "$WANT" >"$STAMP"
step "done: $VENV ($(du -sh "$VENV" | cut -f1))"
