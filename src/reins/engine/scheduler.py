"""Continuous batching on a Hugging Face causal LM: one thread, one decode step for every sequence.

Requests join the running batch between decode steps: their prompts are prefilled together
(left-padded), then their KV caches are left-padded to the running batch's length and joined to it
along the batch axis. A finished or cancelled sequence leaves at the next step, and the padding
columns that no sequence needs any more are cut. Positions come from the attention mask, so left
padding never shifts a sequence's RoPE positions.

Every forward pass holds `weights_lock`: whoever changes the weights in place takes it and the
batch waits between two steps (a sequence started under the old weights goes on under the new
ones, as in vLLM's in-place weight update; it records the version it started with).

With a `PrefixCache` (`prefix_cache.py`), a finished sequence leaves its KV behind, and so does a
long freshly prefilled prompt; a joining sequence whose prompt starts with a cached prefix
prefills only the rest. The joining rows' cached prefixes are right-aligned in front of their new
tokens: `[pad | cached prefix | pad | new tokens]`. The holes are masked out, and positions are
still counted from the attention mask, so every token keeps its own position. A sequence's KV is
kept only when all of it was computed under the weights in force when it ends: the same weight
generation, which every weight change moves on, even one served under the same version number.

A model on transformers' `sdpa` attention is switched to `attention.engine_attention`, which reads
each KV head once per decode step and does not copy the cached KV to prefill over it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from reins.engine.attention import use_engine_attention
from reins.engine.chat import tool_turn_end
from reins.engine.constraint import ConstraintError, Matcher
from reins.engine.prefix_cache import Match, PrefixCache, as_tokens, common_prefix
from reins.engine.sampling import (
    TOOL_TURN_TOKENS,
    Alternatives,
    Generator,
    NothingAllowed,
    SamplingParams,
    UnsampleableRows,
    alternatives,
    sample_next,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_GPU_ATTENTION = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]

PREFILL_KEEP_TOKENS = 256
"""A prompt that prefilled at least this many new tokens is kept in the prefix cache right away
(not only when its sequence ends): a peer with the same long prefix (the same system prompt, the
other samples of a GRPO group) that joins later reuses it, and one that would join in the same
step waits one step to do so."""
PADDING_SLACK = 512
"""Sequences prefilled together are left-padded to the longest: a sequence joins a prefill only
while the padded tokens stay under twice the real ones plus this many."""
PLAIN_HEAD_MODELS = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
}
"""Models whose logits are `lm_head(model(...).last_hidden_state)`, nothing else: the scheduler
computes their logits itself (see `_logits`)."""
STATS_LOG_S = 30.0
"""The prefix cache's figures are logged at most this often, when they changed."""

TokenSink = Callable[[int, float, Alternatives], None]
"""Called per sampled token with its logprob and, when asked, the most likely alternatives."""
FinishSink = Callable[[str | None, str | None], None]
"""Called once with (finish_reason, error)."""


