"""Split a batch into optimizer mini-batches and those into micro-batches per data-parallel rank.

- Mini-batches never split a rollout: all sequences of a rollout share one optimizer update
  (DESIGN invariant 4, paper section 2.4). Rollouts are cut into ``num_minibatches`` contiguous
  runs of (almost) equal rollout count, in batch order; shuffle the rollouts beforehand if wanted.
- Inside a mini-batch, sequences go to ranks longest first, each onto the rank with the fewest
  tokens so far (greedy LPT), which balances tokens across ranks.
- Each rank's sequences are packed into micro-batches of at most ``max_tokens`` tokens, best fit
  decreasing. A sequence longer than ``max_tokens`` becomes a micro-batch of its own (it cannot be
  cut); ``oversize`` in the plan counts them, so the caller can fail or warn.
- Ranks may end with different numbers of micro-batches; a backend that needs equal counts pads
  with empty micro-batches (they add nothing: loss weights are sums, see ``reins.samples.loss``).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

MicroBatch = tuple[int, ...]
"""Indices of sequences in the batch."""


@dataclass(frozen=True, slots=True)
class MiniBatchPlan:
    """One optimizer step's share of the batch."""

    sequences: tuple[int, ...]
    """Indices of its sequences, in batch order."""
    rollouts: tuple[int, ...]
    """Indices of its rollouts (in the batch's rollout order)."""
    micro_batches: tuple[tuple[MicroBatch, ...], ...]
    """``micro_batches[rank][k]``: the k-th micro-batch of data-parallel rank ``rank``."""
    rank_tokens: tuple[int, ...]
    """Tokens assigned to each rank."""
    oversize: int
    """Sequences longer than ``max_tokens``, each alone in its micro-batch."""


def plan_minibatches(sequence_rollout: NDArray[np.intp], num_minibatches: int) -> list[list[int]]:
    """Rollout indices of each mini-batch: contiguous runs of equal rollout count.

    Only rollouts that have sequences are planned; with fewer such rollouts than
    ``num_minibatches``, fewer (non-empty) mini-batches come back.
    """
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches must be at least 1, got {num_minibatches}")
    rollouts = list(dict.fromkeys(np.asarray(sequence_rollout).tolist()))
    parts = np.array_split(np.arange(len(rollouts)), min(num_minibatches, max(len(rollouts), 1)))
    return [[rollouts[i] for i in part] for part in parts if part.size]


def assign_ranks(
    indices: Sequence[int], lengths: NDArray[np.integer], dp_size: int
) -> list[list[int]]:
    """Greedy longest-first onto the least-loaded rank; each rank's list is longest first."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be at least 1, got {dp_size}")
    order = sorted(indices, key=lambda i: (-int(lengths[i]), i))
    heap = [(0, r) for r in range(dp_size)]
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        load, r = heapq.heappop(heap)
        ranks[r].append(i)
        heapq.heappush(heap, (load + int(lengths[i]), r))
    return ranks


def pack_microbatches(
    indices: Sequence[int], lengths: NDArray[np.integer], max_tokens: int | None
) -> tuple[list[MicroBatch], int]:
    """Best-fit-decreasing packing into micro-batches of at most ``max_tokens`` tokens.

    Returns the micro-batches and how many sequences were oversize (alone, over the bound).
    ``max_tokens=None`` puts everything in one micro-batch.
    """
    if not indices:
        return [], 0
    if max_tokens is None:
        return [tuple(indices)], 0
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    order = sorted(indices, key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted: bisect finds the tightest fit
    oversize = 0
    for i in order:
        n = int(lengths[i])
        if n > max_tokens:
            oversize += 1
            bins.append([i])
            continue
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            room, b = free.pop(pos)
            bins[b].append(i)
            bisect.insort(free, (room - n, b))
        else:
            bins.append([i])
            bisect.insort(free, (max_tokens - n, len(bins) - 1))
    return [tuple(b) for b in bins], oversize


def plan_minibatch(
    sequences: Sequence[int],
    rollouts: Sequence[int],
    lengths: NDArray[np.integer],
    *,
    dp_size: int = 1,
    max_tokens: int | None = None,
) -> MiniBatchPlan:
    """Micro-batches per rank for one mini-batch's sequences (``lengths`` indexed by sequence)."""
    per_rank: list[tuple[MicroBatch, ...]] = []
    tokens: list[int] = []
    oversize = 0
    for rank in assign_ranks(sequences, lengths, dp_size):
        micro, over = pack_microbatches(rank, lengths, max_tokens)
        per_rank.append(tuple(micro))
        tokens.append(int(sum(int(lengths[i]) for i in rank)))
        oversize += over
    return MiniBatchPlan(
        sequences=tuple(sorted(sequences)),
        rollouts=tuple(rollouts),
        micro_batches=tuple(per_rank),
        rank_tokens=tuple(tokens),
        oversize=oversize,
    )
