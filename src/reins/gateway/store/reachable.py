"""Whether the gateway's database can be opened, said in one line: `reins gateway` checks it
before it serves, since a database that fails in the app's startup is reported by the ASGI
server as a traceback of its own lifespan machinery, the cause at the bottom."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from reins.gateway.store.pragmas import sqlite_file

CONNECT_TIMEOUT_S = 10.0


class DatabaseUnreachable(Exception):
    """The database cannot be opened; the message says which, why, and what to check."""


async def check_reachable(url: str) -> None:
    """Opens one connection to the database at `url` (a SQLite file: creates its folder and the
    file, as the gateway would); raises `DatabaseUnreachable` saying why it cannot."""
    shown = sa.make_url(url).render_as_string(hide_password=True)
    if url.startswith("sqlite"):
        _check_sqlite(url)
        return
    if not url.startswith("postgresql"):
        raise DatabaseUnreachable(
            f"{shown} is neither a SQLite file nor a PostgreSQL URL: --db takes a file path, "
            "sqlite:///PATH or postgresql://USER@HOST/DATABASE"
        )
    engine = create_async_engine(url, connect_args={"timeout": CONNECT_TIMEOUT_S})
    try:
        async with engine.connect():
            pass
    except OSError as error:  # refused, no such host, timed out
        reason = error.strerror or str(error) or type(error).__name__
        raise DatabaseUnreachable(
            f"cannot reach the database {shown}: {reason}; is the server running and "
            "listening at that host and port?"
        ) from error
    except TypeError as error:  # a URL option asyncpg does not take (connect_timeout=...)
        raise DatabaseUnreachable(
            f"the database URL {shown} has an option the PostgreSQL driver (asyncpg) does not "
            f"take ({error}); its options: ssl=, timeout=, command_timeout=..."
        ) from error
    except sa.exc.DBAPIError as error:  # the server answered: no such database, login refused
        raise DatabaseUnreachable(
            f"the database {shown} refused the connection: {error.orig}"
        ) from error
    finally:
        await engine.dispose()


def _check_sqlite(url: str) -> None:
    """The SQLite half of `check_reachable` (blocking: it runs before the gateway serves)."""
    try:
        path = sqlite_file(url)
    except ValueError as error:
        raise DatabaseUnreachable(str(error)) from None
    if os.path.exists(path) and not os.path.isfile(path):
        raise DatabaseUnreachable(
            f"{path} is not a file (a folder or a device): name a SQLite file (--db or "
            "REINS_DATABASE_URL)"
        )
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with contextlib.closing(sqlite3.connect(path)) as conn:
            # Reads the header: a file that is not a database fails here, not at startup.
            conn.execute("PRAGMA schema_version").fetchone()
    except sqlite3.DatabaseError as error:
        raise DatabaseUnreachable(
            f"{path} is not a SQLite database ({error}); name a new file or the gateway's "
            "own database (--db or REINS_DATABASE_URL)"
        ) from error
    except (OSError, sqlite3.Error) as error:
        raise DatabaseUnreachable(
            f"cannot open the SQLite database {path}: {error}; name a file in a folder "
            "this user may write (--db or REINS_DATABASE_URL)"
        ) from error
