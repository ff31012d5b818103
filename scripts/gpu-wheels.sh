#!/usr/bin/env bash
# What scripts/gpu-check.sh needs on a lent device machine that it lacks, made here: reins'
# pure-Python dependencies (and the compiled ones, for CPython 3.12 on x86-64) as wheels in
# .whl, and the default model's tokenizer and config in .gpu-model. Both folders are ignored by
# git; the device tool carries them (`carry: [".whl", ".gpu-model"]`). The versions are this
# venv's, so the device runs what the tests ran.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_PY=${VENV_PY:-.venv/bin/python}
PACKAGES=(fastapi starlette uvicorn pydantic pydantic-core pydantic-settings python-dotenv
    annotated-types typing-inspection sqlalchemy greenlet aiosqlite asyncpg orjson openai jiter
    distro)
rm -rf .whl .gpu-model
mkdir -p .whl .gpu-model
for name in "${PACKAGES[@]}"; do
    version=$("$VENV_PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
    if [ -z "$version" ]; then
        echo "gpu-wheels: $name is not in $VENV_PY's environment" >&2
        exit 1
    fi
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$name==$version"
done
model=$("$VENV_PY" -c 'from reins.engine.prepare import prepare_default_model as p; print(p())')
for file in config.json generation_config.json tokenizer.json tokenizer_config.json \
    special_tokens_map.json; do
    [ -f "$model/$file" ] && cp "$model/$file" .gpu-model/
done
du -sh .whl .gpu-model
