"""Why two consecutive calls could not merge (paper 2.1: its three mechanisms, plus branches).

The merge test is token-level (paper eq. 9). When it fails, the text-level view (eq. 8) tells the
mechanisms apart. With ``H = prev_prompt + prev_response`` (the merged sequence so far ends exactly
so) and ``tp, ta, tq`` the decoded previous prompt, previous response and next prompt, the rules are
checked in this order:

1. ``retokenized``: ``tq`` starts with ``tp + ta``. Same text, different token IDs: the history was
   decoded and re-encoded (eq. 11, figure 3).
2. ``template``: ``tq`` starts with ``tp`` and what follows is the response with its reasoning
   blocks removed (``<think>...</think>``, see ``REASONING_BLOCK``): the chat template dropped them
   (eq. 10; Qwen3 does this once a new user turn follows).
3. ``transformed``: ``tq`` starts with ``tp`` but what follows is not the sampled response text:
   the response was reserialized before the harness saw it (tool-call JSON, repaired output, a
   dropped response).
4. ``template``: ``tq`` does not start with ``tp`` (the history before the response changed), but
   ``tq`` still carries the previous response (reasoning removed) after the point where the two
   texts diverge: the history was re-rendered (an earlier turn's ``<think>`` dropped, old turns
   trimmed), and the conversation goes on.
5. ``branch``: otherwise. The next prompt does not continue this history: a subagent, a summary
   that replaced the context, a fresh conversation.

Rule 4 is a heuristic: a branch whose prompt quotes the previous response verbatim reads as a
template change, and a response that was both transformed and re-rendered reads as a branch.

Without a ``decode`` function only token evidence exists. The reason is then ``branch`` when the
next prompt shares fewer than ``BRANCH_SHARED_FRACTION`` of the previous prompt's tokens as a
prefix, and ``unknown`` otherwise (the other three cannot be told apart without text).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

import numpy as np

from reins.samples.records import TokenArray

SplitReason = Literal["retokenized", "template", "transformed", "branch", "unknown"]
SPLIT_REASONS: tuple[SplitReason, ...] = (
    "retokenized",
    "template",
    "transformed",
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
    if decode is None:
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
    anchor = kept.strip()
    if anchor and tq.find(anchor, _shared_text_prefix_len(tp, tq)) >= 0:
        return "template"
    return "branch"
