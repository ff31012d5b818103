"""Importance correction for tokens the engine sampled under other weights than the trainer's.

A call's recorded logprobs are the behaviour policy's (the engine's, with the weights that
served it); the update's ratio is taken against the trainer's own logprobs of the same tokens
(`old_logprobs: recompute`). The two differ by the engine's numerics and, in async training, by
the updates between serving and training: a rollout can even span an update (paper 2.4), its
early calls served by older weights than its late ones. Two corrections, each off unless set:

- **token level, truncated importance sampling**: each token's loss is weighted by
  `min(exp(trainer - engine), tis_cap)` (the logprob ratio of the weights being trained to the
  weights that sampled it, capped so a rare token cannot dominate the step);
- **rollout level, masking**: a rollout whose mean log-ratio over its tokens is outside
  `[-log(mask_ratio), log(mask_ratio)]` (its geometric-mean ratio beyond `mask_ratio` either way)
  is left out whole, every sequence of it, so its samples never train half-corrected.

Pure functions on plain arrays; the backend calls them with the logprobs it recomputed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reins.samples.batch import TrainingSequence


@dataclass(frozen=True)
class CorrectionStats:
    """What the correction saw and did, over tokens with both logprobs known."""

    tokens: int = 0
    ratio_mean: float = 1.0
    ratio_min: float = 1.0
    ratio_max: float = 1.0
    clipped_fraction: float = 0.0
    """Tokens whose ratio was above `tis_cap` (0 when the cap is off)."""
    rollouts: int = 0
    """Rollouts with a ratio known for at least one token (those the mask may leave out)."""
    masked_rollouts: int = 0
    masked_rollout_ids: frozenset[str] = frozenset()
    """The rollouts left out whole: the update trained none of their tokens."""
    gap_by_lag: Mapping[int, float] = field(default_factory=dict)
    """Mean |trainer - engine| logprob per token, by the serving version's lag behind the
    trained one (0: served by the weights being trained)."""

    def as_metrics(self) -> dict[str, float]:
        if not self.tokens:
            return {}
        out = {
            "correction/ratio_mean": self.ratio_mean,
            "correction/ratio_min": self.ratio_min,
            "correction/ratio_max": self.ratio_max,
            "correction/clipped_fraction": self.clipped_fraction,
            "correction/masked_rollouts": float(self.masked_rollouts),
            "correction/masked_fraction": self.masked_rollouts / max(self.rollouts, 1),
        }
        for lag, gap in sorted(self.gap_by_lag.items()):
            out[f"correction/logprob_gap_lag{lag}"] = gap
        return out


def correction_weights(
    sequences: Sequence[TrainingSequence],
    trainer_logprobs: Sequence[np.ndarray[Any, Any] | None],
    *,
    tis_cap: float | None,
    mask_ratio: float | None,
    version_lags: Mapping[int, int] | None = None,
) -> tuple[list[np.ndarray[Any, Any]], CorrectionStats]:
    """Per sequence, a multiplier for each token's loss weight (aligned with `token_ids`: 1.0
    where nothing is known or nothing applies), and the statistics.

    `trainer_logprobs[i]`: the trainer's logprob of each token of sequence i, aligned with its
    `token_ids`, or None for a sequence the update does not run (no gradient: nothing to weigh).
    The engine's are the sequence's `old_logprobs` (NaN where the engine gave none).
    `version_lags`: serving version -> updates behind the trained weights, for `gap_by_lag`."""
    if tis_cap is not None and tis_cap <= 0:
        raise ValueError(f"tis_cap must be positive, not {tis_cap}")
    if mask_ratio is not None and mask_ratio <= 1:
        raise ValueError(f"mask_ratio must be above 1 (a bound on the ratio), not {mask_ratio}")
    multipliers = [np.ones(len(s.token_ids), dtype=np.float32) for s in sequences]
    log_ratios: list[np.ndarray[Any, Any]] = []
    by_rollout: dict[tuple[str, int], list[int]] = defaultdict(list)
    rollout_sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    gap_sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for index, (sequence, trainer) in enumerate(zip(sequences, trainer_logprobs, strict=True)):
        key = (sequence.rollout_id, sequence.attempt_id)
        by_rollout[key].append(index)
        if trainer is None:
            continue
        known = sequence.loss_mask & ~np.isnan(sequence.old_logprobs)
        known[0] = False  # the first token has no prediction
        positions = np.flatnonzero(known)
        log_ratio = trainer[positions].astype(np.float64) - sequence.old_logprobs[positions]
        log_ratios.append(log_ratio)
        sums = rollout_sums[key]
        sums[0] += float(log_ratio.sum())
        sums[1] += len(positions)
        if tis_cap is not None:
            multipliers[index][positions] = np.minimum(np.exp(log_ratio), tis_cap)
        if version_lags is not None:
            _add_gaps(sequence, positions, np.abs(log_ratio), version_lags, gap_sums)
    masked: set[str] = set()
    if mask_ratio is not None:
        bound = math.log(mask_ratio)
        for key, (total, count) in rollout_sums.items():
            if count and not abs(total / count) <= bound:  # NaN too: nothing to trust
                masked.add(key[0])
                for index in by_rollout[key]:
                    multipliers[index][:] = 0.0
    ratios = np.exp(np.concatenate(log_ratios)) if log_ratios else np.zeros(0)
    if not len(ratios):
        return multipliers, CorrectionStats(
            masked_rollouts=len(masked), masked_rollout_ids=frozenset(masked)
        )
    stats = CorrectionStats(
        tokens=len(ratios),
        ratio_mean=float(ratios.mean()),
        ratio_min=float(ratios.min()),
        ratio_max=float(ratios.max()),
        clipped_fraction=float((ratios > tis_cap).mean()) if tis_cap is not None else 0.0,
        rollouts=sum(1 for _, count in rollout_sums.values() if count),
        masked_rollouts=len(masked),
        masked_rollout_ids=frozenset(masked),
        gap_by_lag={lag: total / count for lag, (total, count) in gap_sums.items() if count},
    )
    return multipliers, stats


def _add_gaps(
    sequence: TrainingSequence,
    positions: np.ndarray[Any, Any],
    gaps: np.ndarray[Any, Any],
    version_lags: Mapping[int, int],
    sums: dict[int, list[float]],
) -> None:
    """Adds each token's gap to its call's lag: a token belongs to the call whose response span
    holds it."""
    for (start, end), version in zip(sequence.response_spans, sequence.model_versions, strict=True):
        if version is None or version not in version_lags:
            continue
        inside = (positions >= start) & (positions < end)
        if inside.any():
            entry = sums[version_lags[version]]
            entry[0] += float(gaps[inside].sum())
            entry[1] += int(inside.sum())
