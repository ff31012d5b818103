"""Checkpoints: `<run>/checkpoints/step-NNNNNN/` holds the backend's model and optimizer state and
`trainer.json` (next step, data position, weight version, RNG states). A checkpoint is written in a
temporary folder and renamed into place, so it is complete or absent; older ones are pruned."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reins.trainer.backend import Backend

PREFIX = "step-"


@dataclass
class TrainerState:
    next_step: int
    """The first step a resumed run makes."""
    data_position: int
    """Training tasks served so far."""
    weight_version: int
    """The engine's weight version after the last update."""
    rng: dict[str, Any]


def capture_rng() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "torch": torch.get_rng_state().tolist(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    numpy = state["numpy"]
    np.random.set_state((numpy[0], np.asarray(numpy[1], dtype=np.uint32), *numpy[2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def save(run_dir: Path, backend: Backend, state: TrainerState, *, keep: int) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.next_step:06d}"
    staging = root / f".{final.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    backend.save_checkpoint(staging)
    (staging / "trainer.json").write_text(json.dumps(asdict(state), default=_plain))
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    for old in sorted(root.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir: Path) -> Path | None:
    found = sorted((run_dir / "checkpoints").glob(f"{PREFIX}*"))
    return found[-1] if found else None


def load(folder: Path, backend: Backend) -> TrainerState:
    backend.load_checkpoint(folder)
    return TrainerState(**json.loads((folder / "trainer.json").read_text()))


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.integer | np.floating):
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint")
