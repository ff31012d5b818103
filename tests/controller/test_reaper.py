"""The reaper (`reins.controller.reaper`): what a controller with `die_with_parent` leaves
running when it is SIGKILLed is killed, whenever the kill comes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.controller.conftest import ROOT
from tests.controller.test_local import alive


@pytest.mark.parametrize("kind", ["command", "module"])
def test_an_agent_started_just_before_its_controller_was_killed_is_killed(
    tmp_path: Path, kind: str
) -> None:
    """The controller dies after its agent began to run and before it heard the agent's pid
    (a busy event loop between the spawn and its answer): the agent and its child die too."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    victim = subprocess.run(
        [sys.executable, "-m", "tests.controller.reaper_victim", kind, str(tmp_path / "agents"),
         str(pid_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, start_new_session=True,
    )  # fmt: skip
    assert victim.returncode == -signal.SIGKILL, victim.stderr
    running = [int(pid) for pid in (pid_dir / "r1").read_text().split()]
    try:
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in running) and time.monotonic() < deadline:
            time.sleep(0.02)  # polling /proc, bounded by the deadline
        assert [pid for pid in running if alive(pid)] == []
    finally:
        for pid in running:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
