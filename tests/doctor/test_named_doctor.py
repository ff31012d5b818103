"""`reins doctor NAME` end to end: each named harness's driver (a real library, or a real
coding-agent CLI) runs once through a private gateway and the embedded engine (the Python
harnesses through the doctor's runner in this process, the CLI through the `reins doctor`
command itself)
(the default model, served once for the module and given as `--engine`/`--tokenizer`, so that
each run does not load it again), `val` mode (greedy: the few-shot history makes the model call
the tool), two calls per run (REINS_DOCTOR_TURNS=2).

Of the CLIs only Claude Code runs here: Codex and OpenCode keep asking for commands until the
run's time limit on shared cores (minutes); their wire APIs are tested through the proxy in
tests/harness/test_cli_codex.py and test_cli_opencode.py, and their named drivers' commands and
sessions in test_named_harnesses.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reins.doctor.named import HARNESSES, availability, harness_command
from reins.doctor.runner import DoctorOptions, run_doctor
from reins.engine.prepare import prepare_default_model
from tests.embedded_support import ServedEngine, served_engine
from tests.required import missing

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CLI_DIR = Path(os.environ.get("REINS_CLI_HARNESSES", ROOT / ".cache" / "cli-harnesses"))
LIMIT_S = 1500
PYTHON = [name for name, h in HARNESSES.items() if h.binary is None]
CLIS = ["claude"]


@pytest.fixture(scope="module")
def engine() -> Iterator[ServedEngine]:
    with served_engine() as served:
        yield served


def doctor(name: str, engine: ServedEngine) -> tuple[int, dict[str, Any], str]:
    """`reins doctor` itself, as a user runs it (its own process)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "REINS_DOCTOR_TURNS": "2"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "reins.cli", "doctor", "--json", "--runs", "1", "--mode", "val",
         "--cli-dir", str(CLI_DIR), "--engine", engine.base_url,
         "--tokenizer", str(prepare_default_model()), name],
        capture_output=True, text=True, timeout=LIMIT_S, env=env,
    )  # fmt: skip
    assert done.stdout.strip(), f"exit {done.returncode}, no report:\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(done.stdout), done.stderr


def doctor_here(name: str, engine: ServedEngine) -> tuple[int, dict[str, Any], str]:
    """The doctor's runner in this process (what `reins doctor NAME` calls), without the cost
    of starting the command's interpreter for every harness."""
    progress: list[str] = []
    options = DoctorOptions(
        runs=1, mode="val", engine_url=engine.base_url, tokenizer=prepare_default_model(),
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "REINS_DOCTOR_TURNS": "2"},
    )  # fmt: skip
    report = run_doctor(harness_command(name), options, progress=progress.append)
    return (0 if report.ok else 1), report.to_json(), "\n".join(progress)


def check_trainable(code: int, report: dict[str, Any], *, exited: bool = True) -> None:
    """`exited`: the run must exit 0. Without, a run that ended otherwise (a CLI at its own turn
    limit, or at the doctor's time limit) is the doctor's `harness_exit` error, its only one."""
    errors = [f["check"] for f in report["findings"] if f["severity"] == "error"]
    if exited:
        assert (code, errors) == (0, []), report["findings"]
        assert report["rollouts"][0]["returncode"] == 0, report["findings"]
    else:
        assert errors in ([], ["harness_exit"]), report["findings"]
        assert code == (1 if errors else 0)
    assert report["ok"] is (not errors)
    assert report["trainable_calls"] >= 1
    assert report["fidelity_checked"] == report["trainable_calls"]
    assert report["fidelity_mismatched"] == 0


@pytest.mark.parametrize("name", PYTHON)
def test_a_named_python_harness_runs_and_can_be_trained(name: str, engine: ServedEngine) -> None:
    found = availability(HARNESSES[name])
    if not found.available:
        missing(f"{name}: {found.detail}")
    code, report, progress = doctor_here(name, engine)
    check_trainable(code, report)
    assert "run 1/1: exit 0" in progress
    if name == "mini-swe-agent":  # it drops rejected answers from its history, on purpose
        assert set(report["splits"]) <= {"dropped"}
    else:  # the few-shot history makes the first answer a tool call, sent back with its result
        assert report["calls"] >= 2
        assert report["tool_call_turns"] >= 1
        assert report["tool_call_merged"] == report["tool_call_turns"]
        assert report["one_sequence_ratio"] == 1.0, report["splits"]


@pytest.mark.parametrize("name", CLIS)
def test_a_named_cli_harness_runs_and_can_be_trained(name: str, engine: ServedEngine) -> None:
    found = availability(HARNESSES[name], CLI_DIR)
    if not found.available:
        missing(f"{name}: {found.detail} (`make cli-harnesses` installs the CLIs)")
    code, report, _ = doctor(name, engine)
    # A CLI keeps going while the model asks for commands (OpenCode on shared cores can reach
    # the run's time limit, Claude Code its turn limit, exit 1): what is checked is that every
    # call it made can be trained on.
    check_trainable(code, report, exited=False)
    assert report["failed_calls"] == 0
