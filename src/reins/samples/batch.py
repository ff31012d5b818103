"""``build_batch``: the whole Sample Adapter, from rollout records to planned training sequences.

Order of work: dedup and merge each rollout (diagnosing splits), advantages over the whole batch
(groups may span mini-batches), mini-batches by rollout, then loss weights per mini-batch and
micro-batches per rank. Loss weights are normalized per mini-batch: each optimizer step's loss
is the chosen mean over that step's own rollouts, sequences or tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from reins.samples.advantage import (
    AdvantageEstimator,
    AdvantageLevel,
    group_index,
    group_key,
    sequence_advantages,
)
from reins.samples.diagnose import REASONING_BLOCK, Decode
from reins.samples.loss import LossAggregation, sequence_scales, token_weights
from reins.samples.merge import MergedSequence, Split, dedup_calls, merge_calls
from reins.samples.metrics import SampleMetrics, compute_metrics
from reins.samples.planning import MiniBatchPlan, plan_minibatch, plan_minibatches
from reins.samples.records import LogprobArray, RolloutRecord, TokenArray


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """How samples are built; the defaults are the paper's choices."""

    estimator: AdvantageEstimator = "grpo"
    """``grpo`` (group mean baseline) or ``rloo`` (leave-one-out baseline)."""
    normalize_std: bool = True
    """GRPO only: divide by the group's reward standard deviation (+ ``eps``)."""
    eps: float = 1e-6
    """Added to the GRPO standard deviation."""
    advantage_level: AdvantageLevel = "rollout"
    """``rollout``: each rollout counted once in its group (paper); ``sample``: every sequence."""
    loss_aggregation: LossAggregation = "rollout-mean"
    """``rollout-mean`` (eq. 16, paper default), ``token-mean`` (eq. 14), ``seq-mean-token-mean``
    (eq. 15)."""
    num_minibatches: int = 1
    """Optimizer steps per batch; rollouts are never split across them."""
    dp_size: int = 1
    """Data-parallel ranks each mini-batch is spread over."""
    max_tokens_per_microbatch: int | None = None
    """Token bound of one micro-batch (None: one micro-batch per rank and mini-batch)."""


@dataclass(frozen=True, slots=True)
class TrainingSequence:
    """One training row: tokens, what to train on, with what weight, and where it came from."""

    token_ids: TokenArray
    """int32 token IDs: prompt, then (observation, response) per merged call."""
    loss_mask: np.ndarray[tuple[int], np.dtype[np.bool_]]
    """True on response tokens only."""
    old_logprobs: LogprobArray
    """Rollout logprobs on response tokens; NaN on response tokens of calls whose engine returned
    none (recompute them); 0.0 on every loss-masked token."""
    advantage: float
    """The same for every token of the sequence (broadcast by the trainer)."""
    loss_weight: NDArray[np.float32]
    """Per-token weight, 0 off the loss mask; the step's loss is ``sum(loss_weight * token_loss)``
    over all sequences of the mini-batch."""
    reward: float
    rollout_id: str
    group_id: str | None
    attempt_id: int
    call_seqs: tuple[int, ...]
    """Event seqs of the calls merged into this sequence."""
    model_versions: tuple[int | None, ...]
    """Weight version of each of those calls."""
    response_spans: tuple[tuple[int, int], ...]
    """``(start, end)`` of each call's response; ``token_ids[:start]`` is that call's prompt."""
    minibatch: int
    """Index of the optimizer step (mini-batch) it belongs to."""


@dataclass(frozen=True, slots=True)
class Batch:
    sequences: list[TrainingSequence]
    minibatches: list[MiniBatchPlan]
    """The plan; its indices point into ``sequences`` and into the input rollouts."""
    splits: list[Split]
    metrics: SampleMetrics

    def split_counts_by_rollout(self) -> dict[str, dict[str, int]]:
        """Split reasons counted per rollout (rollouts without splits are absent)."""
        out: dict[str, dict[str, int]] = {}
        for s in self.splits:
            counts = out.setdefault(s.rollout_id, {})
            counts[s.reason] = counts.get(s.reason, 0) + 1
        return out


def step_loss_weights(
    sequences: Sequence[MergedSequence | TrainingSequence],
    sequence_rollout: Sequence[str],
    aggregation: LossAggregation = "rollout-mean",
) -> list[NDArray[np.float32]]:
    """Loss weights for ``sequences`` taken as one optimizer step (for callers that re-plan).

    ``sequence_rollout[j]`` names the rollout of ``sequences[j]`` (rollout-mean pools by it).
    """
    lengths = np.fromiter((int(s.loss_mask.sum()) for s in sequences), np.int64, len(sequences))
    scales = sequence_scales(lengths, group_index(sequence_rollout), aggregation)
    return [token_weights(s.loss_mask, float(c)) for s, c in zip(sequences, scales, strict=True)]


