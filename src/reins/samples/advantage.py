"""Group-relative advantages, at rollout level (default) or sample level (paper section 2.2).

Each estimator is one function of plain arrays: ``rewards[i]`` and ``groups[i]`` (any
integer group label) per element. At rollout level the elements are rollouts, each counted once in
its group, and a rollout's advantage is broadcast to all its sequences. At sample level (the paper's
ablation, as slime and AReaL do) the elements are sequences, each carrying its rollout's reward,
so a rollout that split into more sequences weighs more in its group's baseline.

Figure 4: rollout 1 (reward 1) splits into three samples, rollout 2 (reward 0) stays one. The
rollout-level baseline is (1 + 0) / 2 = 1/2; the sample-level one is (1 + 1 + 1 + 0) / 4 = 3/4.

A group of one element has no baseline to compare with: both estimators give it advantage 0.
Rollouts without a ``group_id`` are such groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from numpy.typing import NDArray

AdvantageEstimator = Literal["grpo", "rloo"]
AdvantageLevel = Literal["rollout", "sample"]
FloatArray = NDArray[np.float64]
IndexArray = NDArray[np.intp]


def group_index(keys: Sequence[str]) -> IndexArray:
    """Dense group index (0, 1, ...) of each key, in order of first appearance."""
    seen: dict[str, int] = {}
    return np.fromiter(
        (seen.setdefault(k, len(seen)) for k in keys), dtype=np.intp, count=len(keys)
    )


def group_key(group_id: str | None, rollout_id: str) -> str:
    """A rollout's group: its ``group_id``, or a group of its own when it has none."""
    # "\0" cannot occur in an Identifier, so a rollout's own group never collides with a group_id
    return group_id if group_id is not None else f"\0{rollout_id}"


def _dense(groups: IndexArray) -> IndexArray:
    """Renumber group indices 0..G-1 so that every index in range is used."""
    return np.unique(np.asarray(groups), return_inverse=True)[1].astype(np.intp)


def _uniform(rewards: FloatArray, groups: IndexArray) -> NDArray[np.bool_]:
    """Per element: whether every reward of its group is the same."""
    dense = _dense(groups)
    count = int(dense.max()) + 1 if len(dense) else 0
    low = np.full(count, np.inf)
    high = np.full(count, -np.inf)
    np.minimum.at(low, dense, rewards)
    np.maximum.at(high, dense, rewards)
    uniform: NDArray[np.bool_] = (low == high)[dense]
    return uniform


def _group_stats(
    rewards: FloatArray, groups: IndexArray
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Per element: its group's size, reward sum and mean."""
    groups = _dense(groups)
    n: FloatArray = np.bincount(groups).astype(np.float64)
    total: FloatArray = np.bincount(groups, weights=rewards).astype(np.float64)
    return n[groups], total[groups], (total / n)[groups]


def grpo_advantages(
    rewards: FloatArray, groups: IndexArray, *, normalize_std: bool = True, eps: float = 1e-6
) -> FloatArray:
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)``; without ``normalize_std``, ``r_i - mean_g``.

    ``std_g`` is the population standard deviation of the group's rewards (ddof 0), so a group
    whose rewards are all equal gets advantage 0.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    # paper section 2.2: the group baseline r-bar is the mean reward of the group's elements
    _, _, mean = _group_stats(rewards, groups)
    # Exactly 0 in a group of equal rewards: the float mean of eight 0.2s is not 0.2, and
    # dividing that 3e-17 by (std + eps) would make it a nonzero advantage.
    centered = np.where(_uniform(rewards, groups), 0.0, rewards - mean)
    if not normalize_std:
        return centered
    dense = _dense(groups)
    var = np.bincount(dense, weights=centered**2) / np.bincount(dense)
    return centered / (np.sqrt(var)[dense] + eps)


def rloo_advantages(rewards: FloatArray, groups: IndexArray) -> FloatArray:
    """RLOO: ``A_i = r_i - mean of the other elements of the group`` (0 for a group of one)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    n, total, _ = _group_stats(rewards, groups)
    others = n - 1.0
    # leave-one-out baseline: (sum_g - r_i) / (n_g - 1)
    baseline = np.divide(total - rewards, others, out=rewards.copy(), where=others > 0)
    return np.where(_uniform(rewards, groups), 0.0, rewards - baseline)


def advantages(
    rewards: FloatArray,
    groups: IndexArray,
    *,
    estimator: AdvantageEstimator = "grpo",
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> FloatArray:
    """The chosen estimator on one list of elements."""
    if estimator == "grpo":
        return grpo_advantages(rewards, groups, normalize_std=normalize_std, eps=eps)
    if estimator == "rloo":
        return rloo_advantages(rewards, groups)
    raise ValueError(f"unknown advantage estimator {estimator!r}; use 'grpo' or 'rloo'")


def sequence_advantages(
    rollout_rewards: FloatArray,
    rollout_groups: IndexArray,
    sequence_rollout: IndexArray,
    *,
    level: AdvantageLevel = "rollout",
    estimator: AdvantageEstimator = "grpo",
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> FloatArray:
    """Advantage of each sequence; ``sequence_rollout[j]`` is the rollout sequence ``j`` came from.

    ``level="rollout"``: statistics over rollouts (every rollout counted once, including rollouts
    that produced no sequence), broadcast to sequences. ``level="sample"``: statistics over the
    sequences themselves, each with its rollout's reward and group.
    """
    rollout_rewards = np.asarray(rollout_rewards, dtype=np.float64)
    if level == "rollout":
        # paper section 2.2: rollout-level baseline, one rollout = one element of its group
        per_rollout = advantages(
            rollout_rewards,
            rollout_groups,
            estimator=estimator,
            normalize_std=normalize_std,
            eps=eps,
        )
        return per_rollout[sequence_rollout]
    if level == "sample":
        # paper section 2.2 (ablation): sample-level baseline, every sample is an element
        return advantages(
            rollout_rewards[sequence_rollout],
            rollout_groups[sequence_rollout],
            estimator=estimator,
            normalize_std=normalize_std,
            eps=eps,
        )
    raise ValueError(f"unknown advantage level {level!r}; use 'rollout' or 'sample'")
