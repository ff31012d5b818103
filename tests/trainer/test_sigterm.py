"""SIGTERM (`kill PID`, a service manager's stop, `docker stop`) of `reins train` while agents
run: it stops as Ctrl-C does. The run's rollouts in flight are failed at the gateway, every agent
and its own children end, and the command says how to go on; it exits 143 (128 + SIGTERM), or
130 after Ctrl-C, which said nothing before."""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import yaml

from tests.trainer.test_sigkill import alive, start, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("sig", "by"), [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")])
def test_sigterm_stops_the_run_as_ctrl_c_does(
    tmp_path: Path, tiny_model_dir: Path, sig: signal.Signals, by: str
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    tasks = tmp_path / "train.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"id": w, "input": {"pid_dir": str(pids)}}) + "\n" for w in ("ant", "bee")
        )
    )
    fields = {
        "run_name": "st",
        "runs_dir": str(tmp_path / "runs"),
        "tasks": str(tasks),
        "agent": "tests.trainer.paced_agents:stuck",
        "model": str(tiny_model_dir),
        "steps": 1,
        "tasks_per_step": 2,
        "group_size": 2,
        "val_every": 0,
        "max_model_len": 256,
        "rollout_timeout_s": 120,
        "tensorboard": False,
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(fields))
    output = tmp_path / "train.log"
    trainer = start(config, output)
    try:
        wait_for(lambda: len(list(pids.glob("st.*"))) == 4, trainer, output, 120)
        agents = [int(pid) for p in pids.glob("st.*") for pid in p.read_text().split()]
        trainer.send_signal(sig)
        trainer.wait(timeout=90)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    text = " ".join(output.read_text().split())
    assert trainer.returncode == 128 + sig, text
    assert f"stopped by {by}: the run's rollouts in flight were failed and its agents ended" in text
    db = tmp_path / "runs" / "st" / "gateway.db"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
        rows = connection.execute("SELECT state, reason FROM rollouts").fetchall()
    assert rows == [("failed", "the trainer stopped before this rollout ended")] * 4
    # The agents and their own children end (the controller kills each agent's group).
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in agents) and time.monotonic() < deadline:
        time.sleep(0.02)  # polling /proc, bounded by the deadline
    assert not [pid for pid in agents if alive(pid)]
