"""The embedded engine: a Hugging Face causal LM behind a batching scheduler, with a weight version.

In the trainer's process the engine and the trainer hold the same `nn.Module`: publishing new
weights is `with engine.updating_weights(): optimizer.step()`: the batch waits between two decode
steps while the weights change in place, and the version goes up by one when the block ends.
An engine in its own process (`reins engine`) takes new weights with `load_weights(path)`.

The prefix cache (`prefix_cache_gb`, default 2 GiB; 0 turns it off) keeps the KV of finished
calls so that a later prompt starting with one of them prefills only what it adds; a weight
update drops every entry of the older weights. See `prefix_cache.py` and docs/engine.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from reins.allocator import return_freed_memory
from reins.engine.constraint import Grammars
from reins.engine.folder import check_model_folder
from reins.engine.prefix_cache import PrefixCache, PrefixCacheStats
from reins.engine.sampling import Alternatives, SamplingParams
from reins.engine.scheduler import BatchScheduler, Sequence, ShuttingDown
from reins.engine.token_text import TokenTexts
from reins.engine.weights import check_fits, load_into, read_folder

log = logging.getLogger(__name__)
T = TypeVar("T")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_PREFIX_CACHE_GB = 2.0
"""About 45k tokens of the default model's KV in float32 (46 KB per token), 90k in bfloat16."""


class WeightVersionError(ValueError):
    """An update asked for a lower weight version than the one served."""


@dataclass(frozen=True)
class Token:
    """One sampled token of choice `index`."""

    index: int
    token_id: int
    logprob: float
    top: Alternatives = ()
    """The most likely tokens at its position (as many as the request's `top_logprobs`)."""
    weight_version: int = 0
    """The version of the weights the choice's prefill ran with (its first token's)."""


