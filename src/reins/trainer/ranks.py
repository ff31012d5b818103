"""`reins train` on several ranks (torchrun): rank 0 runs the job, the others follow its backend.

Only rank 0 runs the gateway, the engine, the controller and the training loop. Each backend call
it makes (a step, a checkpoint saved or loaded, the whole weights for the engine) is first
broadcast to the other ranks, which make the same call on their shard, so FSDP's collectives
meet. A rank that fails ends its process, and torchrun then stops the others.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from reins.engine.embedded import EmbeddedEngine
from reins.engine.weights import load_into
from reins.samples.batch import Batch
from reins.trainer.backend import StepStats
from reins.trainer.fsdp import FSDPBackend

T = TypeVar("T")


def start_process_group(timeout_s: float, *, cuda: bool) -> None:
    """Joins torchrun's process group (nccl when the ranks train on GPUs, gloo on CPUs, as
    `cuda` says: a GPU machine may train on its CPUs); alone, a group of one rank on 127.0.0.1.
    `timeout_s` bounds every collective, and so a follower's wait for the next step: it must
    outlast the longest rollout phase."""
    if dist.is_initialized():
        return
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        if os.environ.get("MASTER_ADDR", "127.0.0.1") in ("127.0.0.1", "localhost"):
            # One host: gloo on the loopback (its default, the host name's address, may not
            # be one it can bind); several hosts need their own interface.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout
    )


def exit_rank(code: int) -> NoReturn:
    """Ends a rank's process with `code` once its process group is destroyed, without the
    interpreter's finalization: the exit handlers run and the streams are flushed first.

    A gloo worker thread can still hold the last reference to a finished collective (and so to
    its tensors) when the main thread returns: FSDP's device mesh keeps the process group, and
    with it its threads, alive past `destroy_process_group`. Dropping those tensors takes the
    GIL, and a thread that asks for the GIL while the interpreter finalizes is ended inside a
    destructor: `terminate called without an active exception`, SIGABRT, and torchrun reports
    a finished run as failed (9 of 85 two-rank runs on 2 busy cores; pytorch/pytorch#179291)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class Leader:
    """Rank 0's side: every message it broadcasts, in the order the followers act on them.

    `start` (build your shard), then backend calls, then `release` (return, or fail when rank
    0's run failed). A call that fails on rank 0 may leave the others inside a collective: no
    `release` is sent then, rank 0's process fails and torchrun stops the rest.
    """

    def __init__(self) -> None:
        self.broken = False

    def tell(self, name: str, *args: Any) -> None:
        dist.broadcast_object_list([(name, args)], src=0)

    def call(self, name: str, method: Callable[..., T], *args: Any) -> T:
        self.tell(name, *args)
        try:
            return method(*args)
        except BaseException:
            self.broken = True
            raise

    def release(self, *, failed: bool = False) -> None:
        """Lets the followers return; `failed`: rank 0's run ended with an error (outside a
        backend call), and they end with one too rather than as if the run had finished."""
        if not self.broken:
            self.tell("release", failed)


class RankZeroFailed(RuntimeError):
    """Rank 0's run ended with an error: a follower ends with one too (rank 0's output says
    which). It said `done` before, as if the run had finished."""

    def __init__(self) -> None:
        super().__init__(
            "rank 0 stopped with an error (its output says which); this rank stops with it"
        )


class LeaderBackend:
    """Rank 0's backend: tells the followers each call, then makes it on its own shard."""

    def __init__(self, backend: FSDPBackend, leader: Leader) -> None:
        self.backend = backend
        self.leader = leader

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    def train_step(self, batch: Batch, version_lags: Mapping[int, int] | None = None) -> StepStats:
        return self.leader.call("train_step", self.backend.train_step, batch, version_lags)

    def save_checkpoint(self, folder: Path) -> None:
        self.leader.call("save_checkpoint", self.backend.save_checkpoint, folder)

    def load_checkpoint(self, folder: Path) -> None:
        self.leader.call("load_checkpoint", self.backend.load_checkpoint, folder)

    def save_weights(self, folder: Path) -> None:
        self.leader.call("save_weights", self.backend.save_weights, folder)

    def full_state_dict(self) -> dict[str, Any]:
        return self.leader.call("full_state_dict", self.backend.full_state_dict)


def follow(build: Callable[[], FSDPBackend]) -> int:
    """A follower's whole life: builds its shard when rank 0 starts, makes each call rank 0
    tells, returns when released. Returns the calls made; a `RankZeroFailed` when rank 0's run
    ended with an error."""
    backend: FSDPBackend | None = None
    calls = 0
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        name, args = box[0]
        if name == "release":
            if args and args[0]:
                raise RankZeroFailed()
            return calls
        if name == "start":
            backend = build()
            continue
        if backend is None:
            raise RuntimeError(f"rank 0 asked for {name} before it started the backend")
        getattr(backend, name)(*args)
        calls += 1


class GatheringPublisher:
    """The embedded engine on rank 0 holds its own whole copy of the weights (the trainer's are
    sharded): after each update every rank gathers the new weights to rank 0, which loads them
    into the engine between two decode steps. Generation goes on during the optimizer step."""

    def __init__(self, engine: EmbeddedEngine, backend: LeaderBackend) -> None:
        self.engine = engine
        self.backend = backend

    @property
    def version(self) -> int:
        return self.engine.weight_version

    def update(
        self, apply: Callable[[], T], changed: Callable[[T], bool] | None = None
    ) -> tuple[T, float]:
        result = apply()
        started = time.perf_counter()
        if changed is not None and not changed(result):
            return result, 0.0
        state = self.backend.full_state_dict()
        with self.engine.updating_weights():
            load_into(self.engine.model, state)
        return result, time.perf_counter() - started
