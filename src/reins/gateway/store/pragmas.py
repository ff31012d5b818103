"""How the store opens a SQLite file: WAL, its page size, its lock wait and its functions."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

import sqlalchemy as sa

from reins.gateway.store.reads import FOLD, fold
from reins.gateway.store.tables import serialize

SQLITE_PAGE_SIZE = 65536
"""The page size of a new SQLite database (SQLite's largest; an existing one keeps its own). A
row lives whole on one page unless it overflows, so a page holds a whole number of rows and
the rest of it stays empty: packed calls of ~3.4 KB left 16 % of 4, 8 and 16 KB pages empty,
under 3 % of 64 KB ones (docs/benchmarks.md, "Records at scale"). The cost: an empty database
takes ~1.6 MB (a page per table and index), and a commit writes 64 KB WAL frames (one client's
appends took ~0.6 ms more CPU each; 16 clients', the same)."""
_WAL_CHECKPOINT_BYTES = 4 * 2**20
_BUSY_TIMEOUT_MS = 10_000


def sqlite_file(url: str) -> str:
    """The path of the SQLite file a `sqlite...:///PATH` URL names; ValueError for an in-memory
    database, which the store cannot use: its event writer (a process of its own) and its
    reader open their own connections, and each would get an empty database of its own."""
    _, _, path = url.partition(":///")
    if not path or path == ":memory:" or path.startswith("file::memory:") or "mode=memory" in path:
        raise ValueError(
            f"{url}: an in-memory SQLite database cannot hold the gateway's records (its event "
            "writer and its reader open connections of their own); name a file, on a tmpfs "
            "such as /dev/shm for a scratch gateway"
        )
    return path


def install_sqlite_pragmas(engine: sa.Engine, synchronous: str) -> None:
    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
        # Before WAL mode, which fixes the page size of a new file; a no-op on an existing one.
        cursor.execute(f"PRAGMA page_size={SQLITE_PAGE_SIZE}")
        _enter_wal_mode(cursor)
        # SQLite checkpoints every 1000 pages: 4 MB of WAL with 4 KB pages, 64 MB with 64 KB
        # ones. Kept near 4 MB whatever the file's page size.
        cursor.execute("PRAGMA page_size")
        (page_size,) = cursor.fetchone()
        cursor.execute(f"PRAGMA wal_autocheckpoint={max(1, _WAL_CHECKPOINT_BYTES // page_size)}")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.close()
        dbapi_connection.create_function(FOLD, 1, fold, deterministic=True)


def _enter_wal_mode(cursor: Any) -> None:
    """`PRAGMA journal_mode=WAL`, waiting out other connections. Turning a new file to WAL reads
    it, then needs it alone: two gateways' stores opening one fresh file together each hold the
    read and want the write, and SQLite answers one of them "database is locked" at once, without
    its busy handler (waiting could be a deadlock). The one refused tries again, read anew: by
    then the other has turned the file to WAL (that lasts; the pragma only reads it then)."""
    deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.fetchall()
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
        time.sleep(0.01)


def _keep_statement_journals_in_memory(engine: sa.Engine) -> None:
    """An event INSERT inside the group commit's transaction keeps a statement journal (the
    pages it changes, to undo that one statement); SQLite puts it in a temp file by default:
    per commit a file created, unlinked, two 64 KB pages written and closed, ~9 system calls.
    The event connection's statements change a few pages, so its journals stay in memory."""

    @sa.event.listens_for(engine, "connect")
    def _temp_store(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute("PRAGMA temp_store=MEMORY")


def sqlite_engine(path: str, synchronous: str, *, for_events: bool = False) -> sa.Engine:
    """A one-connection engine on the SQLite file at `path`, usable from any one thread at a
    time; `for_events`: the group commits' connection."""
    engine = sa.create_engine(
        "sqlite:///" + path,
        connect_args={"check_same_thread": False},
        pool_size=1,
        # Rows come encoded (pydantic-core's encoder, ~15 us per 2 KB event against ~75 us for
        # json.dumps): see `serialize`.
        json_serializer=serialize,
    )
    install_sqlite_pragmas(engine, synchronous)
    if for_events:
        _keep_statement_journals_in_memory(engine)
    return engine
