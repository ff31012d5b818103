"""Checkpoints: `<run>/checkpoints/step-NNNNNN/` holds the backend's model and optimizer state and
`trainer.json` (next step, data position, weight version and lineage, groups declared but not yet
trained, the step's metrics record, RNG states, the training task stream's identity).

Invariants:
- a checkpoint is written in a hidden staging folder, its files flushed to the disk (fsync), and
  renamed into place, so a folder named `step-*` is complete, after a power loss too; a staging
  folder left by a crash is never loaded (`latest` does not see it) and `remove_partial` deletes
  it;
- a checkpoint is deleted (pruned, or replaced by a new save of its step) by renaming it to a
  hidden trash name first, so a crash mid-delete leaves no half-deleted `step-*` folder;
- the trainer saves a step's checkpoint before it writes the step's metrics line, and the
  checkpoint holds that line, so a crash in between loses neither (`MetricsLog.settle`);
- older checkpoints are pruned only after the new one is in place.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from reins.trainer.backend import Backend

log = logging.getLogger(__name__)

PREFIX = "step-"
RANK_RNG = "rng"
"""The folder of a sharded checkpoint that holds each rank's random state, `rank-N.json`."""
STAGING = ".partial"
TRASH = ".trash"


@dataclass
class TrainerState:
    next_step: int
    """The first step a resumed run makes."""
    data_position: int
    """Training tasks served so far."""
    weight_version: int
    """The engine's weight version after the last update."""
    rng: dict[str, Any]
    lineage: list[int] = field(default_factory=list)
    """Every weight version this run's weights went through, in order, up to `weight_version`
    (staleness is counted along it; a version not in it names weights a crash discarded)."""
    pending: list[int] = field(default_factory=list)
    """Stream positions of groups declared but not trained yet (async): a resume declares them
    again."""
    record: dict[str, Any] | None = None
    """The metrics record of step `next_step - 1`."""
    stream: dict[str, Any] | None = None
    """The training task stream's identity (`TaskStream.identity`: seed, task count, digest);
    None in checkpoints written before it was kept."""
    setup: dict[str, Any] | None = None
    """What the checkpoint's files are laid out for (`resume.setup_of`: backend, model, LoRA
    shape); None in checkpoints written before it was kept."""


def capture_rng() -> dict[str, Any]:
    """This process's random number generators' states: Python's, numpy's, torch's CPU one and,
    when this process uses CUDA, each GPU's (dropout on a GPU draws from the GPU's generator:
    without them a resumed run drops other units than an unbroken one)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "torch": torch.get_rng_state().tolist(),
    }
    # CUDA started, not merely present: a run on the CPUs of a GPU machine leaves CUDA alone
    # (reading a GPU's state would start CUDA in it).
    if _using_cuda():
        state["cuda"] = [gpu.tolist() for gpu in torch.cuda.get_rng_state_all()]
    return state


def _using_cuda() -> bool:
    return torch.cuda.is_available() and bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def restore_rng(state: dict[str, Any]) -> None:
    python, numpy, generator, gpus = _rng_states(state)
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(generator)
    _restore_cuda(gpus)


def _restore_cuda(gpus: list[torch.Tensor] | None) -> None:
    """Sets each GPU's generator the checkpoint holds one for; a machine with another number of
    GPUs than the one that saved it resumes (the devices in common get theirs) with a warning:
    the others' random streams start afresh, so the run does not sample as an unbroken one."""
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus is None:
        if here and _using_cuda():
            log.warning(
                "the checkpoint holds no GPU random state (it was written on CPUs, or before "
                "GPU states were kept): the GPUs' random streams start afresh"
            )
        return
    if len(gpus) != here:
        log.warning(
            "the checkpoint holds the random state of %d GPU(s), this machine has %d: %s",
            len(gpus),
            here,
            "the GPUs' random streams start afresh"
            if not here or not gpus
            else f"the first {min(here, len(gpus))} get theirs, the others start afresh",
        )
    for index, gpu in enumerate(gpus[:here]):
        torch.cuda.set_rng_state(gpu, index)


def check_rng(state: Any) -> None:
    """Raises ValueError, saying what is wrong, when `state` is no RNG state `restore_rng`
    takes (tried on fresh generators: the process's own are left alone)."""
    python, numpy, generator, gpus = _rng_states(state)
    try:
        random.Random().setstate(python)
        np.random.RandomState().set_state(numpy)
        torch.Generator().set_state(generator)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"its random number generators' state cannot be restored: {error}"
        ) from error
    if gpus is not None and any(gpu.dim() != 1 or gpu.numel() == 0 for gpu in gpus):
        raise ValueError("its random number generators' state holds a malformed GPU state")


def rank_rng_file(folder: Path, rank: int) -> Path:
    return folder / RANK_RNG / f"rank-{rank}.json"


def check_rank_rngs(folder: Path) -> None:
    """Raises ValueError naming the file when a rank's random state in checkpoint `folder` is
    no state `restore_rng` takes (that rank found it only after the weights were loaded)."""
    for path in sorted((folder / RANK_RNG).glob("rank-*.json")):
        try:
            check_rng(json.loads(path.read_text()))
        except (OSError, ValueError) as error:
            raise ValueError(f"{RANK_RNG}/{path.name}: {error}") from error


