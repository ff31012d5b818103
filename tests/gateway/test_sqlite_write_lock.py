"""Two gateways on one SQLite file: each write transaction takes SQLite's write lock before it
reads what it decides on (`appends.begin_writing`), so another gateway's commit cannot change
that between the read and the write. Python's sqlite3 begins a transaction only at its first
INSERT or UPDATE; before, what came earlier was read outside it."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from reins.gateway.store import Conflict
from reins.gateway.store.sql import SqlStore
from reins.gateway.store.writer import ThreadWriter
from reins.schemas import AttemptCreate, EventIn, RolloutSpec


async def test_on_sqlite_a_commit_checks_its_attempt_once_it_holds_the_write_lock(
    tmp_path: Path,
) -> None:
    """A close committed by another gateway while a commit waits for SQLite's write lock is
    seen by that commit. Python's sqlite3 began the commit's transaction only at its INSERT:
    the attempt check before it read the attempt open, the INSERT waited for the lock, the
    close committed, and the event was stored into the closed rollout (two gateways on one
    file, with a write lock held outside: `two_gateways.py`, 1 run in 2)."""
    path = tmp_path / "gateway.db"
    store = SqlStore(f"sqlite+aiosqlite:///{path}", event_writer="thread")
    await store.init()
    lock = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        await store.create_rollouts([RolloutSpec(rollout_id="r")])
        await store.open_attempt("r", AttemptCreate())
        await store.set_peers(1)  # its commits in its writer's thread, not on this loop
        assert isinstance(store._writer, ThreadWriter)
        checked = threading.Event()

        def on_statement(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            if "FROM attempts" in statement:
                checked.set()

        sa.event.listen(store._writer.engine, "after_cursor_execute", on_statement)
        lock.execute("BEGIN IMMEDIATE")  # another gateway's close, under way
        post = asyncio.create_task(
            store.append_events("r", 1, [EventIn(type="log", data={})], from_harness=True)
        )
        checked_meanwhile = await asyncio.to_thread(checked.wait, 2)
        lock.execute("UPDATE rollouts SET state = 'succeeded' WHERE rollout_id = 'r'")
        lock.execute("COMMIT")
        with pytest.raises(Conflict, match="rollout r is succeeded"):
            await asyncio.wait_for(post, 30)
        assert not checked_meanwhile, "checked the attempt while another held the write lock"
        assert await store.get_events("r") == []
    finally:
        lock.close()
        await store.close()


async def test_attempts_opened_through_two_gateways_at_once_are_numbered_in_turn(
    tmp_path: Path,
) -> None:
    """Each open reads the rollout's attempt count and inserts the next attempt. Read outside
    the transaction, two gateways drew the same number: 36 of 120 opens failed on the unique
    index (a 500 to the trainer)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    first, second = SqlStore(url), SqlStore(url)
    await first.init()
    await second.init()
    try:
        await first.create_rollouts([RolloutSpec(rollout_id=f"r{n}") for n in range(10)])
        for n in range(10):
            opened = await asyncio.gather(
                *(store.open_attempt(f"r{n}", AttemptCreate()) for store in (first, second) * 2)
            )
            assert sorted(attempt.attempt_id for attempt in opened) == [1, 2, 3, 4]
    finally:
        await first.close()
        await second.close()
