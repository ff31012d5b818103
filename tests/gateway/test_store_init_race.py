"""Gateway replicas started together on one fresh database (two pods of one deployment): each
one's `SqlStore.init` creates the tables if they are missing. On PostgreSQL two concurrent
creations raced in the system catalog and one gateway died at its start (a unique violation
on `pg_type`); SQLite's write lock already serialised them. Real databases: a SQLite file and
a fresh database on a real PostgreSQL server."""

from __future__ import annotations

import asyncio

from reins.gateway.store.sql import SqlStore
from reins.schemas import RolloutSpec


async def test_stores_initialised_together_on_a_fresh_database_all_start(
    database_url: str,
) -> None:
    stores = [SqlStore(database_url) for _ in range(4)]
    try:
        await asyncio.gather(*(store.init() for store in stores))
        await stores[0].create_rollouts([RolloutSpec(rollout_id="r")])
        ids = {store.database_id for store in stores}
        assert len(ids) == 1 and None not in ids  # one database, made once
        assert (await stores[3].get_rollout("r")).rollout.rollout_id == "r"
    finally:
        for store in stores:
            await store.close()
