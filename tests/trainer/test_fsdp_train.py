"""`reins train` with `backend: fsdp` on 2 CPU ranks (torchrun, gloo on 127.0.0.1), as a user
launches it: rank 0 runs the gateway, the embedded engine, the agents and the loop; rank 1 holds
the other shard and follows. Real parts throughout, a tiny random model for speed."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import free_port
from tests.trainer.test_loop import metrics, tasks_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _reins_train(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # TMPDIR: torchrun's log folder (`torchelastic_*`) goes with the run's folder.
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(config.parent),
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        "--no-python", str(Path(sys.executable).parent / "reins"), "train", str(config), *extra,
    ]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def run_fields(tmp_path: Path, model: Path) -> dict[str, Any]:
    return {
        "run_name": "sharded",
        "runs_dir": str(tmp_path / "runs"),
        "tasks": str(tasks_file(tmp_path, "train.jsonl", ["ant", "bee", "cat", "dog", "eel"])),
        "agent": "tests.trainer.agents:two_calls",
        "model": str(model),
        "backend": "fsdp",
        "steps": 4,
        "tasks_per_step": 2,
        "group_size": 2,
        "val_every": 0,
        "lr": 1e-3,
        "max_model_len": 256,
        "rollout_timeout_s": 120,
        "tensorboard": False,
        "checkpoint_every": 1,
    }


def test_a_sharded_run_trains_publishes_to_the_engine_and_resumes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(run_fields(tmp_path, tiny_model_dir)))
    done = _reins_train(config)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    run_dir = tmp_path / "runs" / "sharded"
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [r["weight_version"] for r in records] == [1, 2, 3, 4]
    assert all(r["rollouts/trained"] == 4 for r in records)
    assert_engine_serves_each_update(records)
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "step-000004" / "sharded").iterdir())
    assert [name for name in shards if name.endswith(".distcp")] == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]

    resumed = _reins_train(config, "--resume", "--set", "steps=6")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert [r["weight_version"] for r in records[4:]] == [5, 6]
    # The resumed engine serves the checkpoint's weights, not the model folder's.
    gaps = [r["policy/logprob_gap"] for r in records[4:] if "policy/logprob_gap" in r]
    assert gaps, "no resumed step had a gradient (rewards all equal)"
    assert max(gaps) < 1e-4, gaps
    state = json.loads((run_dir / "checkpoints" / "step-000006" / "trainer.json").read_text())
    assert state["next_step"] == 6


def assert_engine_serves_each_update(records: list[dict[str, Any]]) -> None:
    """After an update, the engine serves the trainer's new weights: the logprobs it sampled
    with are the trainer's own before the next update (a stale engine would be lr-far off)."""
    checked = 0
    for before, after in itertools.pairwise(records):
        # (a gap is measured on the sequences an update runs: none when all rewards are equal)
        if before["policy/optimizer_steps"] >= 1 and "policy/logprob_gap" in after:
            assert after["policy/logprob_gap"] < 1e-4, (before, after)
            checked += 1
    assert checked, "no update was followed by a step with a gradient (rewards all equal)"


def test_a_sharded_lora_run_serves_the_merged_adapters(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """LoRA on 2 ranks: rank 0's engine (the base model, no adapters) is handed the gathered
    weights with the adapters merged in after each update; a rank that initialised its adapters
    differently, or a wrong merge, would leave a gap between the engine's logprobs and the
    trainer's."""
    fields = {
        **run_fields(tmp_path, tiny_model_dir),
        "steps": 3,
        "lr": 1e-2,  # adapters start at zero effect: a large step for a visible change
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(fields))
    done = _reins_train(config)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = metrics(tmp_path / "runs" / "sharded")
    assert [r["weight_version"] for r in records] == [1, 2, 3]
    assert_engine_serves_each_update(records)
