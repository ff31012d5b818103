"""The time-to-reward benchmark's ratio: async's time to sync's final validation reward over
sync's, and no ratio when sync never rose above its first validation."""

from __future__ import annotations

import math

import pytest

from benchmarks.time_to_reward import Run, TimeSplit, ratio_of


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


def test_the_time_split_counts_the_updates_that_moved_the_policy() -> None:
    """A step whose groups all got equal rewards updates nothing (no advantage) and is quick: the
    split says how many of a run's updates did anything, so a stuck run is not read as fast."""
    moved = {"time/step": 21.0, "time/rollout": 8.0, "time/wait": 0.5, "time/build": 0.1,
             "time/update": 12.0, "time/publish": 0.4, "policy/optimizer_steps": 1.0,
             "time/rollout_tail": 0.75}  # fmt: skip
    idle = {"time/step": 1.2, "time/rollout": 0.0, "time/update": 1.1,
            "policy/optimizer_steps": 0.0, "time/rollout_tail": 0.5}  # fmt: skip
    final_validation = {"val/reward_mean": 0.44}
    split = TimeSplit.of([moved, idle, final_validation])
    assert (split.rollout_s, split.update_s, split.tail_s) == pytest.approx((8.5, 13.6, 1.25))
    assert (split.updates, split.updates_moved) == (2, 1)


def test_a_run_cut_after_n_updates_keeps_the_validations_up_to_there() -> None:
    """`--budget sync-wall` reads the same async run as the `updates` budget would: its
    validations up to sync's number of updates, its final the one at that update."""
    sync = _run([(100, 0.125), (500, 0.300), (1000, 0.600)])
    longer = _run([(50, 0.125), (250, 0.400), (500, 0.550), (750, 0.650), (950, 0.700)])
    cut = longer.cut(2)
    assert cut.curve == [(50, 0, 0.125), (250, 1, 0.400), (500, 2, 0.550)]
    assert (cut.final, cut.wall_s) == (0.550, 500)
    assert ratio_of(sync, cut) == math.inf
    assert ratio_of(sync, longer.cut(3)) == 0.75
    assert ratio_of(sync, longer) == 0.75
    assert longer.curve[-1] == (950, 4, 0.700)  # the run itself is unchanged
