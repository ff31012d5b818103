"""The doctor's process handling, without a model: time limits and refused setups."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from reins.doctor.runner import DoctorError, DoctorOptions, _run_process, run_doctor


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits as one where nothing reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_run_past_its_time_limit_is_killed_with_its_children(tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; child = subprocess.Popen(['sleep', '60']); "
        f"open({str(marker)!r}, 'w').write(str(child.pid)); print('started', flush=True); "
        "time.sleep(60)"
    )
    started = time.monotonic()
    returncode, tail = _run_process(
        [sys.executable, "-c", script], dict(os.environ), 3.0, tmp_path / "log"
    )
    assert returncode is None
    assert time.monotonic() - started < 30
    assert "started" in tail
    child = int(marker.read_text())
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child), "the harness's child outlived the time limit"


def test_a_run_that_exits_keeps_its_status_and_output(tmp_path: Path) -> None:
    script = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    returncode, tail = _run_process([sys.executable, "-c", script], {}, 30.0, tmp_path / "log")
    assert returncode == 3
    assert "out" in tail and "err" in tail


def test_a_run_that_exits_leaves_no_child_running(tmp_path: Path) -> None:
    """A background worker the harness left went on calling a gateway that was gone (or into
    the next run's)."""
    marker = tmp_path / "child.pid"
    script = (
        "import subprocess; child = subprocess.Popen(['sleep', '60']); "
        f"open({str(marker)!r}, 'w').write(str(child.pid))"
    )
    returncode, _ = _run_process([sys.executable, "-c", script], {}, 30.0, tmp_path / "log")
    assert returncode == 0
    child = int(marker.read_text())
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child), "the harness's child outlived its run"


@pytest.mark.parametrize(
    ("argv", "options", "message"),
    [
        ([], DoctorOptions(), "no harness command"),
        (  # before the engine loads, not after it
            ["no-such-harness-program", "x"],
            DoctorOptions(),
            "cannot start 'no-such-harness-program': no such program",
        ),
        (["./missing.py"], DoctorOptions(), "cannot start './missing.py'"),
        (["true"], DoctorOptions(runs=0), "--runs must be at least 1"),
        (["true"], DoctorOptions(tokenizer=Path("/tmp")), "--tokenizer goes with --engine"),
        (
            ["true"],
            DoctorOptions(engine_url="http://127.0.0.1:9/v1", model=Path("/tmp")),
            "--model is the embedded",
        ),
        (  # the gateway refused it later, in its raw JSON
            ["true"],
            DoctorOptions(engine_url="127.0.0.1:8000"),
            r"--engine '127.0.0.1:8000': give http://HOST:PORT \(or .../v1\)",
        ),
    ],
)
def test_a_doctor_without_a_command_or_runs_refuses(
    argv: list[str], options: DoctorOptions, message: str
) -> None:
    with pytest.raises(DoctorError, match=message):
        run_doctor(argv, options)


def test_a_tokenizer_folder_that_is_missing_or_empty_is_named(tmp_path: Path) -> None:
    # Not transformers' hub message ("Repo id must use alphanumeric chars...").
    engine = "http://127.0.0.1:9/v1"
    missing = tmp_path / "missing"
    with pytest.raises(DoctorError, match=f"--tokenizer {missing}: no such folder"):
        run_doctor(["true"], DoctorOptions(engine_url=engine, tokenizer=missing))
    with pytest.raises(DoctorError, match="no tokenizer there"):
        run_doctor(["true"], DoctorOptions(engine_url=engine, tokenizer=tmp_path))
