"""A scoped token stops working when its attempt closes: once the attempt is superseded by a retry
or its rollout is terminal, the harness's event posts get a 409 that says why, and nothing is
stored. The admin key may still annotate any attempt (docs/gateway.md, "Attempts")."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from typing import Any

import pytest

from reins.gateway.store import Conflict
from reins.gateway.store.sql import SqlStore
from reins.schemas import AttemptCreate, EventIn, RolloutSpec, RolloutUpdate
from tests.conftest import Gateway

EVENTS = "/api/rollouts/r/attempt/1/events"
REWARD = {"type": "reward", "data": {"value": 1.0}, "idempotency_key": "reward-1"}


def _start(gateway: Gateway) -> str:
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    return str(gateway.http.post("/api/rollouts/r/attempts").json()["token"])


def _events(gateway: Gateway, attempt_id: int = 1) -> list[dict[str, object]]:
    response = gateway.http.get(f"/api/rollouts/r/events?attempt_id={attempt_id}")
    assert response.status_code == 200, response.text
    return list(response.json())


def test_an_open_attempt_takes_its_harness_events(gateway: Gateway) -> None:
    token = _start(gateway)
    assert gateway.client(token).post(EVENTS, json=REWARD).status_code == 200
    assert [e["type"] for e in _events(gateway)] == ["reward"]


@pytest.mark.parametrize("state", ["succeeded", "failed"])
def test_a_terminal_rollout_refuses_its_harness_events_with_409(
    gateway: Gateway, state: str
) -> None:
    token = _start(gateway)
    # An event stored while the attempt is open, so the gateway has seen it open.
    assert gateway.client(token).post(EVENTS, json={"type": "log"}).status_code == 200
    gateway.http.patch("/api/rollouts/r", json={"status": {"state": state}})
    response = gateway.client(token).post(EVENTS, json=REWARD)
    assert response.status_code == 409
    error = response.json()["error"]
    assert f"rollout r is {state}" in error
    assert "accepts no more events or calls from its harness" in error
    assert [e["type"] for e in _events(gateway)] == ["log"]


def test_a_superseded_attempt_refuses_its_harness_events_with_409(gateway: Gateway) -> None:
    token = _start(gateway)
    assert gateway.client(token).post(EVENTS, json={"type": "log"}).status_code == 200
    gateway.http.post("/api/rollouts/r/attempts", json={"reason": "agent timed out"})
    response = gateway.client(token).post(EVENTS, json=[REWARD, {"type": "log"}])
    assert response.status_code == 409
    error = response.json()["error"]
    assert "attempt 1 of rollout r was superseded by attempt 2" in error
    assert "agent timed out" in error
    assert [e["type"] for e in _events(gateway, 1)] == ["log"]
    assert _events(gateway, 2) == []


def test_a_retried_post_of_a_stored_event_is_still_acknowledged(gateway: Gateway) -> None:
    """Idempotency wins: a harness whose ack was lost, retrying after its attempt closed, gets
    the stored event's ack, not a 409 for an event the gateway already has."""
    token = _start(gateway)
    first = gateway.client(token).post(EVENTS, json=REWARD)
    assert first.status_code == 200
    gateway.http.patch("/api/rollouts/r", json={"status": {"state": "succeeded"}})
    again = gateway.client(token).post(EVENTS, json=REWARD)
    assert again.status_code == 200
    assert again.json()["seq"] == first.json()["seq"]
    changed = gateway.client(token).post(EVENTS, json={**REWARD, "idempotency_key": "reward-2"})
    assert changed.status_code == 409
    assert len(_events(gateway)) == 1


def test_the_admin_key_may_still_annotate_a_closed_attempt(gateway: Gateway) -> None:
    _start(gateway)
    gateway.http.post("/api/rollouts/r/attempts")
    gateway.http.patch("/api/rollouts/r", json={"status": {"state": "succeeded"}})
    for attempt_id in (1, 2):
        response = gateway.http.post(
            f"/api/rollouts/r/attempt/{attempt_id}/events",
            json={"type": "annotation", "data": {"note": "reviewed"}},
        )
        assert response.status_code == 200, response.text
        assert [e["type"] for e in _events(gateway, attempt_id)] == ["annotation"]


def test_an_unknown_attempt_is_still_404(gateway: Gateway) -> None:
    _start(gateway)
    response = gateway.http.post("/api/rollouts/r/attempt/5/events", json={"type": "x"})
    assert response.status_code == 404


# -- the open check's cost on SQLite -----------------------------------------------------------


@pytest.fixture
async def sqlite_store(tmp_path: Any) -> AsyncIterator[SqlStore]:
    store = SqlStore(f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}")
    await store.init()
    yield store
    await store.close()


