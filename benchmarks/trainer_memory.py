"""The trainer's peak memory (issue #17's aim: the main job's process under 3 GB).

Each figure is the peak RSS (the kernel's VmHWM) of a fresh process holding the main job's
objects, as `reins train examples/recall/config.yaml` builds them (the default 135M model in
fp32, the torch backend, the embedded engine sharing its weights), that runs three steps: the
engine samples 16 choices of 64 tokens from a 600-token prompt (a step's rollouts), then the
backend updates on a fixed batch shaped like a recall step's (16 sequences of 99 tokens, 27 of
them response tokens), called from a worker thread as the trainer's loop does. Weights,
gradients and AdamW's two moments are 4 x 540 MB in fp32; activations, logits and the engine's
KV come on top.

- `before`: the trainer until 2026-12-01: no activation checkpointing, gradients kept between
  steps, glibc's dynamic mmap threshold (the engine's prefix cache is emptied before the
  update in both rows: that change is the engine's, not a setting; docs/benchmarks.md has its
  own before and after).
- `after`: today's defaults (`gradient_checkpointing: true`, gradients freed after each step,
  `malloc_mmap_threshold_mb: 1`: blocks of 1 MB or more mapped on their own, handed back when
  freed).
  Both rows include the engine's `malloc_trim` as it enters an update and run the update on the
  engine's own thread (`EmbeddedEngine.update_weights`, as the trainer does); both are the
  engine's, not settings: docs/benchmarks.md has their before and after.
- `--long` adds each change on its own, the update in a worker thread instead of the engine's
  (the trainer until 2026-12-02), glibc's dynamic mmap threshold (until 2026-12-03), glibc's
  allocator capped (`MALLOC_ARENA_MAX=2
  MALLOC_TRIM_THRESHOLD_=0`) and a second `malloc_trim` after each update (both tried and not
  adopted: see docs/benchmarks.md), and the real main job: `reins train` on examples/recall for 2
  steps, its `memory/peak_rss_mb` metric.

Nothing is stubbed but the token IDs (random). RSS does not depend on the machine's load; the
times (generate, update) do, and are printed for the trade-off, not as figures to compare
across machines. Run: `python benchmarks/trainer_memory.py [--long]`. Last line:
`trainer_peak_rss_mb: VALUE MB` (`after`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
AIM_MB = 3000
ROWS, LENGTH, RESPONSE = 16, 99, 27

SETTINGS: dict[str, tuple[dict[str, str], list[str]]] = {
    # name: (environment, child options)
    "before": (
        {},
        ["--no-checkpointing", "--keep-grads", "--set", "malloc_mmap_threshold_mb=null"],
    ),
    "after": ({}, []),
}
EACH_CHANGE: dict[str, tuple[dict[str, str], list[str]]] = {
    "checkpointing only": ({}, ["--keep-grads"]),
    "grads freed only": ({}, ["--no-checkpointing"]),
    "after + glibc capped": ({"MALLOC_ARENA_MAX": "2", "MALLOC_TRIM_THRESHOLD_": "0"}, []),
    "after + trim after update": ({}, ["--trim-after-update"]),
    "update on another thread": ({}, ["--update-off-engine-thread"]),
    "dynamic mmap threshold": ({}, ["--set", "malloc_mmap_threshold_mb=null"]),
}


def child(
    checkpointing: bool,
    keep_grads: bool,
    trim_after: bool = False,
    engine_thread: bool = True,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Three steps in this process: its peak RSS in MB, and the time of each half."""
    import numpy as np
    import torch
    from update_batch import update_batch  # beside this script

    from reins.engine.embedded import EmbeddedEngine
    from reins.trainer import runtime
    from reins.trainer.backend import BackendConfig, TorchBackend
    from reins.trainer.config import load_config
    from reins.trainer.memory import peak_rss_mb

    if keep_grads:
        zero_grad = torch.optim.AdamW.zero_grad
        torch.optim.AdamW.zero_grad = (  # type: ignore[method-assign]
            lambda self, set_to_none=True: zero_grad(self, set_to_none=False)
        )
    config = load_config(
        ROOT / "examples" / "recall" / "config.yaml",
        [f"gradient_checkpointing={str(checkpointing).lower()}", *(overrides or [])],
    )
    runtime.configure_allocator(config)  # as `reins train` does first
    torch.manual_seed(0)
    model, tokenizer, _ = runtime.load_policy(config)
    backend = TorchBackend(
        model,
        BackendConfig.model_validate(
            {**config.model_dump(), "temperature": config.train_temperature}
        ),
    )
    engine = EmbeddedEngine(
        model,
        tokenizer,
        name="policy",
        max_batch=config.max_batch,
        max_model_len=config.max_model_len,
        prefix_cache_gb=config.prefix_cache_gb,
    )
    rng = np.random.default_rng(0)
    batch = update_batch(
        ROWS, LENGTH, RESPONSE, len(tokenizer), rng, max_tokens=config.max_tokens_per_microbatch
    )

    from reins.engine.sampling import SamplingParams

    async def rollouts() -> int:
        """16 choices of 64 tokens from a 600-token prompt, as a step's rollouts ask the engine
        (their allocations are the other half of what the allocator settings change)."""
        prompt = [int(t) for t in rng.integers(100, 5000, 600)]
        params = [SamplingParams(temperature=1.0, max_tokens=64, seed=i) for i in range(16)]
        tokens = 0
        async for item in engine.generate(prompt, params):
            tokens += hasattr(item, "token_id")
        return tokens

    def update() -> None:
        if engine_thread:  # as the trainer does (InProcessPublisher)
            engine.update_weights(lambda: backend.train_step(batch))
        else:  # the trainer until 2026-12-02: in the worker thread, engine paused
            with engine.updating_weights():
                backend.train_step(batch)
        if trim_after:  # the gradients' freed memory too (tried, not adopted)
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)

    async def steps() -> tuple[float, float]:
        generate_s = update_s = 0.0
        for _ in range(3):
            started = time.perf_counter()
            await rollouts()
            generate_s += time.perf_counter() - started
            started = time.perf_counter()
            await asyncio.to_thread(update)  # in a worker thread, as the trainer's loop runs it
            update_s += time.perf_counter() - started
        return generate_s, update_s

    generate_s, update_s = asyncio.run(steps())
    engine.close()
    return {"peak_rss_mb": round(peak_rss_mb()), "generate_s": generate_s, "update_s": update_s}


