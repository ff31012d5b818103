"""Data parallel: 2 CPU processes (torchrun, gloo on 127.0.0.1) make the same update as 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from reins.trainer.backend import BackendConfig, TorchBackend
from tests.support import free_port
from tests.trainer.batches import make_batch

ROOT = Path(__file__).resolve().parents[2]


def test_two_ranks_make_the_same_update_as_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    single = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    TorchBackend(single, BackendConfig(lr=1e-3)).train_step(make_batch(micro_tokens=40))

    out = tmp_path / "ranks2.pt"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        "-m", "tests.trainer.dp_worker", str(tiny_model_dir), str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    distributed = torch.load(out)
    for a, b in zip(single.parameters(), distributed, strict=True):
        # Same bound as the micro-batching test: 5 % of one Adam step (lr 1e-3).
        torch.testing.assert_close(a.detach(), b, atol=5e-5, rtol=0)
