"""Each example's harness for one training step on the real default model (SmolLM2-135M), as
`reins train examples/<name>/config.yaml` runs it, cut to one group of two rollouts: rewards,
the agents' metrics and their tool events recorded, one training sequence per rollout.

The sandbox's context is cut to 800 tokens here (its config: 4,096), for CI's time: the 135M
model calls no tool there (0 of 20 episodes, examples/sandbox/README.md) but answers its
537-token prompt (the task this step draws) in prose up to its 512-token limit; the engine ends
that reply at the end of the shorter context instead (263 tokens; 87 s -> 60 s for this case
against 1,024)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.examples.support import recorded
from tests.required import module

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOOL_METRIC = {"search": "searches", "sandbox": "tool_calls"}
OVERRIDES = {"search": [], "sandbox": ["max_model_len=800"]}


@pytest.mark.parametrize("example", ["search", "sandbox"])
def test_one_step_on_the_default_model(
    example: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module("torch", "pip install -e '.[train]'")
    from reins.trainer.config import load_config
    from reins.trainer.runtime import train

    monkeypatch.setenv("REINS_SEARCH_CACHE", str(tmp_path / "search-cache"))
    run = load_config(
        EXAMPLES / example / "config.yaml",
        [
            f"runs_dir={tmp_path / 'runs'}",
            "steps=1",
            "tasks_per_step=1",
            "group_size=2",
            "val_every=0",
            "tensorboard=false",
            *OVERRIDES[example],
        ],
    )
    assert run.model is None  # the default model, as the example ships
    (record,) = asyncio.run(train(run))
    assert record["rollouts/trained"] == 2
    assert record["samples/per_rollout"] == 1.0  # append-only harnesses: one sequence each
    rewards, tools = recorded(run.run_dir)
    assert len(rewards) == 2
    assert record["reward/mean"] == pytest.approx(sum(r["value"] for r in rewards) / 2)
    used = sum(r["metrics"][TOOL_METRIC[example]] for r in rewards)
    assert len(tools) == used  # every tool use the agents counted is on the record
    assert record[f"agent/{TOOL_METRIC[example]}"] == pytest.approx(used / 2)
    assert all(isinstance(t["output"], str) and t["name"] for t in tools)