def _rng_states(state: Any) -> tuple[Any, Any, torch.Tensor, list[torch.Tensor] | None]:
    missing = [
        key
        for key in ("python", "numpy", "torch")
        if not isinstance(state, dict) or key not in state
    ]
    if missing:
        raise ValueError(f"its random number generators' state lacks {', '.join(missing)}")
    try:
        python = state["python"]
        numpy = state["numpy"]
        cuda = state.get("cuda")
        if cuda is not None and not isinstance(cuda, list):
            raise TypeError(f"its GPU states are {type(cuda).__name__}, not a list")
        return (
            (python[0], tuple(python[1]), python[2]),
            (numpy[0], np.asarray(numpy[1], dtype=np.uint32), *numpy[2:]),
            torch.tensor(state["torch"], dtype=torch.uint8),
            None if cuda is None else [torch.tensor(gpu, dtype=torch.uint8) for gpu in cuda],
        )
    except (TypeError, ValueError, IndexError, KeyError, RuntimeError) as error:
        raise ValueError(f"its random number generators' state is malformed: {error!r}") from error


class CheckpointWriteError(ValueError):
    """A checkpoint's files could not be written (a full disk, a folder made read-only); the
    message names the checkpoint a resume goes on from. A ValueError, so that `reins train`
    says it in one line rather than a traceback."""


def _reason(error: BaseException) -> str:
    """A failed write's reason in one line: a sharded save's exception prints every rank's
    traceback; its ranks' own errors say it."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {failure[0]}" for rank, failure in error.failures.items())
    return str(error)


def save(run_dir: Path, backend: Backend, state: TrainerState, *, keep: int) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.next_step:06d}"
    staging = root / f".{final.name}{STAGING}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        backend.save_checkpoint(staging)
        (staging / "trainer.json").write_text(json.dumps(asdict(state), default=plain))
        # Without it a power loss after the rename could leave the name of a complete
        # checkpoint on files the disk never received.
        _sync_tree(staging)
    except (OSError, RuntimeError, CheckpointException) as error:
        # torch reports a full disk as a RuntimeError ("unexpected pos ...", "file write
        # failed"), a sharded save as a CheckpointException (a BaseException), which stopped
        # the run with a traceback and left the half-written folder holding the space a full
        # disk lacks.
        shutil.rmtree(staging, ignore_errors=True)
        previous = latest(run_dir)
        go_on = (
            f"`--resume` goes on from {previous.name}"
            if previous is not None
            else "the run has no checkpoint to resume from"
        )
        raise CheckpointWriteError(
            f"checkpoint {final.name} could not be written in {root} ({_reason(error)}); is the "
            f"disk full? Its partial files were deleted; {go_on}"
        ) from error
    if final.exists():
        _discard(final)
    staging.rename(final)
    _sync_folder(root)
    for old in saved(root)[:-keep]:
        _discard(old)
    return final


def saved(root: Path) -> list[Path]:
    """The checkpoints in `root`, oldest first: folders named `step-` and a step number, in the
    order of their numbers (a user's `step-1-copy` beside them is neither loaded nor pruned)."""
    found = [
        (int(path.name[len(PREFIX) :]), path)
        for path in root.glob(f"{PREFIX}*")
        if path.name[len(PREFIX) :].isascii() and path.name[len(PREFIX) :].isdigit()
    ]
    return [path for _, path in sorted(found)]


def latest(run_dir: Path) -> Path | None:
    found = saved(run_dir / "checkpoints")
    return found[-1] if found else None


def remove_partial(run_dir: Path) -> list[Path]:
    """Deletes staging folders a crash left mid-save, and checkpoints it left mid-delete;
    returns them."""
    root = run_dir / "checkpoints"
    partial = sorted([*root.glob(f".{PREFIX}*{STAGING}"), *root.glob(f".{PREFIX}*{TRASH}")])
    for folder in partial:
        shutil.rmtree(folder, ignore_errors=True)
    return partial


def _discard(folder: Path) -> None:
    """Deletes a checkpoint: out of sight (renamed) first, then its files."""
    trash = folder.with_name(f".{folder.name}{TRASH}")
    shutil.rmtree(trash, ignore_errors=True)
    folder.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def _sync_tree(folder: Path) -> None:
    """Flushes every file under `folder`, and the folders that name them, to the disk."""
    for parent, _, files in os.walk(folder):
        for name in files:
            descriptor = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        _sync_folder(Path(parent))


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_state(folder: Path) -> TrainerState:
    """The checkpoint's `trainer.json`; a ValueError or TypeError saying what is wrong with it
    (a count that is a string, say, failed later as a traceback, and a negative one resumed)."""
    data = json.loads((folder / "trainer.json").read_text())
    if not isinstance(data, dict):
        raise ValueError(f"trainer.json holds a {type(data).__name__}, not an object")
    state = TrainerState(**data)
    for name in ("next_step", "data_position", "weight_version"):
        _check_counts(name, [getattr(state, name)])
    for name in ("lineage", "pending"):
        values = getattr(state, name)
        if not isinstance(values, list):
            raise ValueError(f"trainer.json: {name} is {values!r}, not a list")
        _check_counts(name, values)
    for name in ("rng", "record", "stream", "setup"):
        value = getattr(state, name)
        if not isinstance(value, dict) and (value is not None or name == "rng"):
            raise ValueError(f"trainer.json: {name} is {value!r}, not an object")
    if not state.lineage:  # a checkpoint written before lineages were kept
        state.lineage = [state.weight_version]
    return state


def _check_counts(name: str, values: list[Any]) -> None:
    for value in values:
        if type(value) is not int or value < 0:
            raise ValueError(f"trainer.json: {name} holds {value!r}, not an integer >= 0")


def load(folder: Path, backend: Backend) -> TrainerState:
    backend.load_checkpoint(folder)
    return read_state(folder)


def plain(value: Any) -> Any:
    """`json.dumps`'s `default` for what a checkpoint holds: numpy's arrays and numbers."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.integer | np.floating):
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint")
