"""Leases: one holder at a time of a named role among the clients of one gateway database.

The rollout controller takes the `controller` lease: two controllers following one gateway
would both launch every rollout (opening an attempt is idempotent, so neither would notice). A
lease is held for `ttl_s` and renewed by its holder; a holder that stops renewing (killed) loses
it when that time is up, and a holder that leaves releases it at once.

A lease is a fencing token too. A granted claim carries `token`, which names this holder's
tenure (its `since`: a new one each time the lease changes hands); the holder's writes made
through `holding` are refused (409) unless it still holds the lease under that token and the
lease has not expired. So a holder that paused past its lease (a stopped process, a long
collection, a write retried through a gateway outage) cannot act beside the holder that took
over: its late writes are refused, not stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from reins.gateway.store import Conflict
from reins.gateway.store.tables import leases, names_no_row, text_value
from reins.schemas import LEASE_NOT_HELD, Lease

NOT_HELD = LEASE_NOT_HELD


def token_of(since: float) -> str:
    """A tenure's token: its `since`, written exactly (as a hexadecimal float)."""
    return since.hex()


class _Gate:
    """Writes under a lease share it; a claim (which may change the lease's hands) has it
    alone. So no write checked under the old holder's token is still being stored when the
    lease changes hands (in this gateway process; another process sharing the database is held
    off by the check that the lease has not expired)."""

    def __init__(self) -> None:
        self._writes = 0
        self._claiming = False
        self._turn = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        async with self._turn:
            await self._turn.wait_for(lambda: not self._claiming)
            self._writes += 1
        try:
            yield
        finally:
            async with self._turn:
                self._writes -= 1
                self._turn.notify_all()

    @contextlib.asynccontextmanager
    async def claim(self) -> AsyncIterator[None]:
        async with self._turn:
            await self._turn.wait_for(lambda: not self._claiming)
            self._claiming = True  # first: a stream of writes cannot keep a claim waiting
            await self._turn.wait_for(lambda: self._writes == 0)
        try:
            yield
        finally:
            async with self._turn:
                self._claiming = False
                self._turn.notify_all()


class Leases:
    def __init__(
        self,
        engine: AsyncEngine,
        insert: Callable[..., Any],
        write: Callable[[], AbstractAsyncContextManager[AsyncConnection]],
    ) -> None:
        self.engine = engine
        self._insert = insert
        self._write = write
        self._gate = _Gate()

    async def claim(self, name: str, holder: str, ttl_s: float) -> Lease:
        """Takes or renews lease `name` for `ttl_s` unless another holder's has not expired;
        the lease as it now stands."""
        text_value(holder, ("body", "holder"), f"lease {name}")  # no NUL: both stores alike
        async with self._gate.claim():
            now = time.time()
            statement = self._insert(leases).values(
                name=name, holder=holder, since=now, expires_at=now + ttl_s
            )
            new = statement.excluded
            statement = statement.on_conflict_do_update(
                index_elements=["name"],
                set_={
                    "holder": new.holder,
                    "expires_at": new.expires_at,
                    "since": sa.case(
                        (leases.c.holder == new.holder, leases.c.since), else_=new.since
                    ),
                },
                where=sa.or_(leases.c.holder == new.holder, leases.c.expires_at < now),
            )
            async with self._write() as conn:
                await conn.execute(statement)
                row = (await conn.execute(sa.select(leases).where(leases.c.name == name))).one()
        granted = row.holder == holder
        return Lease(
            name=name, holder=row.holder, since=row.since, expires_at=row.expires_at,
            granted=granted, token=token_of(row.since) if granted else None,
        )  # fmt: skip

    async def release(self, name: str, holder: str, token: str | None = None) -> bool:
        """Gives lease `name` up if `holder` holds it (under `token`, when given: a holder
        whose lease lapsed and was taken again since does not give up the new tenure);
        whether it did."""
        since = _since(token) if token is not None else None
        if names_no_row(holder) or (token is not None and since is None):
            return False
        held = sa.and_(leases.c.name == name, leases.c.holder == holder)
        if since is not None:
            held = sa.and_(held, leases.c.since == since)
        async with self._write() as conn:
            done = await conn.execute(sa.delete(leases).where(held))
        return bool(done.rowcount)

    @contextlib.asynccontextmanager
    async def holding(self, name: str, holder: str, token: str) -> AsyncIterator[None]:
        """Around a write that `holder` makes under lease `name`: raises `Conflict` (409,
        beginning with `NOT_HELD`) unless it holds the lease under `token` and the lease has
        not expired; no claim changes the lease's hands until the write is done."""
        async with self._gate.write():
            since = _since(token)
            async with self.engine.connect() as conn:
                statement = sa.select(leases).where(leases.c.name == name)
                row = (await conn.execute(statement)).first()
            now = time.time()
            if row is None:
                raise Conflict(
                    f"{NOT_HELD}nobody holds the {name} lease (released, or the gateway's "
                    f"database changed): {holder}'s write under it is refused"
                )
            if row.holder != holder or since is None or row.since != since:
                raise Conflict(
                    f"{NOT_HELD}the {name} lease is {row.holder}'s since {_when(row.since)}: "
                    f"this write of {holder}, under a grant it no longer holds, is refused"
                )
            if row.expires_at <= now:
                raise Conflict(
                    f"{NOT_HELD}{holder}'s {name} lease expired at {_when(row.expires_at)} "
                    "(not renewed in time): its write is refused until it renews the lease"
                )
            yield


def _since(token: str) -> float | None:
    try:
        return float.fromhex(token)
    except (ValueError, OverflowError):
        return None


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))
