"""The time-to-reward benchmark's ratio: async's time to sync's final validation reward over
sync's, and no ratio when sync never rose above its first validation."""

from __future__ import annotations

import math

from benchmarks.time_to_reward import Run, ratio_of


def _run(curve: list[tuple[float, float]]) -> Run:
    return Run(
        mode="sync",
        wall_s=curve[-1][0],
        curve=[(t, step, reward) for step, (t, reward) in enumerate(curve)],
        generated_per_trained=1.0,
        stale_groups=0,
    )


def test_the_ratio_times_both_runs_to_the_sync_runs_final_reward() -> None:
    sync = _run([(100, 0.125), (500, 0.300), (1000, 0.600)])
    faster = _run([(90, 0.125), (400, 0.650), (900, 0.700)])
    assert ratio_of(sync, faster) == 0.4
    never = _run([(90, 0.125), (400, 0.200), (900, 0.550)])
    assert ratio_of(sync, never) == math.inf


def test_no_ratio_when_sync_ends_no_higher_than_it_started() -> None:
    """Both runs would reach a final of 0 (or of the untrained reward) at their first
    validation: the ratio would time the first validation, not learning."""
    collapsed = _run([(113, 0.125), (535, 0.000), (1026, 0.000)])
    learned = _run([(111, 0.125), (542, 0.359), (859, 0.531)])
    assert ratio_of(collapsed, learned) is None
    flat = _run([(100, 0.125), (500, 0.141), (1000, 0.125)])
    assert ratio_of(flat, learned) is None
    assert ratio_of(learned, collapsed) == math.inf
