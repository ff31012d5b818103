"""Data parallel: 2 CPU processes (torchrun, gloo on 127.0.0.1) sum to the reference gradient.

Each rank runs its share of the micro-batches and the ranks all-reduce by SUM; the result must be
the gradient of the whole step computed from the definitions (tests/trainer/reference.py), not
merely the same as one process after an Adam step (which a halved gradient would also give).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from reins.samples.batch import build_batch
from reins.trainer.backend import BackendConfig, TorchBackend
from tests.support import free_port
from tests.trainer.reference import (
    float64_model,
    reference_gradient,
    relative_error,
    split_rollouts,
)
from tests.trainer.test_gradient import TOLERANCE

ROOT = Path(__file__).resolve().parents[2]


def test_two_ranks_sum_to_the_reference_gradient(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ranks2.pt"
    # TMPDIR: torchrun's log folder (`torchelastic_*`) goes with the test's folder.
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp_path),
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        "-m", "tests.trainer.dp_worker", str(tiny_model_dir), str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    saved = torch.load(out, weights_only=False)
    distributed = saved["gradient"]
    # Both ranks' recomputed old logprobs reached rank 0: those of one process, sequence by
    # sequence (its batch planned for one rank holds the same sequences in the same order).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    alone = TorchBackend(model, BackendConfig(lr=0.0))
    wanted = alone._recomputed_old_logprobs(build_batch(split_rollouts()))
    assert len(saved["old_logprobs"]) == len(wanted)
    assert all(single.any() for single in wanted)  # every sequence has a gradient here
    for got, single in zip(saved["old_logprobs"], wanted, strict=True):
        np.testing.assert_allclose(got, single, atol=1e-5)
    # The same sequences at ratio 1 (one mini-batch: old logprobs are the forward's own).
    want = reference_gradient(
        float64_model(tiny_model_dir), build_batch(split_rollouts()).sequences
    )
    assert relative_error(distributed, want) < TOLERANCE
