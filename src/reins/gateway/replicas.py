"""Several gateway processes on one database act as one gateway (paper section 3.1 at scale).

The admission gate and the model directory live in each process; this keeps them alike across
every process sharing the database (`store.board`):

- A pause at any replica is written to the database, applied to its own gate at once, and to
  each other replica's gate at its next sync (every `sync_interval_s`). Each replica reports the
  last pause it applied and its calls in flight. The pause returns once every live replica
  applied it; a drain returns once none of them has a call in flight, so no call admitted
  anywhere before the pause runs during the update.
- A resume reopens every gate the same way.
- Registering or deleting models bumps a counter; a replica that sees it change drops its
  cached directory before it applies a resume read in the same sync, so calls released by the
  resume see the newly registered weight version.

- Each replica counts the others before it reports and tells its store (`Store.set_peers`): a
  SQLite gateway alone answers a call from its journal before the call's commit, which a
  gateway that may close the attempt could not see. A replica that joins while another holds
  the journal (`Store.needs_peers_known`) serves only once each live one reported a heartbeat
  `heartbeat_s` after it joined: that report came after a count that saw it. (A killed
  gateway's row stays live for `replica_timeout_s`, but its journal lock went with it: its
  restart does not wait for it.)

A replica is live while its heartbeat (every `heartbeat_s`) is younger than `replica_timeout_s`:
a killed replica stops holding drains after that long. Replicas compare heartbeats by their own
clocks, so those of different hosts must agree within a second or so (NTP).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from reins.gateway.admission import AdmissionGate, GateStatus
from reins.gateway.store.board import ReplicaBoard, ReplicaReport, SharedState

log = logging.getLogger(__name__)


@dataclass
class ReplicaTimings:
    sync_interval_s: float = 0.1
    """How often a replica reads the shared state while others are live."""
    idle_interval_s: float = 1.0
    """How often a replica alone on its database looks for others."""
    heartbeat_s: float = 1.0
    replica_timeout_s: float = 10.0
    pause_wait_s: float = 20.0
    """The longest a pause waits for the other live replicas to apply it, whatever
    `replica_timeout_s`: its answer must come within the clients' 30 s (`GatewayClient`). A
    drain, which follows the pause, waits for the rest (`_unsettled`)."""


class Replicas:
    def __init__(
        self,
        board: ReplicaBoard,
        gate: AdmissionGate,
        on_directory_change: Callable[[], None],
        timings: ReplicaTimings | None = None,
        *,
        address: str = "",
        on_peers: Callable[[int], Awaitable[None]] | None = None,
        known_before_serving: bool = False,
    ) -> None:
        self.board = board
        self.gate = gate
        self.on_directory_change = on_directory_change
        self.on_peers = on_peers
        self.known_before_serving = known_before_serving
        self.timings = timings or ReplicaTimings()
        self.replica_id = uuid.uuid4().hex
        self.address = address or f"{socket.gethostname()} pid {os.getpid()}"
        self.started_at = time.time()
        self._epoch = 0
        self._directory = -1
        self._others = 0
        self._reported: tuple[int, bool, int, int] | None = None
        self._reported_at = 0.0
        self._counted_at = 0.0
        # One sync at a time, and none between a pause's write and its local application: a
        # sync that read the state before the pause would otherwise reopen the gate.
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Joins (applying the shared state before this replica serves a call) and syncs on."""
        await self.board.join()
        await self.sync()
        if self.known_before_serving and self._others:
            await self._wait_until_known()
        if self.gate.status().paused:
            log.warning(
                "the gateway starts paused: a trainer paused calls for a weight update and has "
                "not resumed them (a new trainer does; or POST /api/admission/resume)"
            )
        self._task = asyncio.create_task(self._run(), name="reins-replica-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.board.leave(self.replica_id)

    async def pause(self) -> GateStatus:
        """Returns once every live replica holds new calls (a silent one stops counting as live
        after `replica_timeout_s`), or after `pause_wait_s`: a silent replica could otherwise
        keep the answer past the client's timeout, and a retried pause would wait again."""
        async with self._lock:
            self._apply(await self.board.set_paused(True))
            await self._report(force=True)
        timings = self.timings
        deadline = time.monotonic() + min(timings.replica_timeout_s + 1, timings.pause_wait_s)
        # Polled: the other replicas answer through the database, not through this process.
        while waiting := await self._unsettled(in_flight=False):
            if time.monotonic() >= deadline:
                log.warning("pause answered before gateway replicas %s applied it", waiting)
                break
            await asyncio.sleep(timings.sync_interval_s)
        return self.gate.status()

    async def resume(self) -> GateStatus:
        async with self._lock:
            self._apply(await self.board.set_paused(False))
            await self._report(force=True)
        return self.gate.status()

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Waits until this replica and every other live one applied the current pause and have
        nothing in flight; False if `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not await self.gate.drain(timeout_s):
            return False
        while True:
            waiting = await self._unsettled()
            if not waiting:
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                log.warning("drain timed out waiting for gateway replicas %s", waiting)
                return False
            await asyncio.sleep(min(self.timings.sync_interval_s, remaining or 1e9))

    async def models_changed(self) -> None:
        """Called after this replica registered or deleted models."""
        async with self._lock:
            self._apply(await self.board.directory_changed())

    async def replicas(self) -> list[dict[str, object]]:
        """Every live replica's last report, this one first."""
        now = time.time()
        live = [
            r
            for r in await self.board.replicas()
            if now - r.heartbeat_at <= self.timings.replica_timeout_s
        ]
        live.sort(key=lambda r: r.replica_id != self.replica_id)
        return [{**asdict(r), "this": r.replica_id == self.replica_id} for r in live]

    async def sync(self) -> None:
        async with self._lock:
            self._apply(await self.board.shared())
            await self._report()

    async def _run(self) -> None:
        while True:
            interval = (
                self.timings.sync_interval_s if self._others else self.timings.idle_interval_s
            )
            await asyncio.sleep(interval)
            try:
                await self.sync()
            except Exception as error:  # the database may be restarting: try again next time
                log.warning("gateway replica sync failed: %r", error)

    def _apply(self, shared: SharedState) -> None:
        if shared.directory != self._directory:
            self._directory = shared.directory
            self.on_directory_change()
        self._epoch = shared.epoch
        if shared.paused:
            self.gate.pause()
        else:
            self.gate.resume()

    async def _report(self, *, force: bool = False) -> None:
        status = self.gate.status()
        state = (self._epoch, status.paused, status.in_flight, status.held)
        now = time.time()
        if (
            not force
            and state == self._reported
            and now - self._reported_at < (self.timings.heartbeat_s)
        ):
            return
        if now - self._counted_at >= self.timings.heartbeat_s:
            # Before the report, and timed by it: every heartbeat then follows a count begun
            # less than `heartbeat_s` before it (`_wait_until_known`).
            await self._count_others(now)
        await self.board.report(
            ReplicaReport(
                replica_id=self.replica_id,
                address=self.address,
                seen_epoch=self._epoch,
                paused=status.paused,
                in_flight=status.in_flight,
                held=status.held,
                started_at=self.started_at,
                heartbeat_at=now,
            )
        )
        self._reported, self._reported_at = state, now

    async def _count_others(self, now: float) -> None:
        # Live as of this replica's last heartbeat, not as of now: while the database takes no
        # writes (locked, restarting) no replica heartbeats, and the others must not look gone.
        seen_at = self._reported_at or now
        others = sum(
            1
            for r in await self.board.replicas()
            if r.replica_id != self.replica_id
            and seen_at - r.heartbeat_at <= self.timings.replica_timeout_s
        )
        if self.on_peers is not None:
            await self.on_peers(others)  # may fail (the store cannot settle): counted again
        self._others, self._counted_at = others, now

    async def _wait_until_known(self) -> None:
        """Waits until each other live replica knows this one: its heartbeat came at least
        `heartbeat_s` after this one's first report, so its count before it saw this one."""
        joined = time.time()
        deadline = joined + self.timings.replica_timeout_s + 2 * self.timings.heartbeat_s
        while True:
            now = time.time()
            unaware = [
                r.address
                for r in await self.board.replicas()
                if r.replica_id != self.replica_id
                and now - r.heartbeat_at <= self.timings.replica_timeout_s
                and r.heartbeat_at < joined + self.timings.heartbeat_s
            ]
            if not unaware:
                return
            if now > deadline:
                log.warning("gateway replicas %s did not see this one join: serving", unaware)
                return
            await asyncio.sleep(self.timings.sync_interval_s)

    async def _unsettled(self, *, in_flight: bool = True) -> list[str]:
        """Other live replicas that have not applied the current pause, or (`in_flight`) still
        have calls running."""
        shared = await self.board.shared()
        now = time.time()
        return [
            r.address
            for r in await self.board.replicas()
            if r.replica_id != self.replica_id
            and now - r.heartbeat_at <= self.timings.replica_timeout_s
            and (r.seen_epoch < shared.epoch or (in_flight and r.in_flight > 0))
        ]
