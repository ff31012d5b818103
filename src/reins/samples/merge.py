"""Dedup retried calls, then merge consecutive calls into training sequences (paper eq. 9).

A call merges into the open sequence only when its prompt starts with the sequence's tokens so
far, token for token. The sequence so far always ends with the previous call's response and
starts with that call's prompt (its prompt passed the same test), so the test is
``next_prompt[:len(p) + len(a)] == p + a`` for the previous call ``(p, a)``. Only the prompt's new
suffix (observation, loss off) and the new response (loss on) are appended. Nothing is stitched
(the paper's eq. 13): for every call in a sequence, the tokens before its response are exactly
its prompt.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reins.samples.diagnose import (
    REASONING_BLOCK,
    Decode,
    SplitReason,
    diagnose_split,
    shared_prefix_len,
)
from reins.samples.records import Call, LogprobArray, TokenArray


@dataclass(frozen=True, slots=True)
class Split:
    """A boundary where a rollout's next call could not merge, and why."""

    rollout_id: str
    before_seq: int
    """Event seq of the last call of the closed sequence."""
    after_seq: int
    """Event seq of the call that opened the next sequence."""
    reason: SplitReason
    shared_tokens: int
    """Leading tokens the next prompt shares with the closed sequence."""


@dataclass(frozen=True, slots=True)
class MergedSequence:
    """One training sequence of a rollout, before advantage and loss weights are attached."""

    token_ids: TokenArray
    loss_mask: np.ndarray[tuple[int], np.dtype[np.bool_]]
    """True on response tokens (sampled by the policy), False on prompt and observation tokens."""
    old_logprobs: LogprobArray
    """Rollout logprobs on response tokens (NaN where the engine returned none), 0.0 elsewhere."""
    call_seqs: tuple[int, ...]
    """Event seqs of the calls merged into this sequence, in order."""
    model_versions: tuple[int | None, ...]
    """Weight version that served each of those calls."""
    response_spans: tuple[tuple[int, int], ...]
    """``(start, end)`` of each call's response; ``token_ids[:start]`` is that call's prompt."""

    @property
    def response_tokens(self) -> int:
        return sum(end - start for start, end in self.response_spans)


def dedup_calls(calls: Sequence[Call]) -> list[Call]:
    """Drop retried calls (paper 3.2): of calls with identical prompts, keep those whose prompt
    + response a later call's prompt continues (of those with the same response, the last),
    else the last.

    A retry's harness goes on with the last answer, which this keeps. The choices of one call
    with `n > 1` (one record each, the same prompt) are kept as the one the harness went on
    with, whichever it took: keeping the last alone trained a choice nobody used and cut the
    rollout where the harness's next prompt continued another. Two threads of a harness that
    asked the same thing (a fan-out) each went on with their own answer: both are kept (one
    used answer was never trained). The kept calls stay in their order. Prompts are bucketed
    by length first, so only prompts of equal length are compared.
    """
    by_len: dict[int, list[int]] = {}
    for i, call in enumerate(calls):
        by_len.setdefault(call.prompt.size, []).append(i)
    dropped: set[int] = set()
    for idxs in by_len.values():
        if len(idxs) < 2:
            continue
        same: dict[bytes, list[int]] = {}
        for i in idxs:
            same.setdefault(calls[i].prompt.tobytes(), []).append(i)
        for group in same.values():
            if len(group) > 1:
                kept = _continued(calls, group)
                dropped.update(i for i in group if i not in kept)
    if not dropped:
        return list(calls)
    return [c for i, c in enumerate(calls) if i not in dropped]


def _continued(calls: Sequence[Call], group: list[int]) -> set[int]:
    """Of calls `group` (indices, in order, one prompt), those a later call continues, one per
    response (the last); the last of them when none is continued."""
    kept: dict[bytes, int] = {}
    for i in group:
        if any(_continues(calls[i], call.prompt) for call in calls[i + 1 :]):
            kept[calls[i].response.tobytes()] = i
    return set(kept.values()) or {group[-1]}


def _continues(prev: Call, prompt: TokenArray) -> bool:
    """Paper eq. 9: ``prev.prompt + prev.response`` is a token prefix of ``prompt``."""
    np_, na = prev.prompt.size, prev.response.size
    return (
        prompt.size >= np_ + na
        and _equal(prompt[:np_], prev.prompt)
        and _equal(prompt[np_ : np_ + na], prev.response)
    )


def _equal(a: TokenArray, b: TokenArray) -> bool:
    """Token equality; views of the same memory (the trainer's binary read lays a rollout's calls
    out in one buffer, `reins.recordbatch`) are equal without comparing them."""
    if a.size != b.size:
        return False
    # Same memory: same layout, and the first elements overlap, which for aligned values of one
    # type means they start at the same address. (`__array_interface__` says so directly but
    # costs ~6 us an array, more than comparing a few thousand tokens.)
    if (
        a.size
        and a.strides == b.strides
        and a.dtype == b.dtype
        and a.flags.aligned
        and b.flags.aligned
        and np.may_share_memory(a[:1], b[:1])
    ):
        return True
    return bool((a == b).all())


def _build(chunks: list[tuple[Call, int]]) -> MergedSequence:
    """One sequence from its calls; each call appends its prompt from offset ``start`` on."""
    parts: list[TokenArray] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for call, start in chunks:
        obs = call.prompt[start:]
        parts.append(obs)
        parts.append(call.response)
        pos += obs.size
        spans.append((pos, pos + call.response.size))
        pos += call.response.size
    tokens = np.concatenate(parts)
    mask = np.zeros(pos, dtype=np.bool_)
    logprobs = np.zeros(pos, dtype=np.float32)
    for (s, e), (call, _) in zip(spans, chunks, strict=True):
        mask[s:e] = True
        logprobs[s:e] = np.nan if call.logprobs is None else call.logprobs
    return MergedSequence(
        token_ids=tokens,
        loss_mask=mask,
        old_logprobs=logprobs,
        call_seqs=tuple(c.seq for c, _ in chunks),
        model_versions=tuple(c.model_version for c, _ in chunks),
        response_spans=tuple(spans),
    )


def merge_calls(
    calls: Sequence[Call],
    *,
    rollout_id: str = "",
    decode: Decode | None = None,
    elide: re.Pattern[str] | None = REASONING_BLOCK,
) -> tuple[list[MergedSequence], list[Split]]:
    """Best-effort merge of one attempt's (deduplicated) calls, in order.

    Returns the training sequences and, for every boundary that could not merge, a ``Split``
    diagnosed by ``diagnose_split`` (with ``decode``, or token evidence only without it).
    """
    sequences: list[MergedSequence] = []
    splits: list[Split] = []
    chunks: list[tuple[Call, int]] = []
    prev: Call | None = None
    for call in calls:
        if prev is not None:
            if _continues(prev, call.prompt):
                chunks.append((call, prev.prompt.size + prev.response.size))
                prev = call
                continue
            sequences.append(_build(chunks))
            history = np.concatenate([prev.prompt, prev.response])
            splits.append(
                Split(
                    rollout_id=rollout_id,
                    before_seq=prev.seq,
                    after_seq=call.seq,
                    reason=diagnose_split(
                        prev.prompt, prev.response, call.prompt, decode, elide=elide
                    ),
                    shared_tokens=shared_prefix_len(history, call.prompt),
                )
            )
        chunks = [(call, 0)]
        prev = call
    if chunks:
        sequences.append(_build(chunks))
    return sequences, splits
