"""What the gateway processes sharing one database tell each other (`reins.gateway.replicas`).

Three counter rows hold the shared state: whether the admission gate is paused, how many pauses
there were (the epoch a replica acknowledges), and how many times the model directory changed.
Each replica reports itself in `gateway_replicas`: the last epoch it acknowledged, its calls in
flight and held, and a heartbeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from reins.gateway.store.tables import counters, gateway_replicas

PAUSED = "admission_paused"
EPOCH = "admission_epoch"
DIRECTORY = "directory_version"
_NAMES = (PAUSED, EPOCH, DIRECTORY)
_FORGET_AFTER_S = 3600.0
"""Rows of replicas silent this long are removed when another one joins."""


@dataclass(frozen=True)
class SharedState:
    paused: bool
    epoch: int
    """Pauses so far, across every replica."""
    directory: int
    """Changes to the registered models so far."""


@dataclass(frozen=True)
class ReplicaReport:
    replica_id: str
    address: str
    seen_epoch: int
    """The last pause this replica applied to its own gate."""
    paused: bool
    in_flight: int
    held: int
    started_at: float
    heartbeat_at: float


class ReplicaBoard:
    def __init__(
        self,
        engine: AsyncEngine,
        insert: Callable[..., Any],
        write: Callable[[], AbstractAsyncContextManager[AsyncConnection]],
    ) -> None:
        self.engine = engine
        self._insert = insert
        self._write = write

    async def init(self, conn: AsyncConnection) -> None:
        """Creates the counter rows (in the store's `init` transaction)."""
        for name in _NAMES:
            await conn.execute(
                self._insert(counters)
                .values(name=name, value=0)
                .on_conflict_do_nothing(index_elements=["name"])
            )

    async def shared(self) -> SharedState:
        async with self.engine.connect() as conn:
            return await self._read(conn)

    async def set_paused(self, paused: bool) -> SharedState:
        """Pauses (a new epoch if it was open) or resumes every replica's gate."""
        async with self._write() as conn:
            flipped = await conn.scalar(
                sa.update(counters)
                .where(counters.c.name == PAUSED, counters.c.value == (0 if paused else 1))
                .values(value=1 if paused else 0)
                .returning(counters.c.value)
            )
            if flipped is not None and paused:
                await conn.execute(
                    sa.update(counters)
                    .where(counters.c.name == EPOCH)
                    .values(value=counters.c.value + 1)
                )
            return await self._read(conn)

    async def directory_changed(self) -> SharedState:
        async with self._write() as conn:
            await conn.execute(
                sa.update(counters)
                .where(counters.c.name == DIRECTORY)
                .values(value=counters.c.value + 1)
            )
            return await self._read(conn)

    async def report(self, report: ReplicaReport) -> None:
        values = {
            "address": report.address,
            "seen_epoch": report.seen_epoch,
            "paused": report.paused,
            "in_flight": report.in_flight,
            "held": report.held,
            "heartbeat_at": report.heartbeat_at,
        }
        statement = self._insert(gateway_replicas).values(
            replica_id=report.replica_id, started_at=report.started_at, **values
        )
        async with self._write() as conn:
            await conn.execute(
                statement.on_conflict_do_update(index_elements=["replica_id"], set_=values)
            )

    async def replicas(self) -> list[ReplicaReport]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                sa.select(gateway_replicas).order_by(gateway_replicas.c.started_at)
            )
            return [ReplicaReport(**row._mapping) for row in rows]

    async def join(self) -> None:
        """Forgets replicas silent for an hour (killed ones never leave)."""
        async with self._write() as conn:
            await conn.execute(
                sa.delete(gateway_replicas).where(
                    gateway_replicas.c.heartbeat_at < time.time() - _FORGET_AFTER_S
                )
            )

    async def leave(self, replica_id: str) -> None:
        async with self._write() as conn:
            await conn.execute(
                sa.delete(gateway_replicas).where(gateway_replicas.c.replica_id == replica_id)
            )

    async def _read(self, conn: AsyncConnection) -> SharedState:
        rows = await conn.execute(
            sa.select(counters.c.name, counters.c.value).where(counters.c.name.in_(_NAMES))
        )
        values = {name: value for name, value in rows}
        if len(values) != len(_NAMES):
            raise RuntimeError("the store is not initialized: call init() first")
        return SharedState(
            paused=bool(values[PAUSED]), epoch=values[EPOCH], directory=values[DIRECTORY]
        )
