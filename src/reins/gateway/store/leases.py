"""Leases: one holder at a time of a named role among the clients of one gateway database.

The rollout controller takes the `controller` lease: two controllers following one gateway
would both launch every rollout (opening an attempt is idempotent, so neither would notice). A
lease is held for `ttl_s` and renewed by its holder; a holder that stops renewing (killed) loses
it when that time is up, and a holder that leaves releases it at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from reins.gateway.store.tables import leases, names_no_row, text_value
from reins.schemas import Lease


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

    async def claim(self, name: str, holder: str, ttl_s: float) -> Lease:
        """Takes or renews lease `name` for `ttl_s` unless another holder's has not expired;
        the lease as it now stands."""
        text_value(holder, ("body", "holder"), f"lease {name}")  # no NUL: both stores alike
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
                "since": sa.case((leases.c.holder == new.holder, leases.c.since), else_=new.since),
            },
            where=sa.or_(leases.c.holder == new.holder, leases.c.expires_at < now),
        )
        async with self._write() as conn:
            await conn.execute(statement)
            row = (await conn.execute(sa.select(leases).where(leases.c.name == name))).one()
        return Lease(
            name=name, holder=row.holder, since=row.since, expires_at=row.expires_at,
            granted=row.holder == holder,
        )  # fmt: skip

    async def release(self, name: str, holder: str) -> bool:
        """Gives lease `name` up if `holder` holds it; whether it did."""
        if names_no_row(holder):
            return False
        async with self._write() as conn:
            done = await conn.execute(
                sa.delete(leases).where(leases.c.name == name, leases.c.holder == holder)
            )
        return bool(done.rowcount)
