"""The dashboard's rollout list sorted by reward and by duration, on SQLite and PostgreSQL: the
same order on both (ties by creation, newest first, then id), pages that add up to the whole
list, and a plan that reads every rollout's key by joins or index seeks, not by a scan a rollout
(`reads.DashboardReads._sort_key`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from reins.gateway.store import RolloutQuery
from reins.gateway.store.sql import SqlStore
from reins.gateway.store.tables import attempts, rollouts
from reins.schemas import AttemptCreate, EventIn, RolloutSpec, RolloutStatus, RolloutUpdate
from tests.monitor.factory import chat_call


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[SqlStore]:
    store = SqlStore(database_url)
    await store.init()
    yield store
    await store.close()


def reward(value: Any) -> EventIn:
    return EventIn(type="reward", data={"value": value})


def call(text: str) -> EventIn:
    return EventIn(**chat_call([{"role": "user", "content": text}], "ok"))


async def created(store: SqlStore, rid: str, at: float) -> None:
    async with store.engine.begin() as conn:
        await conn.execute(
            sa.update(rollouts).where(rollouts.c.rollout_id == rid).values(created_at=at)
        )


async def all_pages(store: SqlStore, query: RolloutQuery, size: int) -> list[str]:
    """Every page of `size` in turn; each answer's total is the whole list's."""
    ids: list[str] = []
    whole, total = await store.query_rollouts(dataclasses.replace(query, limit=100))
    for offset in range(0, total + size, size):
        page = dataclasses.replace(query, offset=offset, limit=size)
        items, page_total = await store.query_rollouts(page)
        assert page_total == total
        ids += [r.rollout_id for r in items]
    assert ids == [r.rollout_id for r in whole]
    return ids


async def test_sort_by_reward_reads_the_latest_attempts_last_reward_and_pages_stably(
    store: SqlStore,
) -> None:
    plan: dict[str, tuple[list[list[EventIn]], float]] = {
        "a": ([[reward(0.5), call("a"), reward(0.9)]], 10),  # the last reward counts: 0.9
        "b": ([[reward(1.0)], [call("b")]], 20),  # the latest attempt has none: none
        "c": ([[reward(0.1)], [reward(0.7)]], 30),  # the latest attempt's: 0.7
        "d": ([[reward(0.7)]], 30),  # ties c (created with it: by id)
        "g": ([[reward(0.7)]], 40),  # ties c and d, created later: before them
        "e": ([[reward("high")]], 20),  # not a number: none (ties b: by id)
        "f": ([], 50),  # no attempt: none
        "h": ([[reward(-2)]], 5),
        "i": ([[call("i"), reward(1)]], 5),  # an integer among floats
    }
    for rid, (tries, at) in plan.items():
        await store.create_rollouts([RolloutSpec(rollout_id=rid, metadata={"run": "x"})])
        for attempt_id, posted in enumerate(tries, start=1):
            await store.open_attempt(rid, AttemptCreate())
            await store.append_events(rid, attempt_id, posted)
        await created(store, rid, at)
    down = await all_pages(store, RolloutQuery(sort="reward"), size=2)
    assert down == ["i", "a", "g", "c", "d", "h", "f", "b", "e"]
    up = await all_pages(store, RolloutQuery(sort="reward", descending=False), size=3)
    assert up == ["h", "g", "c", "d", "a", "i", "f", "b", "e"]
    assert await all_pages(store, RolloutQuery(sort="reward", search="a"), size=1) == ["a"]
    ran = await all_pages(store, RolloutQuery(sort="reward", run="x"), size=4)
    assert ran == down


async def test_sort_by_duration_reads_the_first_and_latest_attempts_and_pages_stably(
    store: SqlStore,
) -> None:
    now = time.time()
    # rollout: (attempts' (started, ended) from now, created_at); the first attempt's start
    # and the latest one's end make the duration.
    plan: dict[str, tuple[list[tuple[float, float | None]], float]] = {
        "a": ([(-1000, -400)], 10),  # 600 s
        "b": ([(-1000, -900), (-800, -100)], 10),  # two attempts: 900 s
        "c": ([(-500, -400)], 30),  # 100 s, ties d: created later, first
        "d": ([(-300, -200)], 30),  # 100 s, ties c: by id
        "e": ([(-700, None)], 20),  # running: 700 s so far
        "f": ([], 40),  # no attempt: no duration
        "g": ([(-900, -800), (-500, None)], 20),  # failed, its latest attempt never ended
    }
    for rid, (tries, at) in plan.items():
        await store.create_rollouts([RolloutSpec(rollout_id=rid)])
        for attempt_id, (started, ended) in enumerate(tries, start=1):
            await store.open_attempt(rid, AttemptCreate())
            where = (attempts.c.rollout_id == rid, attempts.c.attempt_id == attempt_id)
            times = {
                "created_at": now + started,
                "ended_at": None if ended is None else now + ended,
            }
            async with store.engine.begin() as conn:
                await conn.execute(sa.update(attempts).where(*where).values(**times))
        if rid in ("a", "b", "c", "d"):
            done = RolloutStatus(state="succeeded")
            await store.update_rollout(rid, RolloutUpdate(status=done))
            async with store.engine.begin() as conn:  # the update ended it now: set it back
                latest = (attempts.c.rollout_id == rid, attempts.c.attempt_id == len(tries))
                ended = tries[-1][1]
                assert ended is not None
                await conn.execute(sa.update(attempts).where(*latest).values(ended_at=now + ended))
        if rid == "g":
            failed = RolloutStatus(state="failed", reason="gone")
            await store.update_rollout(rid, RolloutUpdate(status=failed))
            async with store.engine.begin() as conn:
                latest = (attempts.c.rollout_id == rid, attempts.c.attempt_id == 2)
                await conn.execute(sa.update(attempts).where(*latest).values(ended_at=None))
        await created(store, rid, at)
    down = await all_pages(store, RolloutQuery(sort="duration"), size=2)
    assert down == ["b", "e", "a", "c", "d", "f", "g"]
    up = await all_pages(store, RolloutQuery(sort="duration", descending=False), size=3)
    assert up == ["c", "d", "a", "e", "b", "f", "g"]


async def _plan(store: SqlStore, query: RolloutQuery) -> str:
    """The database's plan of the page statement `query_rollouts` runs for `query`."""
    statements: list[Any] = []

    def keep(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: Any) -> None:
        statements.append(context.compiled.statement)

    sa.event.listen(store.engine.sync_engine, "before_cursor_execute", keep)
    try:
        await store.query_rollouts(query)
    finally:
        sa.event.remove(store.engine.sync_engine, "before_cursor_execute", keep)
    page = statements[-1].compile(store.engine.sync_engine, compile_kwargs={"literal_binds": True})
    explain = "EXPLAIN QUERY PLAN " if store.is_sqlite else "EXPLAIN "
    async with store.engine.connect() as conn:
        rows = await conn.execute(sa.text(explain + str(page)))
        return "\n".join(str(list(row)) for row in rows)


async def test_the_sorted_pages_read_each_key_by_a_join_or_an_index_seek(store: SqlStore) -> None:
    """On PostgreSQL a subquery a rollout (a `SubPlan`) cost 12,000 index scans at 12,000
    rollouts, and its cost set its JIT compiling (~0.2 s a page); on SQLite the sort by reward
    reads the reward events' index, not every event of each rollout's attempt."""
    for n in range(3):
        rid = f"r{n}"
        await store.create_rollouts([RolloutSpec(rollout_id=rid)])
        await store.open_attempt(rid, AttemptCreate())
        await store.append_events(rid, 1, [call(rid), reward(n / 2)])
    for query in (
        RolloutQuery(sort="reward"),
        RolloutQuery(sort="reward", descending=False, run="x"),
        RolloutQuery(sort="duration"),
    ):
        plan = await _plan(store, query)
        if store.is_sqlite:
            if query.sort == "reward":
                assert "ix_events_reward" in plan, plan
        else:
            assert "SubPlan" not in plan, plan
