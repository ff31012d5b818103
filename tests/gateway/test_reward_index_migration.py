"""A database made before the reward events' index (`tables.REWARD_EVENTS`, 2026-12-07) gets it
when a gateway opens it, and a second start leaves it as it is."""

from __future__ import annotations

import sqlalchemy as sa

from reins.gateway.store import RolloutQuery
from reins.gateway.store.sql import SqlStore
from reins.schemas import AttemptCreate, EventIn, RolloutSpec


def _event_indexes(conn: sa.Connection) -> set[str]:
    return {str(index["name"]) for index in sa.inspect(conn).get_indexes("events")}


async def test_an_older_database_gets_the_reward_index(database_url: str) -> None:
    old = SqlStore(database_url)
    await old.init()
    for rid, value in (("low", 0.1), ("high", 0.9)):
        await old.create_rollouts([RolloutSpec(rollout_id=rid)])
        await old.open_attempt(rid, AttemptCreate())
        await old.append_events(rid, 1, [EventIn(type="reward", data={"value": value})])
    async with old.engine.begin() as conn:  # as an older reins made it
        await conn.execute(sa.text("DROP INDEX ix_events_reward"))
        assert "ix_events_reward" not in await conn.run_sync(_event_indexes)
    await old.close()
    for _ in range(2):
        store = SqlStore(database_url)
        await store.init()
        try:
            async with store.engine.connect() as conn:
                assert "ix_events_reward" in await conn.run_sync(_event_indexes)
            items, total = await store.query_rollouts(RolloutQuery(sort="reward"))
            assert ([r.rollout_id for r in items], total) == (["high", "low"], 2)
        finally:
            await store.close()