@dataclass(eq=False)
class Sequence:
    """One response being generated."""

    prompt_ids: list[int]
    params: SamplingParams
    on_token: TokenSink
    on_finish: FinishSink
    weight_version: int = 0
    """The version of the weights its prefill ran with (set then; until then, the version served
    when it arrived)."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    """Why it failed (its finish_reason is then "error"); it leaves at the next `_retire`."""
    cancelled: bool = False
    generator: Generator | None = None
    next_token: int = -1
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    kv_generation: int = -1
    """The weight generation its KV was computed under (set at prefill)."""
    match: Match | None = field(default=None, repr=False)
    matcher: Matcher | None = field(default=None, repr=False)
    """Structured output: where the response stands in its grammar (`constraint.py`)."""
    _tokens: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.generator = self.params.generator()

    @property
    def prompt_tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = as_tokens(self.prompt_ids)
        return self._tokens


def _run_job(job: Callable[[], Any], done: Future[Any]) -> None:
    try:
        done.set_result(job())
    except BaseException as error:  # the caller's to handle, in the caller's thread
        done.set_exception(error)


class BatchScheduler:
    """Runs sequences through `model` in one background thread, batched."""

    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: set[int],
        decode: Callable[[list[int]], str],
        max_batch: int = 16,
        max_model_len: int = 4096,
        max_prefill_tokens: int = 8192,
        weights_lock: threading.Lock | None = None,
        prefix_cache: PrefixCache | None = None,
        weight_generation: Callable[[], int] = lambda: 0,
        weight_version: Callable[[], int] = lambda: 0,
    ) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.decode = decode
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.weights_lock = weights_lock or threading.Lock()
        self.prefix_cache = prefix_cache or PrefixCache(0)
        self.weight_generation = weight_generation
        """The generation of the weights now in the model (it moves on at every weight change,
        whatever version they are served as): cached KV is valid only under its own generation.
        Read under `weights_lock`."""
        self.weight_version = weight_version
        """The version of the weights now in the model, read under `weights_lock` at a prefill:
        what a sequence is sampled with from its first token on."""
        self.steps = 0
        self._logged: tuple[int, float] = (0, time.monotonic())
        self._cache_kwarg = _cache_kwarg(model)
        self._head = _plain_head(model)
        use_engine_attention(model)
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        self._wake = threading.Condition()
        self._stopped = False
        self._aborting: str | None = None
        """Set by `abort_all`: why every sequence, running or to come, fails at once."""
        self._holding = 0
        self._jobs: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._thread = threading.Thread(target=self._run, name="reins-engine", daemon=True)
        self._thread.start()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device  # type: ignore[no-any-return]

    def submit(self, sequence: Sequence) -> None:
        with self._wake:
            if self._stopped:
                raise RuntimeError("the engine is stopped")
            if self._aborting is not None:
                sequence.finish_reason = "error"
                sequence.on_finish(None, self._aborting)
                return
            self._waiting.append(sequence)
            self._wake.notify()

    def abort_all(self, error: ShuttingDown) -> None:
        """Fails every sequence with `error`: the waiting ones now, the running ones at the next
        step (their answers end then, with what they sampled so far), and any submitted later
        at once. For a server shutting down: it waits for its answers to end, which a long
        generation made a wait of minutes (651 s for a 3,000-token stream)."""
        with self._wake:
            self._aborting = error
            waiting, self._waiting = list(self._waiting), deque()
            self._wake.notify()
        _fail(waiting, error)

    def cancel(self, sequence: Sequence) -> None:
        """Frees the sequence's slot at the next step (the client went away)."""
        sequence.cancelled = True
        with self._wake:
            self._wake.notify()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """New sequences wait in line while the block runs (the running ones go on); they
        join together afterwards, as far as the batch and the prefill budget allow."""
        with self._wake:
            self._holding += 1
        try:
            yield
        finally:
            with self._wake:
                self._holding -= 1
                self._wake.notify()

    def run_between_steps(self, job: Callable[[], T]) -> T:
        """Runs `job` on the engine's own thread between two steps and returns its result (or
        raises its error); the batch waits meanwhile.

        Why its thread: glibc keeps what a thread frees in that thread's arena, for that thread
        to reuse. A weight update run in another thread leaves its gradients' and activations'
        pages in that thread's arena, where generation never reuses them, so each process
        holds both at once (docs/benchmarks.md, "Trainer memory")."""
        if threading.current_thread() is self._thread:
            return job()
        done: Future[T] = Future()
        with self._wake:
            if self._stopped:
                raise RuntimeError("the engine is stopped")
            self._jobs.append((job, done))
            self._wake.notify()
        return done.result()

    def load(self) -> tuple[int, int]:
        """(running, waiting) sequence counts."""
        return len(self._active), len(self._waiting)

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._wake:
                while (
                    not self._stopped
                    and not self._jobs
                    and not self._active
                    and (not self._waiting or self._holding)
                ):
                    self._wake.wait()
                if self._stopped:
                    break
                job = self._jobs.popleft() if self._jobs else None
                joining = [] if self._holding or job else self._take_joining()
            if job is not None:
                _run_job(*job)
                continue
            try:
                with self.weights_lock, torch.inference_mode(), self._attention_kernels():
                    if joining:
                        self._prefill_and_join(joining)
                    elif self._active:
                        self._decode_step()
                    self._retire()
            except Exception as error:  # a failed step fails its sequences, not the engine
                log.exception("engine step failed")
                _fail(dict.fromkeys([*joining, *self._active]), f"engine step failed: {error!r}")
                self._active, self._cache, self._mask = [], None, None
            self._log_stats()
        for sequence in [*self._waiting, *self._active]:
            sequence.on_finish(None, "the engine stopped")
        with self._wake:
            for _, done in self._jobs:
                done.set_exception(RuntimeError("the engine stopped"))
            self._jobs.clear()

    def _attention_kernels(self) -> contextlib.AbstractContextManager[None]:
        """On CUDA, SDPA without its cuDNN kernel: cuDNN plans a graph for every new shape, and the
        key length grows by one at every decode step (29 ms of CPU per attention call was measured
        on an H200 in bf16, against ~1 ms for a whole step with the other kernels)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel(_GPU_ATTENTION)

    def _take_joining(self) -> list[Sequence]:
        """The waiting sequences that join the batch now, in order, each with its prefix-cache
        match: as many as fit the batch and `max_prefill_tokens` (new tokens x rows, padding
        included), without more padding than `PADDING_SLACK` allows. A sequence that would reuse
        a much longer prefix from a prompt being prefilled in this step waits for the next."""
        room = self.max_batch - len(self._active)
        joining: list[Sequence] = []
        deferred: list[Sequence] = []
        widest = real = 0
        generation = self.weight_generation()
        while self._waiting and len(joining) < room:
            candidate = self._waiting.popleft()
            if candidate.cancelled:
                candidate.on_finish("abort", None)
                continue
            candidate.match = self.prefix_cache.lookup(candidate.prompt_tokens, generation)
            new = len(candidate.prompt_ids) - (candidate.match.length if candidate.match else 0)
            if joining and self._reuses_a_peer(candidate, joining):
                deferred.append(candidate)
                continue
            width, rows = max(widest, new), len(joining) + 1
            if joining and (
                width * rows > self.max_prefill_tokens
                or width * rows > 2 * (real + new) + PADDING_SLACK
            ):
                self._waiting.appendleft(candidate)
                break
            joining.append(candidate)
            widest, real = width, real + new
        self._waiting.extendleft(reversed(deferred))
        return joining

    def _reuses_a_peer(self, candidate: Sequence, joining: list[Sequence]) -> bool:
        """Whether a prompt about to be prefilled (and then cached) shares `PREFILL_KEEP_TOKENS`
        more tokens with `candidate` than the cache has now."""
        if not self.prefix_cache.enabled:
            return False
        cached = candidate.match.length if candidate.match else 0
        limit = len(candidate.prompt_ids) - 1
        for peer in joining:
            peer_new = len(peer.prompt_ids) - (peer.match.length if peer.match else 0)
            if peer_new < PREFILL_KEEP_TOKENS:
                continue
            shared = common_prefix(peer.prompt_tokens, candidate.prompt_tokens, limit)
            if shared - cached >= PREFILL_KEEP_TOKENS:
                return True
        return False

    def _prefill_and_join(self, joining: list[Sequence]) -> None:
        """Prefills the joining sequences and joins them to the batch. A prefill that fails fails
        the joining sequences only: it never touched the running batch, which goes on."""
        try:
            cache, mask = self._prefill(joining)
        except Exception as error:
            log.exception("prefill failed")
            _fail(joining, f"prefill failed: {error!r}")
            return
        self._join(joining, cache, mask)

    def _prefill(self, joining: list[Sequence]) -> tuple[DynamicCache, torch.Tensor]:
        """One forward pass over the joining sequences' new tokens, on top of their cached
        prefixes: row i is `[pad | cached_i | pad | new_i]` (see the module docstring). Returns
        their KV cache and attention mask, for `_join`."""
        device = self.device
        generation = self.weight_generation()
        matches: list[Match | None] = []
        for sequence in joining:
            match = sequence.match
            sequence.match = None
            if match is not None and match.entry.version != generation:
                match = None  # the weights changed since the lookup
            self.prefix_cache.use(match, len(sequence.prompt_ids))
            sequence.cached_tokens = match.length if match else 0
            sequence.kv_generation = generation
            sequence.weight_version = self.weight_version()
            matches.append(match)
        past = max(s.cached_tokens for s in joining)
        longest = max(len(s.prompt_ids) - s.cached_tokens for s in joining)
        ids = torch.zeros((len(joining), longest), dtype=torch.long)
        mask = torch.zeros((len(joining), past + longest), dtype=torch.long)
        for row, sequence in enumerate(joining):
            cached = sequence.cached_tokens
            new = sequence.prompt_ids[cached:]
            ids[row, longest - len(new) :] = torch.tensor(new)
            mask[row, past - cached : past] = 1
            mask[row, past + longest - len(new) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
        mask = mask.to(device)
        cache = _new_cache()
        if past:
            cache.layers.extend(_cached_layers(matches, past, longest))
        logits = self._logits(ids.to(device), mask, positions.to(device), cache)
        self._sample(joining, logits)
        for row, sequence in enumerate(joining):
            if len(sequence.prompt_ids) - sequence.cached_tokens >= PREFILL_KEEP_TOKENS:
                self._keep(sequence.prompt_tokens, cache, mask, row, generation)
        return cache, mask

    def _keep(
        self,
        tokens: np.ndarray,
        cache: DynamicCache,
        mask: torch.Tensor,
        row: int,
        generation: int,
    ) -> None:
        """Copies row `row`'s KV (the KV of `tokens`) out of `cache` into the prefix cache."""
        if not self.prefix_cache.enabled or len(tokens) < self.prefix_cache.min_tokens:
            return
        columns = mask[row].nonzero()[:, 0]
        if len(columns) != len(tokens):  # never expected: the cache would be wrong, so keep none
            log.warning(
                "not caching a sequence: %d KV positions for %d tokens", len(columns), len(tokens)
            )
            return
        start = int(columns[0])
        contiguous = int(columns[-1]) - start + 1 == len(columns)
        kv = []
        for layer in _layers(cache):
            if contiguous:
                keys = layer.keys[row : row + 1, :, start : start + len(columns)].clone()
                values = layer.values[row : row + 1, :, start : start + len(columns)].clone()
            else:
                keys = layer.keys[row : row + 1].index_select(2, columns)
                values = layer.values[row : row + 1].index_select(2, columns)
            kv.append((keys, values))
        self.prefix_cache.insert(tokens, tuple(kv), generation)

    def _decode_step(self) -> None:
        assert self._cache is not None and self._mask is not None
        device = self.device
        ids = torch.tensor([[s.next_token] for s in self._active], device=device)
        positions = self._mask.sum(-1, keepdim=True)
        mask = torch.cat([self._mask, torch.ones_like(positions)], dim=-1)
        logits = self._logits(ids, mask, positions, self._cache)
        self._mask = mask
        self.steps += 1
        self._sample(self._active, logits)

    def _logits(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """The logits of the last position of every row, [rows, vocab].

        For a plain LM head the product is `W @ h.T`, one matrix multiply for the whole batch:
        `F.linear`'s `h @ W.T` with many rows runs 2-2.7x slower on CPU (MKL/oneDNN, 4-16 rows of
        576 against the default model's 49,152 x 576 head; see docs/engine.md)."""
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        if self._head is None:
            out = self.model(
                **inputs, use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache}
            )
            return out.logits[:, -1, :]  # type: ignore[no-any-return]
        # Read at every step: the trainer may swap the modules (the weights change in place).
        body, weight = self.model.model, self.model.lm_head.weight
        hidden = body(**inputs, use_cache=True, **{self._head: cache}).last_hidden_state[:, -1]
        if len(hidden) == 1:
            return torch.nn.functional.linear(hidden, weight)
        return torch.mm(weight, hidden.T).T.contiguous()

    def _sample(self, sequences: list[Sequence], logits: torch.Tensor) -> None:
        logits = logits.cpu()
        allowed: list[torch.Tensor | None] = []
        for sequence in sequences:
            try:
                allowed.append(
                    sequence.matcher.allowed(logits.shape[-1]) if sequence.matcher else None
                )
            except ConstraintError as error:
                allowed.append(None)
                _failing(sequence, RequestFault(error))
        rows = [row for row, sequence in enumerate(sequences) if sequence.error is None]
        while rows:
            rows_logits = logits[rows] if len(rows) < len(sequences) else logits
            params = [sequences[row].params for row in rows]
            try:
                tokens, logprobs = sample_next(
                    rows_logits,
                    params,
                    [sequences[row].generator for row in rows],
                    [sequences[row].output_ids for row in rows],
                    [allowed[row] for row in rows],
                    [sequences[row].prompt_ids for row in rows],
                )
                tops = alternatives(rows_logits, params)
                break
            except UnsampleableRows as error:
                # Nothing was drawn: those rows fail alone, the others are sampled without them.
                for index in error.rows:
                    sequence = sequences[rows[index]]
                    if isinstance(error, NothingAllowed):
                        _failing(
                            sequence,
                            RequestFault(
                                "no token may come next: the structured output allows only the "
                                f"end of the answer, and min_tokens ({sequence.params.min_tokens})"
                                f" forbids ending after {len(sequence.output_ids)} tokens"
                            ),
                        )
                        continue
                    _failing(
                        sequence,
                        "the model's next-token logits for this request are NaN or infinite: "
                        "nothing can be sampled from them",
                    )
                rows = [row for index, row in enumerate(rows) if index not in set(error.rows)]
        else:
            return
        for row, token, logprob, top in zip(rows, tokens, logprobs, tops, strict=True):
            sequence = sequences[row]
            sequence.output_ids.append(token)
            sequence.logprobs.append(logprob)
            sequence.next_token = token
            sequence.on_token(token, logprob, top)
            if sequence.matcher is not None:
                try:
                    sequence.matcher.advance(token)
                except ConstraintError as error:
                    _failing(sequence, RequestFault(error))
                    continue
            try:
                sequence.finish_reason = self._finish_reason(sequence)
            except Exception as error:  # one request's own check fails that request alone
                log.exception("the end check of a request failed")
                _failing(sequence, f"the engine could not check this request's end: {error!r}")

    def _finish_reason(self, sequence: Sequence) -> str | None:
        if sequence.cancelled:
            return "abort"
        last = sequence.output_ids[-1]
        if last in self.eos_token_ids or last in sequence.params.stop_token_ids:
            return "stop"
        if (sequence.params.stop or sequence.params.tool_calls) and self._hit_stop(sequence):
            return "stop"
        if len(sequence.output_ids) >= sequence.params.max_tokens:
            return "length"
        if len(sequence.prompt_ids) + len(sequence.output_ids) >= self.max_model_len:
            return "length"
        return None

    def _hit_stop(self, sequence: Sequence) -> bool:
        """A stop string, or (tools offered) the end of a tool-call turn, in the last tokens."""
        params = sequence.params
        # A byte-level BPE token holds at least one byte of text (a character may take four), so
        # a stop string spans at most as many tokens as it has UTF-8 bytes, plus one partial
        # token on each side.
        longest_stop = max((len(stop.encode()) for stop in params.stop), default=0)
        window = max(longest_stop, TOOL_TURN_TOKENS if params.tool_calls else 0)
        tail = self.decode(sequence.output_ids[-(window + 2) :])
        if any(stop in tail for stop in params.stop):
            return True
        return (
            params.tool_calls
            and tool_turn_end(tail, final=False, parallel=params.parallel_tool_calls) is not None
        )

    def _join(self, joining: list[Sequence], cache: DynamicCache, mask: torch.Tensor) -> None:
        if self._cache is None or self._mask is None or not self._active:
            self._active, self._cache, self._mask = list(joining), cache, mask
            return
        length = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(_layers(self._cache), _layers(cache), strict=True):
            keys, values = (_stack_right_aligned([a, b], length) for a, b in _pairs(old, new))
            _hold(old, keys, values, length)
        self._mask = torch.cat([_left_pad(self._mask, length), _left_pad(mask, length)], 0)
        self._active.extend(joining)

    def _retire(self) -> None:
        """Finished sequences leave the batch; their KV goes to the prefix cache. The rows that
        stay are packed: each one's positions right-aligned, holes and padding no one needs cut."""
        aborting = self._aborting
        for sequence in self._active:
            if aborting is not None and sequence.finish_reason in (None, "abort"):
                # An error, not `abort`: that reads as an answer its client cut short.
                _failing(sequence, aborting)
            elif sequence.cancelled and sequence.finish_reason is None:
                sequence.finish_reason = "abort"
        keep = [row for row, s in enumerate(self._active) if s.finish_reason is None]
        done = [s for s in self._active if s.finish_reason is not None]
        if done:
            assert self._cache is not None and self._mask is not None
            if self.prefix_cache.enabled:
                generation = self.weight_generation()
                for row, sequence in enumerate(self._active):
                    if (
                        sequence.finish_reason is not None
                        and sequence.error is None
                        and sequence.kv_generation == generation
                    ):
                        # Its KV covers the prompt and every sampled token but the last.
                        tokens = as_tokens([*sequence.prompt_ids, *sequence.output_ids[:-1]])
                        self._keep(tokens, self._cache, self._mask, row, generation)
            if keep:
                columns = [self._mask[row].nonzero()[:, 0] for row in keep]
                length = max(len(c) for c in columns)
                for layer in _layers(self._cache):
                    _hold(
                        layer,
                        _gather_right_aligned(layer.keys, keep, columns, length),
                        _gather_right_aligned(layer.values, keep, columns, length),
                        length,
                    )
                mask = self._mask.new_zeros(len(keep), length)
                for row, used in enumerate(columns):
                    mask[row, length - len(used) :] = 1
                self._mask = mask
                self._active = [self._active[row] for row in keep]
            else:
                self._active, self._cache, self._mask = [], None, None
        for sequence in done:
            if sequence.error is not None:
                sequence.on_finish(None, sequence.error)
            else:
                sequence.on_finish(sequence.finish_reason, None)

    def _log_stats(self) -> None:
        queries, logged_at = self._logged
        now = time.monotonic()
        if now - logged_at < STATS_LOG_S:
            return
        stats = self.prefix_cache.stats()
        if stats.queries == queries:
            return
        self._logged = (stats.queries, now)
        share = stats.reused_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
        log.info(
            "prefix cache: %d of %d prompts hit, %d of %d prompt tokens reused (%.0f %%), "
            "%d entries, %.2f of %.2f GiB",
            stats.hits,
            stats.queries,
            stats.reused_tokens,
            stats.prompt_tokens,
            100 * share,
            stats.entries,
            stats.bytes / 2**30,
            stats.capacity_bytes / 2**30,
        )


