"""Publishing new weights to the inference engine, behind one interface.

- `InProcessPublisher`: the embedded engine shares the trainer's `nn.Module`; the update runs
  inside `engine.updating_weights()`, so generation waits between two decode steps and the
  version goes up when the update ends. Nothing is copied.
- `ReloadPublisher`: an engine in another process (`reins engine`): the weights are saved as a
  Hugging Face folder and the engine is asked to load them (`POST /reins/load_weights`); the
  gateway's model registry gets the new version.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import httpx

from reins.engine.embedded import EmbeddedEngine
from reins.trainer.backend import Backend

T = TypeVar("T")


class WeightPublisher(Protocol):
    @property
    def version(self) -> int: ...

    def update(self, apply: Callable[[], T]) -> tuple[T, float]:
        """Runs `apply` (the optimizer step), publishes the weights: (result, publish seconds)."""
        ...


class InProcessPublisher:
    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine

    @property
    def version(self) -> int:
        return self.engine.weight_version

    def update(self, apply: Callable[[], T]) -> tuple[T, float]:
        with self.engine.updating_weights():
            result = apply()
            started = time.perf_counter()
        return result, time.perf_counter() - started


class ReloadPublisher:
    def __init__(
        self, backend: Backend, engine_url: str, folder: Path, *, version: int = 0
    ) -> None:
        self.backend = backend
        self.engine_url = engine_url.rstrip("/")
        self.folder = folder
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    def update(self, apply: Callable[[], T]) -> tuple[T, float]:
        result = apply()
        started = time.perf_counter()
        staging = self.folder.with_name(self.folder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        self.backend.save_weights(staging)
        shutil.rmtree(self.folder, ignore_errors=True)
        staging.rename(self.folder)
        response = httpx.post(
            f"{self.engine_url}/reins/load_weights", json={"path": str(self.folder)}, timeout=600
        )
        if response.status_code != 200:
            raise RuntimeError(
                f"the engine at {self.engine_url} refused the new weights "
                f"({response.status_code}): {response.text[:500]}"
            )
        self._version = int(response.json()["weight_version"])
        return result, time.perf_counter() - started
