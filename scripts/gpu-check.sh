#!/usr/bin/env bash
# The GPU check (#20): `reins train` with the FSDP2 backend (one torchrun rank) and the embedded
# engine on one GPU, on the recall example for a few steps; prints the step time split (rollout /
# update / publish), tokens/s, peak GPU memory and the engine-vs-trainer logprob gap as its last
# lines. Unattended, under 8 minutes.
#
# Made for a lent device machine (the device tool's notes): PyTorch and transformers are there,
# reins' other dependencies travel as wheels in .whl (scripts/gpu-wheels.sh makes them), and the
# model's weights cannot travel (64 MiB): the model is the default model's architecture and
# tokenizer (.gpu-model, made by scripts/gpu-wheels.sh) with random weights, or SHAPE=1.7b for
# SmolLM2-1.7B's. Random weights answer nothing right, so every reward is 0: a small KL penalty
# to the initial policy gives every sequence a gradient, so each update runs in full.
#
#   STEPS (4), SHAPE (135m | 1.7b), PRECISION (bf16), PYTHON (python3)
# Runs on a CPU too (slowly), which is how it was tried before any GPU was lent.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-4}
SHAPE=${SHAPE:-135m}
PRECISION=${PRECISION:-bf16}
WORK=${WORK:-/tmp/reins-gpu-check}
rm -rf "$WORK"
mkdir -p "$WORK"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" .whl/*.whl
    export PYTHONPATH="$WORK/site:$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

"$PYTHON" - "$WORK/model" "$SHAPE" <<'PY'
"""A model folder: the tokenizer and architecture of .gpu-model (or the prepared default
model), random weights; SHAPE=1.7b widens it to SmolLM2-1.7B's shape."""
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

out, shape = Path(sys.argv[1]), sys.argv[2]
source = Path(".gpu-model")
if not (source / "config.json").exists():
    from reins.engine.prepare import prepare_default_model

    source = Path(prepare_default_model())
config = AutoConfig.from_pretrained(source)
if shape == "1.7b":
    config.update({"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                   "num_attention_heads": 32, "num_key_value_heads": 32})
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.save_pretrained(out)
AutoTokenizer.from_pretrained(source).save_pretrained(out)
print(f"model: {shape} shape, {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters")
PY

"$PYTHON" -c 'import torch; print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no GPU)")'
started=$(date +%s)
timeout 420 "$PYTHON" -m torch.distributed.run --nnodes 1 --nproc-per-node 1 \
    --master-addr 127.0.0.1 --master-port 29613 -m reins.cli train examples/recall/config.yaml \
    --set backend=fsdp --set "precision=$PRECISION" --set "steps=$STEPS" --set val_every=0 \
    --set "model=$WORK/model" --set "runs_dir=$WORK/runs" --set run_name=gpu-check \
    --set checkpoint_every=0 --set kl_to_initial=true --set kl_coef=0.001 \
    --set tensorboard=false > "$WORK/train.log" 2>&1 || {
    tail -40 "$WORK/train.log"
    echo "gpu_check: FAILED (log above)"
    exit 1
}
echo "reins train: $(( $(date +%s) - started )) s for $STEPS steps"

"$PYTHON" - "$WORK/runs/gpu-check/metrics.jsonl" <<'PY'
import json
import statistics
import sys

steps = [json.loads(line) for line in open(sys.argv[1]) if "time/update" in line]
later = steps[1:] or steps  # the first step warms up (kernels, allocator)


def median(key: str) -> float:
    values = [s[key] for s in later if isinstance(s.get(key), (int, float))]
    return statistics.median(values) if values else float("nan")


for s in steps:
    print(
        f"step {s['step']}: rollout {s['time/rollout']:.1f} s, update {s['time/update']:.2f} s, "
        f"publish {s['time/publish']:.2f} s, optimizer steps {s.get('policy/optimizer_steps')}"
    )
peak = max((s.get("memory/peak_gpu_mb") or 0.0) for s in steps)
print(f"gpu_check_rollout_s: {median('time/rollout'):.2f} s (median of steps 1+)")
print(f"gpu_check_update_s: {median('time/update'):.3f} s")
print(f"gpu_check_publish_s: {median('time/publish'):.3f} s")
print(f"gpu_check_rollout_tokens_per_s: {median('throughput/rollout_tokens_per_s'):.0f} tokens/s")
print(f"gpu_check_train_tokens_per_s: {median('throughput/tokens_per_s'):.0f} tokens/s")
print(f"gpu_check_peak_gpu_mb: {peak:.0f} MB")
print(f"gpu_check_logprob_gap: {median('policy/logprob_gap'):.2e} nats")
PY