class RequestFault(str):
    """An error the request itself caused (its grammar cannot be followed, or allows nothing
    its `min_tokens` accepts): answered 400, where the engine's own failures are 500."""


class ShuttingDown(str):
    """Why a request failed when the engine aborted it to shut down: answered 503."""


def _failing(sequence: Sequence, error: str) -> None:
    """Marks `sequence` failed with `error`; it is told so when it leaves (`_retire`)."""
    sequence.finish_reason, sequence.error = "error", error


def _fail(sequences: Iterable[Sequence], error: str) -> None:
    """Ends `sequences`, none of which was told it finished, with `error`."""
    for sequence in sequences:
        sequence.finish_reason, sequence.error = "error", error
        sequence.on_finish(None, error)


def _cached_layers(matches: list[Match | None], past: int, longest: int) -> list[_RoomyLayer]:
    """Cache layers holding each row's cached prefix right-aligned in `past` columns (zeros in
    front), with room for the `longest` new tokens and some decode steps after them."""
    entry = next(m.entry for m in matches if m is not None)
    layers = []
    for index, (keys_like, values_like) in enumerate(entry.kv):
        rooms = []
        for like in (keys_like, values_like):
            _, heads, _, dim = like.shape
            room = like.new_empty(len(matches), heads, _room_for(past + longest), dim)
            room[:, :, :past].zero_()
            for row, match in enumerate(matches):
                if match is not None:
                    part = match.entry.kv[index][0 if like is keys_like else 1]
                    room[row, :, past - match.length : past] = part[0, :, : match.length]
            rooms.append(room)
        layers.append(_RoomyLayer.holding(rooms[0], rooms[1], past))
    return layers