@dataclass(frozen=True)
class Finished:
    """Choice `index` ended: `reason` is stop | length | abort, or `error` says what failed."""

    index: int
    reason: str | None
    error: str | None = None
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (not prefilled)."""


@dataclass
class WeightUpdate:
    changed: bool = True
    """False: the block changed no weight (a training step with no optimizer step), so the
    version stays: rollouts served before it are not a version older for it."""


class EmbeddedEngine:
    """Generates with `model`; see the module docstring for weight updates."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str,
        weight_version: int = 0,
        max_batch: int = 16,
        max_model_len: int | None = None,
        prefix_cache_gb: float = DEFAULT_PREFIX_CACHE_GB,
    ) -> None:
        cache_bytes = prefix_cache_bytes(prefix_cache_gb)
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self._weight_version = weight_version
        self._weight_generation = 0
        """Moves on at every weight change, whatever version it serves (a reload under the same
        version number changes the weights too): the KV of one generation is stale in the next."""
        limit = getattr(model.config, "max_position_embeddings", None) or 4096
        self.max_model_len = min(max_model_len or 4096, limit)
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.grammars = Grammars(tokenizer, self.eos_token_ids)
        """Structured output's compiler (`constraint.py`)."""
        self.token_texts = TokenTexts(tokenizer)
        """Each token's text and bytes, as logprobs show them."""
        self._weights_lock = threading.Lock()
        self.prefix_cache = PrefixCache(cache_bytes)
        self.scheduler = BatchScheduler(
            model,
            eos_token_ids=self.eos_token_ids,
            decode=self.decode,
            max_batch=max_batch,
            max_model_len=self.max_model_len,
            weights_lock=self._weights_lock,
            prefix_cache=self.prefix_cache,
            weight_generation=lambda: self.weight_generation,
            weight_version=lambda: self.weight_version,
        )

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        dtype: str = "auto",
        device: str | None = None,
        name: str | None = None,
        **options: Any,
    ) -> EmbeddedEngine:
        """Loads a model folder (default: the prepared default model) on `device` (cuda if any).

        `dtype="auto"` is float32 on CPU (faster than bfloat16 once requests are batched on CPUs
        without native bf16 matmuls, and logprobs exact; see docs/engine.md) and bfloat16 on GPU.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # Checked before the model loads (seconds): a size that cannot be is told at once.
        prefix_cache_bytes(options.get("prefix_cache_gb", DEFAULT_PREFIX_CACHE_GB))
        if path is None:
            from reins.engine.prepare import prepare_default_model

            path = prepare_default_model()
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == "auto":
            dtype = "float32" if torch.device(device).type == "cpu" else "bfloat16"
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, not {dtype!r}")
        folder = Path(path)
        check_model_folder(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype])
        model = model.to(device)
        model.eval()
        return cls(model, tokenizer, name=name or folder.name, **options)

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def weight_generation(self) -> int:
        """How many times the weights changed (the prefix cache's tag for them)."""
        return self._weight_generation

    @contextlib.contextmanager
    def updating_weights(self, version: int | None = None) -> Iterator[WeightUpdate]:
        """Holds generation between two steps while the block changes the weights in place;
        they are then served as `version` (default: the next number), unless the block says
        it changed none (`WeightUpdate.changed`): the version then stays.

        The prefix cache is emptied before the block, not after: its KV (up to
        `prefix_cache_gb`) is stale once the weights change, and freeing it first keeps it out
        of the update's peak memory. What generation freed then goes back to the system
        (`malloc_trim`): glibc keeps freed memory in the arena of the thread that freed it,
        where an update in another thread cannot reuse it (main job: 4.7 -> 4.0 GB peak RSS,
        docs/benchmarks.md)."""
        with self._weights_lock:
            # Checked under the lock: an update waiting for it may serve a higher version yet.
            target = self._weight_version + 1 if version is None else version
            if target < self._weight_version:
                raise WeightVersionError(
                    f"weight versions only go up: engine {self.name} serves version "
                    f"{self._weight_version}, asked to serve {target}"
                )
            # Before the block: whatever it changes (a failed update may have changed some),
            # nothing computed with the weights before it is reused after it, the running
            # sequences' KV included.
            self._weight_generation += 1
            self.prefix_cache.invalidate(self._weight_generation)
            return_freed_memory()
            update = WeightUpdate()
            yield update
            if update.changed:
                self._weight_version = target
        if update.changed:
            log.info("engine %s now serves weight version %d", self.name, self._weight_version)

    def update_weights(
        self,
        apply: Callable[[], T],
        version: int | None = None,
        *,
        changed: Callable[[T], bool] | None = None,
    ) -> T:
        """Runs `apply`, which changes the weights in place (a training step), inside
        `updating_weights` on the engine's own thread, so that the update and generation reuse
        each other's freed memory (`BatchScheduler.run_between_steps`); returns its result.
        When `changed(result)` is False the weights are the same: the version stays."""

        def job() -> T:
            with self.updating_weights(version) as update:
                result = apply()
                update.changed = changed is None or changed(result)
            return result

        return self.scheduler.run_between_steps(job)

    def load_weights(self, path: str | Path, version: int | None = None) -> int:
        """Loads a saved model folder's weights in place, served as `version` (default: the
        next number; the same number again reloads it); returns the version now served."""
        state = read_folder(path)
        check_fits(self.model, state)  # weights that do not fit change nothing, the cache neither
        with self.updating_weights(version):
            load_into(self.model, state)
        return self._weight_version

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.prefix_cache.stats()

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    async def generate(
        self, prompt_ids: list[int], params: list[SamplingParams]
    ) -> AsyncGenerator[Token | Finished, None]:
        """Tokens of `len(params)` choices as they come, then one `Finished` per choice.

        Leaving the iteration early (the client went away) cancels the choices still running.
        """
        if not prompt_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Token | Finished] = asyncio.Queue()

        def put(item: Token | Finished) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                loop.call_soon_threadsafe(queue.put_nowait, item)

        sequences: list[Sequence] = []
        for index, choice_params in enumerate(params):

            def on_token(token: int, logprob: float, top: Alternatives, index: int = index) -> None:
                put(Token(index, token, logprob, top, sequences[index].weight_version))

            def on_finish(reason: str | None, error: str | None, index: int = index) -> None:
                put(Finished(index, reason, error, sequences[index].cached_tokens))

            sequence = Sequence(
                list(prompt_ids), choice_params, on_token, on_finish, self.weight_version
            )
            if choice_params.grammar is not None:
                sequence.matcher = self.grammars.matcher(choice_params.grammar)
            sequences.append(sequence)
        for sequence in sequences:
            self.scheduler.submit(sequence)
        running = len(sequences)
        try:
            while running:
                item = await queue.get()
                if isinstance(item, Finished):
                    running -= 1
                yield item
        finally:
            for sequence in sequences:
                if sequence.finish_reason is None:
                    self.scheduler.cancel(sequence)

    def abort_all(self) -> None:
        """Ends every request, running, waiting or to come, with an error (a 503) at the next
        step: for a server shutting down, which otherwise waits for every answer to end
        (`reins.serving` calls it when its server starts to shut down)."""
        self.scheduler.abort_all(
            ShuttingDown("the engine is shutting down: this request was aborted")
        )

    def close(self) -> None:
        self.scheduler.stop()


def prefix_cache_bytes(gigabytes: float) -> int:
    """The prefix cache's capacity in bytes for `gigabytes` GiB; ValueError unless it is a
    finite number >= 0 (`inf` was an OverflowError's traceback, NaN "cannot convert float NaN
    to integer")."""
    if not math.isfinite(gigabytes) or gigabytes < 0:
        raise ValueError(
            f"prefix_cache_gb must be a finite number >= 0 (0 turns it off), not {gigabytes}"
        )
    return int(gigabytes * 2**30)


def _eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for value in (
        tokenizer.eos_token_id,
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids
