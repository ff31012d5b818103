"""Publishing new weights to the inference engine, behind one interface.

- `InProcessPublisher`: the embedded engine shares the trainer's `nn.Module`; the update runs
  on the engine's thread inside `engine.updating_weights()` (`engine.update_weights`), so
  generation waits between two decode steps, the two reuse each other's freed memory, and the
  version goes up when the update ends. Nothing is copied.
- `ReloadPublisher`: engines in other processes (`reins engine`, vLLM), one or a fleet under
  one model name: the weights are saved once as a Hugging Face folder and every engine is asked
  to load them as the same version number (`fleet.py`). The trainer updates with the gateway
  paused and drained, so no call reaches an engine between two versions.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar

from reins.engine.embedded import EmbeddedEngine
from reins.trainer.backend import Backend
from reins.trainer.fleet import FleetEngine, connect

T = TypeVar("T")


class WeightPublisher(Protocol):
    @property
    def version(self) -> int: ...

    def update(
        self, apply: Callable[[], T], changed: Callable[[T], bool] | None = None
    ) -> tuple[T, float]:
        """Runs `apply` (the optimizer step), publishes the weights: (result, publish seconds).
        When `changed(result)` is False the weights are as before: the version stays (a step
        with no optimizer step must not age the rollouts in flight, nor reload a fleet)."""
        ...


class InProcessPublisher:
    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine

    @property
    def version(self) -> int:
        return self.engine.weight_version

    def update(
        self, apply: Callable[[], T], changed: Callable[[T], bool] | None = None
    ) -> tuple[T, float]:
        applied: list[float] = []

        def timed() -> T:
            result = apply()
            applied.append(time.perf_counter())
            return result

        result = self.engine.update_weights(timed, changed=changed)
        return result, time.perf_counter() - applied[0]


class ReloadPublisher:
    """Publishes by saving the weights once and asking each engine of a fleet (one or several
    servers under one model name, `reins engine` or vLLM) to load them, all as the same version
    number. Each engine's kind is asked once, here. `sleep`: vLLM engines sleep during each
    update (collocated on the trainer's GPUs, `fleet.VllmEngine`)."""

    def __init__(
        self,
        backend: Backend,
        engine_urls: str | Sequence[str],
        folder: Path,
        *,
        version: int = 0,
        sleep: bool = False,
    ) -> None:
        self.backend = backend
        urls = [engine_urls] if isinstance(engine_urls, str) else list(engine_urls)
        if not urls:
            raise ValueError("a ReloadPublisher needs at least one engine URL")
        self.engine_urls = [url.rstrip("/") for url in urls]
        self.engines: list[FleetEngine] = [connect(url, sleep=sleep) for url in self.engine_urls]
        # Absolute: an engine reads the path from its own working directory.
        self.folder = folder.resolve()
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    def update(
        self, apply: Callable[[], T], changed: Callable[[T], bool] | None = None
    ) -> tuple[T, float]:
        for engine in self.engines:
            engine.before_update()
        result = apply()
        started = time.perf_counter()
        if changed is None or changed(result):
            self.publish(self._version + 1)
        elif any(engine.drops_weights for engine in self.engines):
            self.publish(self._version)  # a sleeping vLLM let its weights go: the same again
        return result, time.perf_counter() - started

    def publish(self, version: int) -> None:
        """Every engine serves the backend's current weights as `version` when this returns."""
        staging = self.folder.with_name(self.folder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        self.backend.save_weights(staging)
        shutil.rmtree(self.folder, ignore_errors=True)
        staging.rename(self.folder)
        with ThreadPoolExecutor(len(self.engines)) as pool:
            # list() re-raises the first engine's failure.
            list(pool.map(lambda engine: engine.load(self.folder, version), self.engines))
        self._version = version