async def test_on_sqlite_an_attempt_seen_open_is_checked_without_a_query_until_it_closes(
    sqlite_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy checks the attempt before every call. On SQLite (one gateway process writes
    it) an attempt that an event commit saw open is known open until a close, which drops it:
    the check then reads the database again and refuses."""
    store = sqlite_store
    reads: list[dict[str, Any]] = []
    read = store._attempt_state

    def counted(ids: dict[str, Any]) -> Any:
        reads.append(ids)
        return read(ids)

    monkeypatch.setattr(store, "_attempt_state", counted)
    await store.create_rollouts([RolloutSpec(rollout_id="r")])
    await store.open_attempt("r", AttemptCreate())
    await store.check_open("r", 1)
    assert len(reads) == 1  # not seen open by a commit yet: read
    await store.append_events("r", 1, [EventIn(type="log", data={})], from_harness=True)
    for _ in range(3):
        await store.check_open("r", 1)
    assert len(reads) == 1
    await store.update_rollout(
        "r", RolloutUpdate.model_validate({"status": {"state": "succeeded"}})
    )
    with pytest.raises(Conflict, match="rollout r is succeeded"):
        await store.check_open("r", 1)
    assert len(reads) == 2


async def test_on_sqlite_a_retry_makes_the_old_attempt_checked_again(
    sqlite_store: SqlStore,
) -> None:
    store = sqlite_store
    await store.create_rollouts([RolloutSpec(rollout_id="r")])
    await store.open_attempt("r", AttemptCreate())
    await store.append_events("r", 1, [EventIn(type="log", data={})], from_harness=True)
    await store.open_attempt("r", AttemptCreate(reason="agent timed out"))
    with pytest.raises(Conflict, match="superseded by attempt 2"):
        await store.check_open("r", 1)
    await store.check_open("r", 2)


@pytest.fixture
async def closed_by_the_second(tmp_path: Any) -> AsyncIterator[tuple[SqlStore, SqlStore]]:
    """Two gateways' stores on one SQLite file (`test_replicas.py` runs two gateways): the
    first knows attempt 1 of rollout r open from its own commit; the second then closes r."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    first, second = SqlStore(url), SqlStore(url)
    await first.init()
    await second.init()
    try:
        await first.create_rollouts([RolloutSpec(rollout_id="r")])
        await first.open_attempt("r", AttemptCreate())
        await first.append_events("r", 1, [EventIn(type="log", data={"n": 1})], from_harness=True)
        await first.check_open("r", 1)  # known open, no query
        succeeded = RolloutUpdate.model_validate({"status": {"state": "succeeded"}})
        await second.update_rollout("r", succeeded)
        yield first, second
    finally:
        await first.close()
        await second.close()


async def test_on_sqlite_a_post_after_another_gateways_close_is_refused(
    closed_by_the_second: tuple[SqlStore, SqlStore],
) -> None:
    first, second = closed_by_the_second
    with pytest.raises(Conflict, match="rollout r is succeeded"):
        await first.append_events("r", 1, [EventIn(type="log", data={"n": 2})], from_harness=True)
    assert [e.data["n"] for e in await second.get_events("r")] == [1]


async def test_on_sqlite_a_journaled_call_after_another_gateways_close_is_not_stored(
    closed_by_the_second: tuple[SqlStore, SqlStore],
) -> None:
    """The first still knows the attempt open, so it answers the call from its journal; the
    commit checks every attempt and refuses it (not stored after the close the trainer read),
    and the first then checks the attempt again: its next calls are refused (409)."""
    first, second = closed_by_the_second
    await first.record_calls("r", 1, [EventIn(type="model_request", data={"n": 2})])
    first.flush_soon()
    assert first._flusher is not None
    await first._flusher
    with pytest.raises(Conflict, match="rollout r is succeeded"):
        await first.check_open("r", 1)
    assert [e.data["n"] for e in await second.get_events("r")] == [1]


async def test_on_sqlite_with_another_gateway_live_a_call_after_its_close_is_refused_at_once(
    closed_by_the_second: tuple[SqlStore, SqlStore],
) -> None:
    """Told that another gateway serves the file (`Replicas` counts it), the first checks the
    attempt before a call and stores the call before it answers: the harness gets 409 and no
    call is answered from the journal into an attempt closed meanwhile."""
    first, second = closed_by_the_second
    await first.set_peers(1)
    with pytest.raises(Conflict, match="rollout r is succeeded"):
        await first.check_open("r", 1)
    with pytest.raises(Conflict, match="rollout r is succeeded"):
        await first.record_calls("r", 1, [EventIn(type="model_request", data={"n": 2})])
    assert [e.data["n"] for e in await second.get_events("r")] == [1]


async def test_on_sqlite_learning_of_another_gateway_stores_the_calls_answered_before(
    tmp_path: Any,
) -> None:
    """`set_peers` returns once the calls answered from the journal are in the database (the
    other gateway, which cannot see the journal, may close their attempt next), and from then
    on a call's record waits for its commit: here both wait for a write lock held outside."""
    path = tmp_path / "gateway.db"
    store = SqlStore(f"sqlite+aiosqlite:///{path}")
    await store.init()
    lock = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        await store.create_rollouts([RolloutSpec(rollout_id="r")])
        await store.open_attempt("r", AttemptCreate())
        await store.append_events("r", 1, [EventIn(type="log", data={"n": 1})], from_harness=True)
        lock.execute("BEGIN IMMEDIATE")
        await asyncio.wait_for(  # answered from the journal although nothing can commit
            store.record_calls("r", 1, [EventIn(type="model_request", data={"n": 2})]), 5
        )
        told = asyncio.create_task(store.set_peers(1))
        await asyncio.sleep(0.5)
        assert not told.done(), "returned before the journaled call was stored"
        call = asyncio.create_task(
            store.record_calls("r", 1, [EventIn(type="model_request", data={"n": 3})])
        )
        await asyncio.sleep(0.5)
        assert not call.done(), "answered before its commit although another gateway serves"
        lock.execute("ROLLBACK")
        await asyncio.wait_for(told, 30)
        await asyncio.wait_for(call, 30)
        assert [e.data["n"] for e in await store.get_events("r")] == [1, 2, 3]
        await store.set_peers(0)  # alone again: answered from the journal
        lock.execute("BEGIN IMMEDIATE")
        await asyncio.wait_for(
            store.record_calls("r", 1, [EventIn(type="model_request", data={"n": 4})]), 5
        )
        lock.execute("ROLLBACK")
    finally:
        lock.close()
        await store.close()
