"""The prefix cache: the KV of earlier calls, kept so that a later prompt prefills only its rest.

Agent harnesses re-send the whole conversation on every call, so a call's prompt usually starts
with an earlier call's prompt + response, token for token when the proxy reuses token IDs. The
scheduler keeps the KV cache of a finished sequence (its prompt and all its sampled tokens but the
last, whose KV was never computed) as an `Entry`; a new prompt looks up the entry that shares its
longest prefix and prefills only the rest on top of a copy of those keys and values.

Invariants:
- An entry holds the keys and values of exactly its `tokens` at positions 0..len-1 (RoPE already
  applied), all computed under one weight `version`. `lookup` only matches entries of the version
  it is asked for; `invalidate(version)` drops every older entry (a weight update). The engine
  passes its weight generation, which every weight change moves on, not the version number it
  serves: a reload under the same number changes the weights too.
- A match may stop inside an entry (a harness that cut the response, a shared system prompt), and
  it never covers a whole prompt: at least one token is left to prefill, whose logits give the
  first sampled token. Matches shorter than `min_tokens` are not worth a copy and are not made.
- `nbytes <= capacity_bytes`: the least recently used entries go first; an entry bigger than the
  whole capacity is not kept. A capacity of 0 turns the cache off.
- An entry whose tokens are a prefix of a newly inserted entry's is dropped: the new one answers
  every lookup the old one would. One conversation therefore holds one entry, its latest turn.
- Entries are never changed once made. A `Match` holds its entry, so an entry evicted between a
  lookup and its use stays valid for that use (its memory is freed when the use ends).
- Thread-safe: the scheduler's thread looks up and inserts, a weight update invalidates from the
  trainer's thread, `/metrics` reads the stats from the server's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values, each [1, kv_heads, tokens, head_dim]."""

MIN_TOKENS = 16
"""Shorter matches are not used and shorter sequences are not kept."""


@dataclass(eq=False)
class Entry:
    """The KV of `tokens`, computed under weight version `version`."""

    tokens: np.ndarray
    kv: tuple[LayerKV, ...]
    version: int
    nbytes: int


@dataclass(frozen=True)
class Match:
    """The first `length` tokens of a prompt have their KV in `entry`."""

    entry: Entry
    length: int


@dataclass(frozen=True)
class PrefixCacheStats:
    capacity_bytes: int
    bytes: int
    entries: int
    queries: int
    """Prompts prefilled (counted with the cache off too)."""
    hits: int
    """Of those, prompts that reused a cached prefix."""
    prompt_tokens: int
    reused_tokens: int
    """Prompt tokens whose KV came from the cache instead of being prefilled."""
    inserted: int
    evicted: int
    """Entries dropped to stay under the capacity."""
    invalidated: int
    """Entries dropped because the weights changed."""


def as_tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(token_ids, dtype=np.int64)


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int | None = None) -> int:
    """How many leading tokens `a` and `b` share (at most `limit`)."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    if n <= 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """An LRU of `Entry`s bounded by bytes; see the module docstring."""

    def __init__(self, capacity_bytes: int, *, min_tokens: int = MIN_TOKENS) -> None:
        if capacity_bytes < 0:
            raise ValueError(
                f"the prefix cache's capacity must be >= 0 bytes, not {capacity_bytes}"
            )
        self.capacity_bytes = capacity_bytes
        self.min_tokens = max(1, min_tokens)
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._bytes = 0
        self._queries = self._hits = self._prompt_tokens = self._reused_tokens = 0
        self._inserted = self._evicted = self._invalidated = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def lookup(self, prompt: np.ndarray, version: int) -> Match | None:
        """The entry of `version` sharing the longest prefix with `prompt` (at most all of it but
        its last token), or None when no entry shares `min_tokens`."""
        limit = len(prompt) - 1
        if not self.enabled or limit < self.min_tokens:
            return None
        best: Match | None = None
        with self._lock:
            for entry in reversed(self._entries.values()):  # most recent first wins ties
                if entry.version != version:
                    continue
                if best is not None and min(len(entry.tokens), limit) <= best.length:
                    continue
                length = common_prefix(entry.tokens, prompt, limit)
                if length >= self.min_tokens and (best is None or length > best.length):
                    best = Match(entry, length)
                    if length == limit:
                        break
        return best

    def use(self, match: Match | None, prompt_tokens: int) -> None:
        """Counts one prompt prefilled with `match` (None: nothing reused) and marks its entry
        recently used."""
        with self._lock:
            self._queries += 1
            self._prompt_tokens += prompt_tokens
            if match is None:
                return
            self._hits += 1
            self._reused_tokens += match.length
            key = id(match.entry)
            if self._entries.get(key) is match.entry:
                self._entries.move_to_end(key)

    def insert(self, tokens: np.ndarray, kv: tuple[LayerKV, ...], version: int) -> bool:
        """Keeps `kv` (the KV of `tokens`) unless it is too small or too big, or an entry of the
        same version already covers `tokens`; drops entries it covers. True when kept."""
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if not self.enabled or len(tokens) < self.min_tokens or nbytes > self.capacity_bytes:
            return False
        entry = Entry(tokens, kv, version, nbytes)
        with self._lock:
            for key, old in list(self._entries.items()):
                if old.version != version:
                    continue
                shared = common_prefix(old.tokens, tokens)
                if shared == len(tokens) and len(old.tokens) >= len(tokens):
                    self._entries.move_to_end(key)  # it already holds all of these tokens
                    return False
                if shared == len(old.tokens):
                    self._drop(key)
            self._entries[id(entry)] = entry
            self._bytes += nbytes
            self._inserted += 1
            while self._bytes > self.capacity_bytes:
                self._drop(next(iter(self._entries)))
                self._evicted += 1
        return True

    def invalidate(self, version: int) -> int:
        """Drops every entry computed under a weight version older than `version`."""
        with self._lock:
            stale = [key for key, entry in self._entries.items() if entry.version < version]
            for key in stale:
                self._drop(key)
            self._invalidated += len(stale)
        return len(stale)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(
                capacity_bytes=self.capacity_bytes,
                bytes=self._bytes,
                entries=len(self._entries),
                queries=self._queries,
                hits=self._hits,
                prompt_tokens=self._prompt_tokens,
                reused_tokens=self._reused_tokens,
                inserted=self._inserted,
                evicted=self._evicted,
                invalidated=self._invalidated,
            )

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
