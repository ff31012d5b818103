"""Per-token loss weights for the three normalizations of paper section 2.3.

Each normalization is one function returning a scale per sequence; a token's weight is its
sequence's scale on response tokens and 0 on prompt and observation tokens. The loss of one
optimizer step is then ``sum over all its tokens of weight * per-token loss``, whatever way the
tokens are split into micro-batches or data-parallel ranks: each part contributes its plain sum,
the parts are added (gradient accumulation, all-reduce SUM), and nothing is divided afterwards.

Notation (paper): R rollouts, rollout rho has N_rho sequences, sequence j has L_rho,j response
tokens with per-token losses l_rho,j,t.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import NDArray

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "rollout-mean"]
LOSS_AGGREGATIONS: tuple[LossAggregation, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "rollout-mean",
)
FloatArray = NDArray[np.float64]
IndexArray = NDArray[np.intp]


def token_mean_scales(response_lengths: NDArray[np.integer]) -> FloatArray:
    """Scale ``1 / sum L`` for every sequence."""
    lengths = np.asarray(response_lengths, dtype=np.float64)
    # paper eq. 14: token mean, sum of all token losses / total response tokens (DAPO)
    return np.full(lengths.shape, 1.0 / lengths.sum())


def seq_mean_token_mean_scales(response_lengths: NDArray[np.integer]) -> FloatArray:
    """Scale ``1 / (N * L_j)``, N the number of sequences."""
    lengths = np.asarray(response_lengths, dtype=np.float64)
    # paper eq. 15: seq-mean-token-mean, mean over sequences of each sequence's token mean (GRPO)
    return 1.0 / (lengths.size * lengths)


def rollout_mean_scales(
    response_lengths: NDArray[np.integer], sequence_rollout: IndexArray
) -> FloatArray:
    """Scale ``1 / (R * L_rho)``: L_rho the response tokens of the sequence's whole rollout.

    R is the number of distinct rollouts among the sequences, so each rollout's weights sum to
    ``1/R`` however many sequences it split into.
    """
    lengths = np.asarray(response_lengths, dtype=np.float64)
    rollout = np.unique(np.asarray(sequence_rollout), return_inverse=True)[1]
    per_rollout = np.bincount(rollout, weights=lengths)
    # paper eq. 16: rollout-level token mean, mean over rollouts of each rollout's pooled token mean
    return 1.0 / (per_rollout.size * per_rollout[rollout])


def sequence_scales(
    response_lengths: NDArray[np.integer],
    sequence_rollout: IndexArray,
    aggregation: LossAggregation = "rollout-mean",
) -> FloatArray:
    """The chosen normalization's scale per sequence."""
    if len(response_lengths) == 0:
        return np.zeros(0)
    if aggregation == "rollout-mean":
        return rollout_mean_scales(response_lengths, sequence_rollout)
    if aggregation == "token-mean":
        return token_mean_scales(response_lengths)
    if aggregation == "seq-mean-token-mean":
        return seq_mean_token_mean_scales(response_lengths)
    raise ValueError(
        f"unknown loss aggregation {aggregation!r}; use one of {', '.join(LOSS_AGGREGATIONS)}"
    )


def token_weights(
    loss_mask: np.ndarray[tuple[int], np.dtype[np.bool_]], scale: float
) -> NDArray[np.float32]:
    """Per-token weights of one sequence: ``scale`` on loss tokens, 0 elsewhere."""
    return loss_mask * np.float32(scale)
