"""`time/rollout_tail`: from a step's median rollout finishing to its last."""

from __future__ import annotations

import pytest

from reins.trainer.loop import rollout_tail


def test_the_tail_runs_from_the_median_finish_to_the_last() -> None:
    assert rollout_tail([10.0, 11.0, 12.0, 20.0]) == pytest.approx(8.5)  # median 11.5
    assert rollout_tail([5.0, 7.0, 6.0]) == pytest.approx(1.0)  # unsorted; median 6
    assert rollout_tail([3.0, 3.0, 3.0, 3.0]) == 0.0


def test_one_rollout_or_none_has_no_tail() -> None:
    assert rollout_tail([42.0]) == 0.0
    assert rollout_tail([]) == 0.0
