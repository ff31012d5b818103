"""Advantages: GRPO and RLOO, rollout level (default) and sample level (paper 2.2, figure 4)."""

from __future__ import annotations

import numpy as np
import pytest
from samples_factory import record, separate_calls

from reins.samples import AdapterConfig, build_batch, grpo_advantages, rloo_advantages


def _figure4(level: str, **cfg: object) -> list[float]:
    """Rollout 1 (reward 1) splits into samples 1-3; rollout 2 (reward 0) is sample 4."""
    batch = build_batch(
        [
            record("r1", separate_calls([4, 4, 4]), reward=1.0, group_id="prompt"),
            record("r2", separate_calls([4]), reward=0.0, group_id="prompt"),
        ],
        AdapterConfig(advantage_level=level, **cfg),  # type: ignore[arg-type]
    )
    assert [s.rollout_id for s in batch.sequences] == ["r1", "r1", "r1", "r2"]
    return [s.advantage for s in batch.sequences]


def test_figure4_rollout_level_baseline_is_one_half() -> None:
    adv = _figure4("rollout", normalize_std=False)
    assert adv == pytest.approx([0.5, 0.5, 0.5, -0.5])  # baseline (1 + 0) / 2


def test_figure4_sample_level_baseline_is_three_quarters() -> None:
    adv = _figure4("sample", normalize_std=False)
    assert adv == pytest.approx([0.25, 0.25, 0.25, -0.75])  # baseline (1 + 1 + 1 + 0) / 4


def test_figure4_rollout_level_with_std_normalization() -> None:
    adv = _figure4("rollout", normalize_std=True, eps=0.0)
    assert adv == pytest.approx([1.0, 1.0, 1.0, -1.0])  # std of (1, 0) is 1/2


def test_figure4_sample_level_with_std_normalization() -> None:
    adv = _figure4("sample", normalize_std=True, eps=0.0)
    std = np.sqrt(3) / 4  # std of (1, 1, 1, 0)
    assert adv == pytest.approx([0.25 / std] * 3 + [-0.75 / std])


def test_figure4_rloo_rollout_level() -> None:
    adv = _figure4("rollout", estimator="rloo")
    assert adv == pytest.approx([1.0, 1.0, 1.0, -1.0])  # each one's baseline is the other


def test_figure4_rloo_sample_level() -> None:
    adv = _figure4("sample", estimator="rloo")
    assert adv == pytest.approx([1 - 2 / 3] * 3 + [-1.0])  # leave-one-out over the 4 samples


def test_grpo_eps_is_added_to_the_std() -> None:
    adv = grpo_advantages(np.array([1.0, 0.0]), np.array([0, 0]), eps=0.5)
    assert adv.tolist() == pytest.approx([0.5, -0.5])


def test_grpo_groups_are_independent() -> None:
    adv = grpo_advantages(
        np.array([1.0, 0.0, 5.0, 3.0]), np.array([0, 0, 1, 1]), normalize_std=False
    )
    assert adv.tolist() == pytest.approx([0.5, -0.5, 1.0, -1.0])


def test_equal_rewards_give_zero_advantage_under_std_normalization() -> None:
    adv = grpo_advantages(np.array([1.0, 1.0, 1.0]), np.array([0, 0, 0]))
    assert adv.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("reward", [0.2, 0.1, 0.7, 1 / 11])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_equal_inexact_rewards_give_exactly_zero_advantage(
    reward: float, normalize_std: bool
) -> None:
    # The float mean of eight 0.2s is 0.2 + 3e-17; the advantage must still be exactly 0 (the
    # trainer skips such sequences), next to a group with real variance.
    rewards = np.array([reward] * 8 + [0.0, 1.0])
    groups = np.array([0] * 8 + [1, 1])
    grpo = grpo_advantages(rewards, groups, normalize_std=normalize_std)
    assert grpo[:8].tolist() == [0.0] * 8 and grpo[8] < 0 < grpo[9]
    rloo = rloo_advantages(rewards, groups)
    assert rloo[:8].tolist() == [0.0] * 8 and rloo[8] < 0 < rloo[9]


def test_rloo_baseline_leaves_the_rollout_out() -> None:
    adv = rloo_advantages(np.array([3.0, 0.0, 0.0]), np.array([0, 0, 0]))
    assert adv.tolist() == pytest.approx([3.0, -1.5, -1.5])


def test_a_rollout_without_group_is_a_group_of_its_own_with_zero_advantage() -> None:
    batch = build_batch(
        [
            record("a", separate_calls([2]), reward=1.0, group_id="g"),
            record("b", separate_calls([2]), reward=0.0, group_id="g"),
            record("solo", separate_calls([2]), reward=1.0),
        ],
        AdapterConfig(estimator="rloo"),
    )
    assert [s.advantage for s in batch.sequences] == pytest.approx([1.0, -1.0, 0.0])


def test_a_rollout_without_sequences_still_counts_in_its_groups_baseline() -> None:
    batch = build_batch(
        [
            record("a", separate_calls([2]), reward=1.0, group_id="g"),
            record("crashed", [], reward=0.0, group_id="g"),
        ],
        AdapterConfig(normalize_std=False),
    )
    assert [s.advantage for s in batch.sequences] == pytest.approx([0.5])