def measure(env: dict[str, str], options: list[str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", *options],
        env={**os.environ, **env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise SystemExit(f"the measuring process failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main_job_peak() -> float:
    """`reins train` on the main job for 2 steps: the largest `memory/peak_rss_mb` it reported."""
    with tempfile.TemporaryDirectory(prefix="reins-memory-") as runs:
        done = subprocess.run(
            [sys.executable, "-m", "reins.cli", "train", "examples/recall/config.yaml",
             "--set", f"runs_dir={runs}", "--set", "steps=2", "--set", "val_every=0",
             "--set", "tensorboard=false"],
            capture_output=True, text=True, timeout=1800, cwd=ROOT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"reins train failed:\n{done.stderr[-3000:]}")
        lines = (Path(runs) / "recall" / "metrics.jsonl").read_text().splitlines()
        return max(json.loads(line)["memory/peak_rss_mb"] for line in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="each change alone, and the job")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--keep-grads", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trim-after-update", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--update-off-engine-thread", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child(
            not args.no_checkpointing,
            args.keep_grads,
            args.trim_after_update,
            not args.update_off_engine_thread,
            args.set,
        )
        print(json.dumps(result))
        return

    print(
        f"trainer peak RSS, 3 steps (16 x 64 tokens sampled, an update on {ROWS} x {LENGTH}"
        " tokens) with the main job's model, backend and engine"
    )
    rows = dict(SETTINGS)
    if args.long:
        rows.update(EACH_CHANGE)
    peaks: dict[str, float] = {}
    for name, (env, options) in rows.items():
        result = measure(env, options)
        peaks[name] = result["peak_rss_mb"]
        print(
            f"  {name:<22} {peaks[name]:>6.0f} MB  {peaks[name] / peaks['before']:.2f}x before"
            f"  {peaks[name] / AIM_MB:.2f}x the aim ({AIM_MB} MB)  generate"
            f" {result['generate_s']:.1f} s, update {result['update_s']:.1f} s",
            flush=True,
        )
    if args.long:
        job = main_job_peak()
        print(f"  {'reins train, 2 steps':<22} {job:>6.0f} MB  {job / AIM_MB:.2f}x the aim")
    print(f"trainer_peak_rss_mb: {peaks['after']:.0f} MB")


if __name__ == "__main__":
    main()
