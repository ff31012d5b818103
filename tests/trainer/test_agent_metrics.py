"""The agents' own numbers (`report_reward(metrics=...)`) become the step's `agent/*` means."""

from __future__ import annotations

from reins.samples.records import RolloutRecord
from reins.trainer.loop import agent_metric_means


def record(rollout_id: str, **metrics: float) -> RolloutRecord:
    return RolloutRecord(rollout_id=rollout_id, reward=0.0, calls=[], metrics=dict(metrics))


def test_each_metric_is_averaged_over_the_rollouts_that_reported_it() -> None:
    records = [
        record("a", searches=1, answered=1),
        record("b", searches=3, answered=0),
        record("c", searches=2),
        record("d"),
    ]
    assert agent_metric_means(records, "val/agent/") == {
        "val/agent/answered": 0.5,
        "val/agent/searches": 2.0,
    }
    assert agent_metric_means([record("e")], "agent/") == {}
