"""Two training steps of the coding example as `reins train examples/swe/config.yaml` runs them
(after `reins swe prepare`): the default 135M model through the proxy, real mini-swe-agent, each
command in a real sandbox, the tests' reward, GRPO with the paper's default variant.

The 135M model does not fix these bugs: it rarely even writes a well-formed bash call, so the
reward is ~0 and the update changes little. What this checks is the plumbing: every rollout ran
the harness through the proxy, was rewarded by the tests with the agent's metrics, and was
trained on, with the run's metrics (samples per rollout, one-sample rollout ratio, entropy)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from reins.swe.prepare import PrepareConfig, prepare
from tests.examples.support import recorded
from tests.required import missing, module
from tests.support import stored_calls
from tests.swe.conftest import DATA, ROOT, needs_sandbox

pytestmark = pytest.mark.slow


def test_two_training_steps_on_the_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module("torch", "pip install -e '.[train]'")
    needs_sandbox()
    from reins.trainer.runtime import train

    # Short episodes for CI's time: two model calls of at most 64 tokens each.
    monkeypatch.setenv("SWE_STEP_LIMIT", "2")
    monkeypatch.setenv("SWE_MAX_TOKENS", "64")
    run = _example_run(tmp_path, "steps=2", "max_model_len=2048")
    assert (run.model, run.advantage_level, run.loss_aggregation) == (
        None,
        "rollout",
        "rollout-mean",
    )
    records = asyncio.run(train(run))
    assert [r["rollouts/trained"] for r in records] == [2, 2]
    for record in records:
        assert record["samples/per_rollout"] >= 1.0
        assert 0.0 <= record["samples/one_sample_rollout_ratio"] <= 1.0
        # Entropy is measured on the sequences the update runs: none when both rollouts of the
        # group got the same reward (advantage 0), as the 135M model's usually do.
        assert ("policy/entropy" in record) == (record["reward/mean"] == 0.5)
        assert {"agent/commands", "agent/submitted", "agent/hack_attempts"} <= record.keys()
    rewards, tools = recorded(run.run_dir)
    assert len(rewards) == 4
    for reward in rewards:
        assert reward["value"] in (0.0, 1.0)
        assert set(reward["metrics"]) == {"commands", "submitted", "hack_attempts", "patch_lines"}
        assert "agent ended: " in reward["reason"]
    assert len(tools) == sum(r["metrics"]["commands"] for r in rewards)
    with sqlite3.connect(run.run_dir / "gateway.db") as db:
        calls = db.execute(
            "SELECT rollout_id, count(*) FROM events WHERE type = 'model_request' "
            "GROUP BY rollout_id"
        ).fetchall()
        patches = [
            json.loads(d) for (d,) in db.execute("SELECT data FROM events WHERE type = 'patch'")
        ]
    assert len(calls) == 4 and all(1 <= count <= 2 for _, count in calls)
    assert len(patches) == 4


def _example_run(tmp_path: Path, *overrides: str) -> Any:
    """The example's config on a freshly prepared task set, one task of two rollouts a step."""
    from reins.trainer.config import load_config

    out = tmp_path / "prepared"
    prepare(
        PrepareConfig(instances=DATA / "instances.jsonl", repos=DATA / "repos.json", out=out,
                      test_size=1),
        say=lambda line: None,
    )  # fmt: skip
    fields = [
        f"runs_dir={tmp_path / 'runs'}",
        f"tasks={out / 'train.jsonl'}",
        f"val_tasks={out / 'test.jsonl'}",
        "tasks_per_step=1",
        "group_size=2",
        "val_every=0",
        "tensorboard=false",
        "max_parallel=2",
        "max_batch=2",
    ]
    return load_config(ROOT / "examples" / "swe" / "config.yaml", [*fields, *overrides])


def test_a_training_step_with_claude_code_as_the_harness(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same example with SWE_HARNESS=claude: the real Claude Code runs whole in each
    rollout's sandbox and reaches the engine only through the sandbox's gateway door; its calls
    are recorded by the proxy, its rollouts rewarded by the tests and trained on."""
    module("torch", "pip install -e '.[train]'")
    needs_sandbox()
    from reins.trainer.runtime import train
    from tests.harness.cli_support import CLI_BIN

    if not (CLI_BIN / "claude").exists():
        missing(f"{CLI_BIN / 'claude'} is missing: `make cli-harnesses` installs it")
    monkeypatch.setenv("REINS_CLI_HARNESSES", str(CLI_BIN.parents[1]))
    monkeypatch.setenv("SWE_HARNESS", "claude")
    monkeypatch.setenv("SWE_MAX_TOKENS", "64")
    run = _example_run(tmp_path, "steps=1", "max_model_len=8192")
    records = asyncio.run(train(run))
    assert [r["rollouts/trained"] for r in records] == [2]
    rewards, tools = recorded(run.run_dir)
    assert len(rewards) == 2
    for reward in rewards:
        assert reward["value"] in (0.0, 1.0)
        assert "agent ended: " in reward["reason"]
    assert len(tools) == sum(r["metrics"]["commands"] for r in rewards)
    calls = stored_calls(run.run_dir / "gateway.db")
    assert len(calls) >= 2
    for _, request in calls:  # Claude Code's own requests, through the door: streamed Messages
        assert (request["kind"], request["stream"], request["status"]) == ("messages", True, 200)
