"""Continuous batching on a Hugging Face causal LM: one thread, one decode step for every sequence.

Requests join the running batch between decode steps: their prompts are prefilled together
(left-padded), then their KV caches are left-padded to the running batch's length and joined to it
along the batch axis. A finished or cancelled sequence leaves at the next step, and the padding
columns that no sequence needs any more are cut. Positions come from the attention mask, so left
padding never shifts a sequence's RoPE positions.

Every forward pass holds `weights_lock`: whoever changes the weights in place takes it and the
batch waits between two steps (a sequence started under the old weights goes on under the new
ones, as in vLLM's in-place weight update; it records the version it started with).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from reins.engine.sampling import SamplingParams, sample_next

log = logging.getLogger(__name__)

_GPU_ATTENTION = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]

TokenSink = Callable[[int, float], None]
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
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    cancelled: bool = False
    generator: torch.Generator | None = None
    next_token: int = -1

    def __post_init__(self) -> None:
        self.generator = self.params.generator()


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
    ) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.decode = decode
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.weights_lock = weights_lock or threading.Lock()
        self.steps = 0
        # transformers 5 renamed `past_key_values` to `cache` (the old name warns on every call).
        parameters = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="reins-engine", daemon=True)
        self._thread.start()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device  # type: ignore[no-any-return]

    def submit(self, sequence: Sequence) -> None:
        with self._wake:
            if self._stopped:
                raise RuntimeError("the engine is stopped")
            self._waiting.append(sequence)
            self._wake.notify()

    def cancel(self, sequence: Sequence) -> None:
        """Frees the sequence's slot at the next step (the client went away)."""
        sequence.cancelled = True
        with self._wake:
            self._wake.notify()

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
                while not self._stopped and not self._waiting and not self._active:
                    self._wake.wait()
                if self._stopped:
                    break
                joining = self._take_joining()
            try:
                with self.weights_lock, torch.inference_mode(), self._attention_kernels():
                    if joining:
                        self._prefill(joining)
                    elif self._active:
                        self._decode_step()
                    self._retire()
            except Exception as error:  # a failed step fails its sequences, not the engine
                log.exception("engine step failed")
                for sequence in [*joining, *self._active]:
                    if sequence.finish_reason is None:
                        sequence.finish_reason = "error"
                        sequence.on_finish(None, f"engine step failed: {error!r}")
                self._active, self._cache, self._mask = [], None, None
        for sequence in [*self._waiting, *self._active]:
            sequence.on_finish(None, "the engine stopped")

    def _attention_kernels(self) -> contextlib.AbstractContextManager[None]:
        """On CUDA, SDPA without its cuDNN kernel: cuDNN plans a graph for every new shape, and the
        key length grows by one at every decode step (29 ms of CPU per attention call was measured
        on an H200 in bf16, against ~1 ms for a whole step with the other kernels)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel(_GPU_ATTENTION)

    def _take_joining(self) -> list[Sequence]:
        room = self.max_batch - len(self._active)
        joining: list[Sequence] = []
        longest = 0
        while self._waiting and len(joining) < room:
            candidate = self._waiting[0]
            if candidate.cancelled:
                self._waiting.popleft()
                candidate.on_finish("abort", None)
                continue
            longest = max(longest, len(candidate.prompt_ids))
            if joining and longest * (len(joining) + 1) > self.max_prefill_tokens:
                break
            joining.append(self._waiting.popleft())
        return joining

    def _prefill(self, joining: list[Sequence]) -> None:
        device = self.device
        longest = max(len(s.prompt_ids) for s in joining)
        ids = torch.zeros((len(joining), longest), dtype=torch.long)
        mask = torch.zeros((len(joining), longest), dtype=torch.long)
        for row, sequence in enumerate(joining):
            n = len(sequence.prompt_ids)
            ids[row, longest - n :] = torch.tensor(sequence.prompt_ids)
            mask[row, longest - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = _new_cache()
        out = self.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        self._sample(joining, out.logits[:, -1, :])
        self._join(joining, cache, mask.to(device))

    def _decode_step(self) -> None:
        assert self._cache is not None and self._mask is not None
        device = self.device
        ids = torch.tensor([[s.next_token] for s in self._active], device=device)
        positions = self._mask.sum(-1, keepdim=True)
        mask = torch.cat([self._mask, torch.ones_like(positions)], dim=-1)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kwarg: self._cache},
        )
        self._mask = mask
        self.steps += 1
        self._sample(self._active, out.logits[:, -1, :])

    def _sample(self, sequences: list[Sequence], logits: torch.Tensor) -> None:
        tokens, logprobs = sample_next(
            logits.cpu(), [s.params for s in sequences], [s.generator for s in sequences]
        )
        for sequence, token, logprob in zip(sequences, tokens, logprobs, strict=True):
            sequence.output_ids.append(token)
            sequence.logprobs.append(logprob)
            sequence.next_token = token
            sequence.on_token(token, logprob)
            sequence.finish_reason = self._finish_reason(sequence)

    def _finish_reason(self, sequence: Sequence) -> str | None:
        if sequence.cancelled:
            return "abort"
        if sequence.output_ids[-1] in self.eos_token_ids:
            return "stop"
        if sequence.params.stop and self._hit_stop(sequence):
            return "stop"
        if len(sequence.output_ids) >= sequence.params.max_tokens:
            return "length"
        if len(sequence.prompt_ids) + len(sequence.output_ids) >= self.max_model_len:
            return "length"
        return None

    def _hit_stop(self, sequence: Sequence) -> bool:
        longest_stop = max(len(stop) for stop in sequence.params.stop)
        # A stop string spans at most that many tokens, plus one partial token on each side.
        tail = self.decode(sequence.output_ids[-(longest_stop + 2) :])
        return any(stop in tail for stop in sequence.params.stop)

    def _join(self, joining: list[Sequence], cache: DynamicCache, mask: torch.Tensor) -> None:
        if self._cache is None or self._mask is None or not self._active:
            self._active, self._cache, self._mask = list(joining), cache, mask
            return
        length = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(_layers(self._cache), _layers(cache), strict=True):
            old.keys = torch.cat([_left_pad(old.keys, length), _left_pad(new.keys, length)], 0)
            old.values = torch.cat(
                [_left_pad(old.values, length), _left_pad(new.values, length)], 0
            )
        self._mask = torch.cat([_left_pad(self._mask, length), _left_pad(mask, length)], 0)
        self._active.extend(joining)

    def _retire(self) -> None:
        """Finished sequences leave the batch; padding no one needs is cut."""
        for sequence in self._active:
            if sequence.cancelled and sequence.finish_reason is None:
                sequence.finish_reason = "abort"
        keep = [row for row, s in enumerate(self._active) if s.finish_reason is None]
        done = [s for s in self._active if s.finish_reason is not None]
        if done:
            assert self._cache is not None and self._mask is not None
            if keep:
                index = torch.tensor(keep, device=self._mask.device)
                self._mask = self._mask.index_select(0, index)
                used = self._mask.any(dim=0).nonzero()
                start = int(used[0]) if len(used) else 0
                self._mask = self._mask[:, start:]
                for layer in _layers(self._cache):
                    layer.keys = layer.keys.index_select(0, index)[:, :, start:]
                    layer.values = layer.values.index_select(0, index)[:, :, start:]
                self._active = [self._active[row] for row in keep]
            else:
                self._active, self._cache, self._mask = [], None, None
        for sequence in done:
            sequence.on_finish(sequence.finish_reason, None)


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
