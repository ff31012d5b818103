"""Gateway replicas started together on one fresh database (two pods of one deployment): each
one's `SqlStore.init` creates the tables if they are missing. On PostgreSQL two concurrent
creations raced in the system catalog and one gateway died at its start (a unique violation
on `pg_type`). On SQLite, turning the new file to WAL mode failed at once for one of them
("database is locked", ~5 % of starts in CI). Real databases: a SQLite file and a fresh
database on a real PostgreSQL server."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from reins.gateway.store import pragmas
from reins.gateway.store.pragmas import sqlite_engine
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


def test_a_store_opening_a_file_another_connection_is_writing_waits_to_make_it_wal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race made certain: a connection holds a new file's write lock (in rollback mode, as
    a fresh file starts) when the store's connection asks for WAL mode. SQLite refuses that one
    at once, busy handler or not; it must wait its turn and try again. The store's pause between
    tries is where the writer commits here, so the test needs no timing."""
    path = tmp_path / "gateway.db"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("CREATE TABLE made_first (x)")
    pauses: list[float] = []

    def writer_commits(seconds: float) -> None:
        pauses.append(seconds)
        writer.execute("COMMIT")

    pause_by_committing = SimpleNamespace(monotonic=time.monotonic, sleep=writer_commits)
    monkeypatch.setattr(pragmas, "time", pause_by_committing, raising=False)
    engine = sqlite_engine(str(path), "NORMAL")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            tables = conn.exec_driver_sql("SELECT name FROM sqlite_master").scalars().all()
    finally:
        engine.dispose()
        writer.close()
    assert tables == ["made_first"]
    assert len(pauses) == 1