def build_batch(
    rollouts: Sequence[RolloutRecord],
    config: AdapterConfig | None = None,
    *,
    decode: Decode | None = None,
    elide: re.Pattern[str] | None = REASONING_BLOCK,
) -> Batch:
    """Dedup, merge, diagnose, advantage, plan and weight a batch of rollouts.

    ``decode`` (token IDs to text, e.g. ``tokenizer.decode``) is only called at boundaries that
    could not merge, to tell why; without it split reasons are ``branch`` or ``unknown``.
    """
    cfg = config or AdapterConfig()
    ids = [r.rollout_id for r in rollouts]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"rollouts {dup} appear more than once in the batch; pass each once")

    merged: list[MergedSequence] = []
    owner: list[int] = []
    per_rollout: list[int] = []
    splits: list[Split] = []
    call_tokens = calls = dedup = skipped = other_model = 0
    for r, rec in enumerate(rollouts):
        kept = dedup_calls(rec.calls)
        dedup += len(rec.calls) - len(kept)
        skipped += rec.skipped_calls
        other_model += rec.other_model_calls
        calls += len(kept)
        call_tokens += sum(c.prompt.size + c.response.size for c in kept)
        seqs, rsplits = merge_calls(kept, rollout_id=rec.rollout_id, decode=decode, elide=elide)
        merged.extend(seqs)
        owner.extend([r] * len(seqs))
        per_rollout.append(len(seqs))
        splits.extend(rsplits)

    seq_rollout = np.asarray(owner, dtype=np.intp)
    rewards = np.fromiter((r.reward for r in rollouts), np.float64, len(rollouts))
    if not np.isfinite(rewards).all():
        # The gateway refuses such rewards; a record built by hand can still hold one, and it
        # would make its whole group's advantages NaN (and a trainer's loss with them).
        bad = int(np.flatnonzero(~np.isfinite(rewards))[0])
        raise ValueError(
            f"rollout {rollouts[bad].rollout_id} has reward {rollouts[bad].reward}: a reward "
            "must be a finite number"
        )
    groups = group_index([group_key(r.group_id, r.rollout_id) for r in rollouts])
    adv = sequence_advantages(
        rewards,
        groups,
        seq_rollout,
        level=cfg.advantage_level,
        estimator=cfg.estimator,
        normalize_std=cfg.normalize_std,
        eps=cfg.eps,
    )

    lengths = np.fromiter((s.token_ids.size for s in merged), np.int64, len(merged))
    resp = np.fromiter((s.response_tokens for s in merged), np.int64, len(merged))
    by_rollout: list[list[int]] = [[] for _ in rollouts]
    for j, r in enumerate(owner):
        by_rollout[r].append(j)

    weights: list[NDArray[np.float32]] = [np.zeros(0, np.float32)] * len(merged)
    minibatch_of = [0] * len(merged)
    plans: list[MiniBatchPlan] = []
    for m, mb_rollouts in enumerate(plan_minibatches(seq_rollout, cfg.num_minibatches)):
        idx = [j for r in mb_rollouts for j in by_rollout[r]]
        sel = np.asarray(idx, dtype=np.intp)
        scales = sequence_scales(resp[sel], seq_rollout[sel], cfg.loss_aggregation)
        for j, c in zip(idx, scales.tolist(), strict=True):
            weights[j] = token_weights(merged[j].loss_mask, c)
            minibatch_of[j] = m
        plans.append(
            plan_minibatch(
                idx,
                mb_rollouts,
                lengths,
                dp_size=cfg.dp_size,
                max_tokens=cfg.max_tokens_per_microbatch,
            )
        )

    sequences = [
        TrainingSequence(
            token_ids=s.token_ids,
            loss_mask=s.loss_mask,
            old_logprobs=s.old_logprobs,
            advantage=float(adv[j]),
            loss_weight=weights[j],
            reward=rollouts[owner[j]].reward,
            rollout_id=rollouts[owner[j]].rollout_id,
            group_id=rollouts[owner[j]].group_id,
            attempt_id=rollouts[owner[j]].attempt_id,
            call_seqs=s.call_seqs,
            model_versions=s.model_versions,
            response_spans=s.response_spans,
            minibatch=minibatch_of[j],
        )
        for j, s in enumerate(merged)
    ]
    metrics = compute_metrics(
        rollouts=len(rollouts),
        sequences_per_rollout=per_rollout,
        sequences=merged,
        splits=splits,
        call_tokens=call_tokens,
        calls=calls,
        dedup_calls=dedup,
        skipped_calls=skipped,
        other_model_calls=other_model,
        minibatches=plans,
    )
    return Batch(sequences=sequences, minibatches=plans, splits=splits, metrics=metrics)
