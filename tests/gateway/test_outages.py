"""A database outage is answered as one (503 + Retry-After: wait and retry; 507: the disk is
full), never as a bare 500, in the shape of the API the caller speaks; any other database error
is still a 500. The store's write is made to fail here (a `SqlStore` method replaced in this
process); tests/faults/ cause the same faults for real (a PostgreSQL restart, a full tmpfs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import sqlalchemy.exc

from reins.gateway.store.sql import SqlStore
from tests.conftest import Gateway


class _DriverError(Exception):
    """What a database driver raises, as SQLAlchemy wraps it (`.orig`)."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def _failing(error: Exception) -> Any:
    async def create_rollouts(self: SqlStore, specs: Sequence[Any]) -> list[Any]:
        raise error

    return create_rollouts


def _post(gateway: Gateway, path: str = "/api/rollouts") -> Any:
    return gateway.http.post(path, json=[{"rollout_id": "outage-1"}])


def test_a_full_disk_is_507_saying_so(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    full = sqlalchemy.exc.OperationalError("INSERT", {}, _DriverError("database or disk is full"))
    monkeypatch.setattr(SqlStore, "create_rollouts", _failing(full))
    response = _post(gateway)
    assert response.status_code == 507
    error = response.json()["error"]
    assert "no space left" in error and "database or disk is full" in error
    assert "not stored" in error


def test_a_database_that_went_away_is_503_with_retry_after(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    starting = sqlalchemy.exc.DBAPIError(
        "INSERT", {}, _DriverError("the database system is starting up", sqlstate="57P03")
    )
    monkeypatch.setattr(SqlStore, "create_rollouts", _failing(starting))
    response = _post(gateway)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert "cannot reach its database" in response.json()["error"]
    assert "starting up" in response.json()["error"]


def test_a_refused_connection_is_503(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        SqlStore, "create_rollouts", _failing(ConnectionRefusedError(111, "Connect call failed"))
    )
    response = _post(gateway)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"


def test_another_database_error_is_still_a_500(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = sqlalchemy.exc.DBAPIError("INSERT", {}, _DriverError("syntax error", "42601"))
    monkeypatch.setattr(SqlStore, "create_rollouts", _failing(broken))
    response = _post(gateway)
    assert response.status_code == 500


def test_a_driver_error_in_an_sqlite_event_insert_reaches_the_handlers_as_sqlalchemys(
    tmp_path: Any,
) -> None:
    """On SQLite the event INSERT runs on the driver itself (`appends._insert_fresh`); what the
    driver raises there must still be SQLAlchemy's error, which the answers above are built on
    (tests/faults/test_disk_full.py fills a real disk)."""
    import sqlite3

    import sqlalchemy as sa

    from reins.gateway.store.appends import _insert_fresh
    from reins.gateway.store.tables import metadata

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'events.db'}")
    metadata.create_all(engine)
    row = {
        "rollout_id": "r",
        "attempt_id": 1,
        "type": None,  # NOT NULL: the driver refuses the row
        "data": {},
        "idempotency_key": "k",
        "created_at": 0.0,
    }
    with engine.begin() as conn, pytest.raises(sqlalchemy.exc.IntegrityError) as raised:
        _insert_fresh(conn, None, [row])
    assert isinstance(raised.value.orig, sqlite3.IntegrityError)
    assert "NOT NULL" in str(raised.value.orig)
    engine.dispose()
