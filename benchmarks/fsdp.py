"""The update's time with the FSDP2 backend against the torch backend, on the same batch.

Each row is a fresh process (`torchrun` for the FSDP rows, gloo on 127.0.0.1) holding the
default model (135M, fp32, activation checkpointing on): one warm-up step, then the mean of the
timed steps, on a synthetic batch planned for that row's ranks (half the rows advantage +1, half
-1, so every sequence has a gradient). The baseline is the torch backend in one process with
the machine's cores as torch threads; the FSDP rows use one thread per rank.

    .venv/bin/python benchmarks/fsdp.py           # 4 x 128 tokens, 1 timed step (~1.5 min)
    .venv/bin/python benchmarks/fsdp.py --long    # 8 x 256 tokens, 2 timed steps (~6.5 min)

Last line: `fsdp_update_2_ranks_over_torch: VALUE ratio` (update time; below 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def worker(backend_name: str, rows: int, length: int, steps: int, out: Path) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from update_batch import update_batch  # beside this script

    from reins.trainer import runtime
    from reins.trainer.backend import BackendConfig, TorchBackend
    from reins.trainer.config import load_config

    config = load_config(ROOT / "examples" / "recall" / "config.yaml", [])
    backend_config = BackendConfig.model_validate(config.model_dump())
    torch.manual_seed(0)
    model, tokenizer, _ = runtime.load_policy(config, dtype=torch.float32)
    world = 1
    backend: Any
    if backend_name == "fsdp":
        from reins.trainer.fsdp import FSDPBackend
        from reins.trainer.ranks import start_process_group

        start_process_group(600)
        world = dist.get_world_size()
        backend = FSDPBackend(model, backend_config)
    else:
        backend = TorchBackend(model, backend_config)
    batch = update_batch(
        rows,
        length,
        length // 4,
        len(tokenizer),
        np.random.default_rng(0),
        dp_size=world,
        max_tokens=config.max_tokens_per_microbatch,
    )
    backend.train_step(batch)  # warm-up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        backend.train_step(batch)
        times.append(time.perf_counter() - started)
    if backend_name != "fsdp" or dist.get_rank() == 0:
        out.write_text(json.dumps({"mean_s": sum(times) / len(times), "ranks": world}))
    if backend_name == "fsdp":
        from reins.trainer.ranks import exit_rank

        dist.destroy_process_group()
        exit_rank(0)  # as `reins train` ends a rank: gloo's threads can abort the finalization


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_row(backend: str, ranks: int, args: argparse.Namespace, out: Path) -> float:
    tail = [
        "--worker", backend, "--rows", str(args.rows), "--length", str(args.length),
        "--steps", str(args.steps), "--out", str(out),
    ]  # fmt: skip
    # TMPDIR: torchrun's log folder (`torchelastic_*`) goes with the run's folder.
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": str(ROOT / "src"),
        "TMPDIR": str(out.parent),
    }
    if backend == "fsdp":
        env["OMP_NUM_THREADS"] = "1"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
            f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}", __file__, *tail,
        ]  # fmt: skip
    else:
        command = [sys.executable, __file__, *tail]
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, timeout=1800)
    return float(json.loads(out.read_text())["mean_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="8 x 256 tokens, 2 timed steps")
    parser.add_argument("--worker", choices=["torch", "fsdp"], help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rows, args.length, args.steps, args.out)
        return
    if args.long:
        args.rows, args.length, args.steps = 8, 256, 2
    out = Path(f"/tmp/reins-bench-fsdp-{os.getpid()}.json")
    print(
        f"update of {args.rows} x {args.length} tokens (default model, fp32), mean of {args.steps}"
    )
    baseline = run_row("torch", 1, args, out)
    print(f"  torch backend, 1 process, {os.cpu_count()} threads: {baseline:.2f} s (1.00x)")
    ratio = 1.0
    for ranks in (1, 2):
        seconds = run_row("fsdp", ranks, args, out)
        ratio = seconds / baseline
        print(f"  fsdp backend, {ranks} rank(s), 1 thread each: {seconds:.2f} s ({ratio:.2f}x)")
    out.unlink(missing_ok=True)
    print(f"fsdp_update_2_ranks_over_torch: {ratio:.2f} ratio")


if __name__ == "__main__":
    main()
