"""Why two consecutive calls could not merge (paper 2.1: its three mechanisms, and what harnesses
do to their history: drop a response, compact the context, branch).

The merge test is token-level (paper eq. 9). When it fails, the text-level view (eq. 8) tells the
mechanisms apart. First (rule 0), a next prompt equal to the previous prompt, token for token, is
a ``branch``: the same conversation sampled again by another thread (a fan-out), not a response
changed on its way back. With ``H = prev_prompt + prev_response`` (the merged sequence so far
ends exactly so), ``tp, ta, tq`` the decoded previous prompt, previous response and next prompt,
``d`` the length of the text ``tp`` and ``tq`` share from the start, and "elided" meaning with
the reasoning blocks removed (``<think>...</think>``, see ``REASONING_BLOCK``), the rules are
checked in order:

1. ``retokenized``: ``tq`` starts with ``tp + ta``. Same text, different token IDs: the history was
   decoded and re-encoded (eq. 11, figure 3).
2. ``template``: ``tq`` starts with ``tp`` and what follows is the response elided: the chat
   template dropped its reasoning (eq. 10; Qwen3 does this once a new user turn follows).
3. ``transformed``: ``tq`` starts with ``tp`` but what follows is not the sampled response text:
   the response was reserialized before the harness saw it or sent it back (tool-call JSON,
   repaired output).
4. ``template``: elided, ``tq`` starts with ``tp + ta``: the history was re-rendered without an
   earlier turn's reasoning.
5. ``dropped``: ``tq`` is ``tp`` with text inserted after ``d`` (``tq`` ends with ``tp[d:]``, the
   generation prompt), and that text does not carry the response: the harness left the response
   out of its history and asked again (mini-swe-agent answers a format error so).
6. ``compacted``: ``tq`` carries the response (elided, stripped, without its last token, which
   is often the end-of-turn marker) after ``d``, and is shorter than ``tp + ta``: earlier turns
   were removed or replaced by a summary and the conversation goes on (the summary is often the
   previous call's own response).
7. ``template``: ``tq`` carries the response after ``d`` but is not shorter: the history before
   it was re-rendered or edited (an earlier message changed), and the conversation goes on.
8. ``branch``: otherwise. The next prompt does not continue this history: a subagent, a fresh
   conversation.

Rules 5 to 7 are heuristics: a summary written without a call of this rollout (nothing of the
previous response in it) reads as ``branch``; a subagent's answer quoted whole in its caller's next
prompt reads as ``template`` (or ``compacted`` when the caller's prompt is the shorter).

Without a ``decode`` function only token evidence exists. The reason is then ``dropped`` when rule
5 holds on tokens (the response's tokens nowhere in the inserted part), ``branch`` when the next
prompt shares fewer than ``BRANCH_SHARED_FRACTION`` of the previous prompt's tokens as a prefix,
and ``unknown`` otherwise (the others cannot be told apart without text).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

import numpy as np

from reins.samples.records import TokenArray

SplitReason = Literal[
    "retokenized", "template", "transformed", "dropped", "compacted", "branch", "unknown"
]
SPLIT_REASONS: tuple[SplitReason, ...] = (
    "retokenized",
    "template",
    "transformed",
    "dropped",
    "compacted",
    "branch",
    "unknown",
)

Decode = Callable[[TokenArray], str]
"""Token IDs (a 1-D int32 array) to text; a Hugging Face tokenizer's ``decode`` fits as is.
Special tokens must be kept (the default), so chat markers appear in the text."""

REASONING_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
"""Spans a chat template may drop from earlier assistant turns (Qwen3 drops ``<think>`` blocks)."""

BRANCH_SHARED_FRACTION = 0.5
"""Token-only rule: a next prompt sharing less than this part of the previous prompt is a branch."""


def shared_prefix_len(a: TokenArray, b: TokenArray) -> int:
    """Number of leading tokens ``a`` and ``b`` have in common."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _shared_text_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n  # binary search on slice equality: O(n log n) in C, no per-character loop
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _contains(haystack: TokenArray, needle: TokenArray) -> bool:
    """Whether ``needle`` occurs in ``haystack`` as a contiguous run."""
    if needle.size == 0:
        return True
    if needle.size > haystack.size:
        return False
    starts = np.flatnonzero(haystack[: haystack.size - needle.size + 1] == needle[0])
    return any(np.array_equal(haystack[s : s + needle.size], needle) for s in starts)


def _dropped_tokens(prompt: TokenArray, response: TokenArray, next_prompt: TokenArray) -> bool:
    """Rule 5 on tokens: ``next_prompt`` is ``prompt`` with tokens inserted before its tail (what
    the two do not share from the start), and the response is not among them."""
    shared = shared_prefix_len(prompt, next_prompt)
    tail = prompt[shared:]
    if tail.size == 0 or next_prompt.size <= prompt.size:
        return False
    if not np.array_equal(next_prompt[next_prompt.size - tail.size :], tail):
        return False
    return not _contains(next_prompt[shared : next_prompt.size - tail.size], response)


def diagnose_split(
    prev_prompt: TokenArray,
    prev_response: TokenArray,
    next_prompt: TokenArray,
    decode: Decode | None = None,
    *,
    elide: re.Pattern[str] | None = REASONING_BLOCK,
) -> SplitReason:
    """Say why ``next_prompt`` does not start with ``prev_prompt + prev_response`` token for token.

    The rules are in the module docstring. ``elide`` names the spans a template may drop from a
    response (None: none).
    """
    if np.array_equal(prev_prompt, next_prompt):
        return "branch"  # rule 0: the same prompt again, another thread's (read as `transformed`)
    if decode is None:
        if _dropped_tokens(prev_prompt, prev_response, next_prompt):
            return "dropped"
        history = np.concatenate([prev_prompt, prev_response])
        shared = shared_prefix_len(history, next_prompt)
        if shared < prev_prompt.size * BRANCH_SHARED_FRACTION:
            return "branch"
        return "unknown"
    tp, ta, tq = decode(prev_prompt), decode(prev_response), decode(next_prompt)
    if tq.startswith(tp + ta):
        return "retokenized"
    kept = elide.sub("", ta) if elide is not None else ta
    if tq.startswith(tp):
        if kept != ta and tq.startswith(kept, len(tp)):
            return "template"
        return "transformed"
    if elide is not None and elide.sub("", tq).startswith(elide.sub("", tp + ta)):
        return "template"
    shared = _shared_text_prefix_len(tp, tq)
    # The response without its last token (the end-of-turn marker, when it ended with one): a
    # summary the response wrote is quoted inside another turn, without the marker.
    body = decode(prev_response[:-1]) if prev_response.size > 1 else ta
    anchor = (elide.sub("", body) if elide is not None else body).strip()
    carried = bool(anchor) and tq.find(anchor, shared) >= 0
    if not carried and len(tq) > len(tp) and tq.endswith(tp[shared:]):
        return "dropped"
    if carried:
        return "compacted" if len(tq) < len(tp) + len(ta) else "template"
    return "branch"