def _cache_kwarg(module: Any) -> str:
    """transformers 5 renamed `past_key_values` to `cache` (the old name warns on every call)."""
    parameters = inspect.signature(module.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _plain_head(model: Any) -> str | None:
    """When the logits are exactly `model.lm_head(model.model(...).last_hidden_state)`, the
    cache argument of `model.model`; else None (the logits come from `model` itself)."""
    if type(model).__name__ not in PLAIN_HEAD_MODELS:
        return None
    head, body = getattr(model, "lm_head", None), getattr(model, "model", None)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or body is None:
        return None
    return _cache_kwarg(body)


def _room_for(length: int) -> int:
    """Columns to allocate for a KV of `length` positions that will grow by decode steps."""
    return length + max(64, length // 4)


def _pairs(old: Any, new: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(old.keys, new.keys), (old.values, new.values)]


def _stack_right_aligned(parts: list[torch.Tensor], length: int) -> torch.Tensor:
    """The KV tensors `parts` one after the other along the batch axis, each left-padded with
    zeros to `length` positions, in a buffer with room to grow (see `_RoomyLayer`)."""
    _, heads, _, dim = parts[0].shape
    room = parts[0].new_empty(sum(len(p) for p in parts), heads, _room_for(length), dim)
    row = 0
    for part in parts:
        pad = length - part.shape[2]
        room[row : row + len(part), :, :pad].zero_()
        room[row : row + len(part), :, pad:length] = part
        row += len(part)
    return room


def _gather_right_aligned(
    tensor: torch.Tensor, rows: list[int], columns: list[torch.Tensor], length: int
) -> torch.Tensor:
    """Row i of the result: the positions `columns[i]` of row `rows[i]` of `tensor`, right-aligned
    in `length` positions with zeros before, in a buffer with room to grow."""
    _, heads, _, dim = tensor.shape
    room = tensor.new_empty(len(rows), heads, _room_for(length), dim)
    for out, (row, used) in enumerate(zip(rows, columns, strict=True)):
        pad = length - len(used)
        room[out, :, :pad].zero_()
        if len(used) and int(used[-1]) - int(used[0]) + 1 == len(used):
            start = int(used[0])
            room[out, :, pad:length] = tensor[row, :, start : start + len(used)]
        else:
            room[out, :, pad:length] = tensor[row].index_select(1, used)
    return room


def _hold(layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
    """Makes `layer` hold the first `length` positions of the buffers `keys` and `values`; a
    `_RoomyLayer` writes its next positions into the rest."""
    if isinstance(layer, _RoomyLayer):
        layer._room = (keys, values)
    layer.keys, layer.values = keys[:, :, :length], values[:, :, :length]


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pads the sequence axis (dim 2 of a KV tensor, dim 1 of a mask) on the left."""
    axis = 2 if tensor.dim() == 4 else 1
    missing = length - tensor.shape[axis]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=axis)


class _RoomyLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A cache layer whose keys and values are views of buffers with room to grow along the
    sequence axis: a decode step writes its one new position in place, where `DynamicLayer`
    concatenates (copies) the whole cache of every layer at every step.

    When the scheduler replaces `keys`/`values` (a sequence joins or leaves the batch), the next
    update moves them into a new buffer.
    """

    _room: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, length: int) -> _RoomyLayer:
        """A layer whose first `length` positions are those of the buffers `keys` and `values`;
        the rest of the buffers is room for the next updates."""
        layer = cls()
        layer.lazy_initialization(keys, values)
        _hold(layer, keys, values, length)
        return layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        old_keys, old_values = self.keys, self.values
        if not self.is_initialized or old_keys is None or old_values is None:
            self.lazy_initialization(key_states, value_states)
            old_keys = old_values = None
        length = old_keys.shape[-2] if old_keys is not None and old_keys.numel() else 0
        needed = length + key_states.shape[-2]
        room = self._room
        if room is None or not _front_of(room, old_keys, old_values, needed):
            batch, heads, _, dim = key_states.shape
            capacity = needed + max(64, needed // 4)
            room = (
                key_states.new_empty(batch, heads, capacity, dim),
                value_states.new_empty(batch, heads, capacity, value_states.shape[-1]),
            )
            if length and old_keys is not None and old_values is not None:
                room[0][:, :, :length] = old_keys
                room[1][:, :, :length] = old_values
            self._room = room
        room[0][:, :, length:needed] = key_states
        room[1][:, :, length:needed] = value_states
        keys, values = room[0][:, :, :needed], room[1][:, :, :needed]
        self.keys, self.values = keys, values
        return keys, values


def _front_of(
    room: tuple[torch.Tensor, torch.Tensor],
    keys: torch.Tensor | None,
    values: torch.Tensor | None,
    needed: int,
) -> bool:
    """Whether `keys` and `values` are still the front of `room`, which has space for `needed`."""
    if keys is None or values is None or keys.numel() == 0:
        return False
    return all(
        part.data_ptr() == buffer.data_ptr()
        and part.shape[:2] == buffer.shape[:2]
        and part.stride() == buffer.stride()
        and buffer.shape[2] >= needed
        for part, buffer in zip((keys, values), room, strict=True)
    )


def _new_cache() -> DynamicCache:
    cache = DynamicCache()
    if hasattr(cache, "layer_class_to_replicate") and not cache.layers:
        cache.layer_class_to_replicate = _RoomyLayer
    return cache


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's per-layer key/value holders (`.keys`, `.values`: [batch, heads, seq, dim])."""
    return list(cache.layers)
