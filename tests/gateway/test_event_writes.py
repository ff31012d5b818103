"""Where SQLite's group commits run: a lone small commit on the event loop's thread (no hand-over
to the writer thread and back), commits with posts queued behind them in the writer thread.
Either way every event is stored once and its post answered with its own seq."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from reins.gateway.store import Conflict
from reins.gateway.store.sql import SqlStore
from reins.schemas import AttemptCreate, EventIn, RolloutSpec
from tests.support import PostgresServer


@pytest.fixture
async def store(tmp_path: Any) -> AsyncIterator[SqlStore]:
    sql_store = SqlStore(f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}")
    await sql_store.init()
    await sql_store.create_rollouts([RolloutSpec(rollout_id="r")])
    await sql_store.open_attempt("r", AttemptCreate())
    yield sql_store
    await sql_store.close()


def _threads_of_commits(store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    names: list[str] = []
    write = store._write_events

    def spied(*args: Any) -> Any:
        names.append(threading.current_thread().name)
        return write(*args)

    monkeypatch.setattr(store, "_write_events", spied)
    return names


async def test_a_lone_post_commits_on_the_event_loop_thread(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = _threads_of_commits(store, monkeypatch)
    for index in range(3):
        await store.append_events("r", 1, [EventIn(type="log", data={"i": index})])
    assert threads == [threading.current_thread().name] * 3
    stored = await store.get_events("r", attempt_id=1)
    assert [event.data for event in stored] == [{"i": 0}, {"i": 1}, {"i": 2}]


async def test_posts_queued_together_commit_in_the_writer_thread(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = _threads_of_commits(store, monkeypatch)
    posts = [
        store.append_events("r", 1, [EventIn(type="log", data={"i": i}, idempotency_key=f"k{i}")])
        for i in range(40)
    ]
    acks = await asyncio.gather(*posts)
    # All 40 were queued before the first commit: one group commit, off the loop's thread.
    assert len(threads) == 1
    assert threads[0].startswith("reins-events")
    assert sorted(ack[0].seq for ack in acks) == sorted({ack[0].seq for ack in acks})
    stored = await store.get_events("r", attempt_id=1)
    assert sorted(event.data["i"] for event in stored) == list(range(40))
    assert {ack[0].idempotency_key: ack[0].seq for ack in acks} == {
        event.idempotency_key: event.seq for event in stored
    }


async def test_a_large_lone_post_commits_in_the_writer_thread(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = _threads_of_commits(store, monkeypatch)
    await store.append_events("r", 1, [EventIn(type="log", data={"text": "x" * 100_000})])
    await store.append_events("r", 1, [EventIn(type="log", data={}) for _ in range(5)])
    assert len(threads) == 2
    assert all(name.startswith("reins-events") for name in threads)


async def test_the_event_connection_keeps_statement_journals_in_memory(store: SqlStore) -> None:
    """SQLite's default puts each commit's statement journal in a temp file (created, written,
    unlinked: ~9 system calls a commit); the event connection keeps it in memory (2)."""
    assert store._event_engine is not None
    with store._event_engine.connect() as conn:
        (temp_store,) = conn.exec_driver_sql("PRAGMA temp_store").one()
    assert temp_store == 2


@contextlib.asynccontextmanager
async def two_gateways_on(postgres: PostgresServer) -> AsyncIterator[tuple[SqlStore, SqlStore]]:
    """Two gateways' stores on one fresh PostgreSQL database, rollout `r`'s attempt 1 open."""
    url = postgres.create_database(f"t_{uuid.uuid4().hex[:16]}")
    first, second = SqlStore(url), SqlStore(url)
    for replica in (first, second):
        await replica.init()
    try:
        await first.create_rollouts([RolloutSpec(rollout_id="r")])
        await first.open_attempt("r", AttemptCreate())
        yield first, second
    finally:
        for replica in (first, second):
            await replica.close()


@pytest.mark.slow
async def test_on_postgresql_a_rollouts_events_commit_in_the_order_of_their_seqs(
    postgres: PostgresServer,
) -> None:
    """Two gateways on one PostgreSQL database: while one's commit of a rollout's event is
    open, the other's commit of the same rollout waits for it. Otherwise the later seq could
    commit first, and a reader paging with `after` skipped the earlier one for good (two
    gateways, 8 harnesses: 150 of 14,926 events)."""
    async with two_gateways_on(postgres) as (first, second):
        rows = first._rows_of("r", 1, [EventIn(type="early")])
        async with first.engine.begin() as conn:
            # The first gateway's group commit, inserted (its seq drawn) and not yet committed.
            await conn.run_sync(first._pack_and_insert, rows, set(), set(), [rows])
            late = asyncio.create_task(second.append_events("r", 1, [EventIn(type="late")]))
            await asyncio.sleep(1.0)
            read_meanwhile = [event.type for event in await second.get_events("r")]
            assert not late.done()
        (acked,) = await late
        stored = await second.get_events("r")
        assert read_meanwhile == []
        assert [event.type for event in stored] == ["early", "late"]
        assert stored[1].seq == acked.seq > stored[0].seq


@pytest.mark.slow
async def test_on_postgresql_a_list_reusing_a_key_another_gateway_is_committing_stores_nothing(
    postgres: PostgresServer,
) -> None:
    """The list post's check of its keys waits for the other gateway's commit of the rollout:
    run before it, the check missed the key being committed, and the post was answered 409
    with its new event stored."""
    async with two_gateways_on(postgres) as (first, second):
        rows = first._rows_of("r", 1, [EventIn(type="a", data={"v": 1}, idempotency_key="k")])
        reused = [
            EventIn(type="b", idempotency_key="new"),
            EventIn(type="a", data={"v": 2}, idempotency_key="k"),
        ]
        async with first.engine.begin() as conn:
            await conn.run_sync(first._pack_and_insert, rows, set(), set(), [rows])
            post = asyncio.create_task(second.append_events("r", 1, reused))
            await asyncio.sleep(1.0)
        with pytest.raises(Conflict, match="nothing of this post was stored"):
            await post
        stored = await second.get_events("r")
        assert [(event.idempotency_key, event.data) for event in stored] == [("k", {"v": 1})]
