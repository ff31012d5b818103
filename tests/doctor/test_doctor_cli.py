"""`reins doctor` end to end: the real command, a private gateway, the embedded engine (the
default model) and a harness script run as the command (`harnesses/`).

The first test runs the command as a new user does (it loads the model itself); the others give
it `--engine` (the default model served once for the module) and `--tokenizer`, which spares
each the ~10 s of that load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reins.engine.prepare import prepare_default_model
from tests.embedded_support import ServedEngine, served_engine

pytestmark = pytest.mark.slow

HARNESSES = Path(__file__).parent / "harnesses"
LIMIT_S = 1200
"""The whole doctor: the model's load, then each run (a few seconds per call on idle cores,
much more when the cores are shared)."""


@pytest.fixture(scope="module")
def engine() -> Iterator[ServedEngine]:
    with served_engine() as served:
        yield served


def doctor(
    script: str, *options: str, engine: ServedEngine | None = None
) -> tuple[int, dict[str, Any], str]:
    """Runs `reins doctor --json OPTIONS -- python SCRIPT`: exit status, report, progress."""
    if engine is not None:
        options = (*options, "--engine", engine.base_url, "--tokenizer",
                   str(prepare_default_model()))  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "reins.cli", "doctor", "--json", *options, "--",
         sys.executable, str(HARNESSES / script)],
        capture_output=True, text=True, timeout=LIMIT_S, env=env,
    )  # fmt: skip
    assert done.stdout.strip(), f"exit {done.returncode}, no report:\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(done.stdout), done.stderr


def test_a_harness_that_sends_its_history_back_unchanged_merges_and_passes() -> None:
    code, report, progress = doctor("two_turns.py", "--runs", "2", "--mode", "val")
    assert code == 0, report["findings"]
    assert report["ok"] is True
    assert (report["calls"], report["trainable_calls"]) == (4, 4)
    assert report["samples_per_rollout"] == 1.0
    assert report["one_sequence_ratio"] == 1.0
    assert (report["fidelity_checked"], report["fidelity_mismatched"]) == (4, 0)
    assert report["findings"] == []
    assert [r["sequences"] for r in report["rollouts"]] == [1, 1]
    assert "run 1/2: exit 0" in progress and "run 2/2: exit 0" in progress


def test_a_tool_call_sent_back_with_its_result_round_trips(engine: ServedEngine) -> None:
    code, report, _ = doctor("tool_call.py", "--runs", "1", "--mode", "val", engine=engine)
    assert code == 0, report["findings"]
    assert (report["tool_call_turns"], report["tool_call_merged"]) == (1, 1)
    assert report["calls"] >= 2
    assert report["fidelity_mismatched"] == 0
    assert report["one_sequence_ratio"] == 1.0


def test_a_harness_that_edits_its_history_splits_every_rollout(engine: ServedEngine) -> None:
    code, report, _ = doctor("edits_history.py", "--runs", "2", engine=engine)
    assert code == 0  # splits waste compute; training stays correct
    assert report["splits"] == {"transformed": 2}
    assert report["one_sequence_ratio"] == 0.0
    assert report["samples_per_rollout"] == 2.0
    example = report["split_examples"]["transformed"]
    assert "".join(example["next_prompt"]).startswith("EDIT")
    assert not "".join(example["recorded"]).startswith("EDIT")
    assert [f["check"] for f in report["findings"]] == ["split:transformed"]


def test_a_harness_whose_calls_all_fail_is_not_trainable(engine: ServedEngine) -> None:
    code, report, progress = doctor("failing.py", "--runs", "1", engine=engine)
    assert code == 1
    assert report["ok"] is False
    assert (report["calls"], report["failed_calls"], report["trainable_calls"]) == (2, 2, 0)
    severities = {f["check"]: f["severity"] for f in report["findings"]}
    assert severities == {"failed": "error", "harness_exit": "error"}
    assert "maximum context length" in report["findings"][0]["message"]
    assert "run 1/1: exit 1" in progress


def test_an_existing_engine_is_checked_with_the_tokenizer_given_and_token_only_without(
    engine: ServedEngine,
) -> None:
    from reins.doctor.runner import DoctorOptions, run_doctor

    argv = [sys.executable, str(HARNESSES / "edits_history.py")]
    options = DoctorOptions(runs=1, engine_url=engine.base_url)
    options.tokenizer = prepare_default_model()
    with_text = run_doctor(argv, options)
    options.tokenizer = None
    token_only = run_doctor(argv, options)
    assert with_text.ok is True
    assert (with_text.fidelity_checked, with_text.splits) == (2, {"transformed": 1})
    assert token_only.ok is True
    assert token_only.fidelity_checked == 0
    assert token_only.splits == {"unknown": 1}
    example = token_only.split_examples["unknown"]
    assert all(piece.isdigit() for piece in example.before + example.next_prompt)
    assert [f.check for f in token_only.findings] == ["split:unknown", "no_tokenizer"]


def test_requests_the_gateway_does_not_serve_are_reported(engine: ServedEngine) -> None:
    code, report, _ = doctor("embeds_then_chats.py", "--runs", "1", "--mode", "val", engine=engine)
    assert code == 0, report["findings"]  # the chat call is trainable: a warning, not an error
    assert report["unserved_requests"] == {"POST …/openai/v1/embeddings (404)": 2}
    (finding,) = [f for f in report["findings"] if f["check"] == "unserved"]
    assert (finding["severity"], finding["count"]) == ("warning", 2)
    assert "POST …/openai/v1/embeddings (404) x2" in finding["message"]
    assert "embeddings" in finding["fix"]
    assert report["trainable_calls"] == 1


def test_the_help_names_the_argument_not_its_python_type() -> None:
    """`reins doctor --help` showed the argument as `command... <list[str]>` (typer writes an
    argument's Python type); now it is named, and said in the command's help."""
    from typer.testing import CliRunner

    from reins.cli import app

    shown = CliRunner().invoke(app, ["doctor", "--help"], terminal_width=100)
    assert shown.exit_code == 0, shown.output
    assert "doctor [OPTIONS] [NAME | -- CMD ARGS]..." in shown.output
    said = " ".join(shown.output.split())  # as wrapped to the terminal
    assert "NAME is a named harness (see --list)" in said
    assert "reins doctor -- python agent.py" in said
    assert "list[" not in shown.output
