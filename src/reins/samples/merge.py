"""Dedup retried calls, then merge calls into training sequences (paper eq. 9).

A call merges into a sequence only when its prompt starts with the sequence's tokens so far,
token for token. A sequence so far always ends with its last call's response and starts with that
call's prompt (its prompt passed the same test), so the test is
``next_prompt[:len(p) + len(a)] == p + a`` for that last call ``(p, a)``. Only the prompt's new
suffix (observation, loss off) and the new response (loss on) are appended. Nothing is stitched
(the paper's eq. 13): for every call in a sequence, the tokens before its response are exactly
its prompt. The paper merges consecutive calls only; here a call may also extend a sequence
opened earlier that the previous call did not extend (interleaved conversations), with the same
test and the same guarantee.
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
    else the last first choice.

    A retry's harness goes on with the last answer, which this keeps. The choices of one call
    with `n > 1` (one record each, the same prompt) are kept as the one the harness went on
    with, whichever it took: keeping the last alone trained a choice nobody used and cut the
    rollout where the harness's next prompt continued another. When no later call shows which
    (the rollout's last call), the first choice (`Call.choice` 0) is kept. Two threads of a
    harness that asked the same thing (a fan-out) each went on with their own answer: both are
    kept (one used answer was never trained). The kept calls stay in their order. Prompts are
    bucketed by length first, so only prompts of equal length are compared.
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
    response (the last); when none is continued, the last first choice (a retry's harness goes
    on with the last answer; of an `n > 1` request's choices, a harness that shows no other
    takes the first, `choices[0]`: the last choice was trained, one nobody used)."""
    kept: dict[bytes, int] = {}
    for i in group:
        if any(_continues(calls[i], call.prompt) for call in calls[i + 1 :]):
            kept[calls[i].response.tobytes()] = i
    if kept:
        return set(kept.values())
    firsts = [i for i in group if calls[i].choice == 0]
    return {(firsts or group)[-1]}


def _continues(prev: Call, prompt: TokenArray) -> bool:
    """Paper eq. 9: ``prev.prompt + prev.response`` is a token prefix of ``prompt``."""
    np_, na = prev.prompt.size, prev.response.size
    if prompt.size < np_ + na:
        return False
    # The last token first: a prompt of another conversation is told apart without comparing
    # the whole history (a rollout's open sequences are each tried).
    if na and prompt[np_ + na - 1] != prev.response[-1]:
        return False
    return _equal(prompt[:np_], prev.prompt) and _equal(prompt[np_ : np_ + na], prev.response)


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

    A call extends the sequence whose last call it continues (paper eq. 9): the previous call's
    when it can, else the longest other open one (conversations that interleave: parallel
    threads, a sub-agent between two turns of its caller). Otherwise it opens a new sequence,
    and the boundary with the previous call becomes a ``Split`` diagnosed by ``diagnose_split``
    (with ``decode``, or token evidence only without it). Sequences come in the order of their
    first calls.
    """
    chains: list[list[tuple[Call, int]]] = []
    splits: list[Split] = []
    previous: list[tuple[Call, int]] | None = None
    for call in calls:
        chain = _chain_continued(chains, previous, call.prompt)
        if chain is not None:
            last = chain[-1][0]
            chain.append((call, last.prompt.size + last.response.size))
        else:
            if previous is not None:
                prev = previous[-1][0]
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
            chain = [(call, 0)]
            chains.append(chain)
        previous = chain
    return [_build(chain) for chain in chains], splits


def _chain_continued(
    chains: list[list[tuple[Call, int]]],
    previous: list[tuple[Call, int]] | None,
    prompt: TokenArray,
) -> list[tuple[Call, int]] | None:
    """The sequence a call with this prompt extends: the previous call's when its prompt
    continues that call, else the open sequence whose last call it continues with the most
    tokens; None when it continues none."""
    if previous is not None and _continues(previous[-1][0], prompt):
        return previous
    best: list[tuple[Call, int]] | None = None
    best_size = -1
    for chain in chains:
        last = chain[-1][0]
        size = last.prompt.size + last.response.size
        if chain is not previous and size > best_size and _continues(last, prompt):
            best, best_size = chain, size
    return best
