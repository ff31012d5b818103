"""SIGTERM (`kill PID`, a service manager's stop, `docker stop`) of `reins train` while agents
run: it stops as Ctrl-C does. The run's rollouts in flight are failed at the gateway, every agent
and its own children end, and the command says how to go on; it exits 143 (128 + SIGTERM), or
130 after Ctrl-C, which said nothing before."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path

import pytest

from tests.trainer.test_sigkill import alive, start, stuck_run, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("sig", "by"), [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")])
def test_sigterm_stops_the_run_as_ctrl_c_does(
    tmp_path: Path, tiny_model_dir: Path, sig: signal.Signals, by: str
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    agent = "tests.trainer.paced_agents:stuck"
    config, output = stuck_run(tmp_path, tiny_model_dir, "st", agent, rollout_timeout_s=120)
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
