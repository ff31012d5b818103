"""Two gateway replicas on one database act as one gateway: a pause at one holds calls at the
other, a drain at one waits for calls running at the other, models registered at one are served
at the other as soon as calls resume.

Each replica is a real gateway app served by uvicorn on its own loopback port, with its own
admission gate and model cache; they share only the database (SQLite file, and a real PostgreSQL
server in the slow tier). The engine is the stub (tests/stub_engine.py), which reports no weight
version, so the gateway records the registered one.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from reins.gateway import GatewaySettings
from reins.gateway.store.board import ReplicaReport
from reins.gateway.store.sql import SqlStore
from tests.conftest import ADMIN_KEY, serve
from tests.gateway.test_admission import MESSAGES, in_thread, until
from tests.stub_engine import StubEngine

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROXY = "/proxy/rollout/r/attempt/1/mode/train/openai/v1/chat/completions"


@dataclass
class Replica:
    url: str
    http: httpx.Client

    def admission(self) -> dict[str, object]:
        status: dict[str, object] = self.http.get("/api/admission").json()
        return status

    def call(self, **extra: object) -> httpx.Response:
        return self.http.post(PROXY, json={"messages": MESSAGES, **extra}, timeout=60)


@pytest.fixture
def replicas(database_url: str, stub: StubEngine) -> Iterator[tuple[Replica, Replica]]:
    settings = GatewaySettings(database_url=database_url, api_key=ADMIN_KEY)
    with serve(settings) as first, serve(settings) as second:
        pair = []
        for server in (first, second):
            url = f"http://127.0.0.1:{server.port}"
            pair.append(Replica(url, httpx.Client(base_url=url, headers=ADMIN, timeout=30)))
        a, b = pair
        a.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
        a.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
        a.http.post("/api/rollouts/r/attempts")
        yield a, b
        for replica in pair:
            replica.http.close()


def recorded(replica: Replica) -> list[dict[str, object]]:
    events = replica.http.get("/api/rollouts/r/events", params={"type": "model_request"})
    return [event["data"] for event in events.json()]


def test_each_replica_lists_both(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    for replica in (a, b):
        listed = replica.admission()["replicas"]
        assert isinstance(listed, list)
        assert len(listed) == 2
        assert [entry["this"] for entry in listed] == [True, False]


def test_a_pause_at_one_replica_holds_calls_at_the_other(
    replicas: tuple[Replica, Replica], stub: StubEngine
) -> None:
    a, b = replicas
    paused = a.http.post("/api/admission/pause").json()
    assert paused["paused"] is True
    # The pause returned once every live replica applied it: b holds at once.
    assert b.admission()["paused"] is True
    thread, out = in_thread(b.call)
    until(b.admission, lambda s: s["held"] == 1, "the call at b was not held")
    assert stub.requests == [], "a call held at b must not reach the engine"
    resumed_at = time.monotonic()
    a.http.post("/api/admission/resume")
    thread.join(timeout=30)
    assert out["value"].status_code == 200  # type: ignore[attr-defined]
    assert float(out["done_at"]) >= resumed_at  # type: ignore[arg-type]
    assert len(stub.requests) == 1


def test_a_drain_at_one_replica_waits_for_a_call_running_at_the_other(
    replicas: tuple[Replica, Replica],
) -> None:
    a, b = replicas
    thread, out = in_thread(lambda: b.call(stub_delay_s=1.5))
    until(b.admission, lambda s: s["in_flight"] == 1, "the call at b did not start")
    a.http.post("/api/admission/pause")
    drained = a.http.post("/api/admission/drain", params={"timeout_s": 30}).json()
    assert drained["drained"] is True
    # The call at b (held 1.5 s by the engine) was recorded before the drain answered.
    assert len(recorded(a)) == 1
    thread.join(timeout=30)
    assert out["value"].status_code == 200  # type: ignore[attr-defined]
    a.http.post("/api/admission/resume")


def test_a_drain_reports_a_timeout_while_the_other_replica_is_busy(
    replicas: tuple[Replica, Replica], stub: StubEngine
) -> None:
    a, b = replicas
    # Held by the engine until released: a fixed delay ran out while a slow CI machine paused.
    thread, out = in_thread(lambda: b.call(stub_hold="drain"))
    until(b.admission, lambda s: s["in_flight"] == 1, "the call at b did not start")
    a.http.post("/api/admission/pause")
    drained = a.http.post("/api/admission/drain", params={"timeout_s": 0.3}).json()
    assert drained["drained"] is False
    assert recorded(a) == []
    stub.release("drain")
    thread.join(timeout=30)
    assert out["value"].status_code == 200  # type: ignore[attr-defined]
    a.http.post("/api/admission/resume")


def test_a_version_registered_at_one_replica_is_recorded_at_the_other_after_resume(
    replicas: tuple[Replica, Replica], stub: StubEngine
) -> None:
    a, b = replicas
    assert b.call().status_code == 200  # b now caches the directory at version 0
    a.http.post("/api/admission/pause")
    registered = {"model": "policy", "endpoint": stub.base_url, "weight_version": 1}
    a.http.post("/api/models", json=registered)
    thread, out = in_thread(b.call)
    until(b.admission, lambda s: s["held"] == 1, "the call at b was not held")
    a.http.post("/api/admission/resume")
    thread.join(timeout=30)
    assert out["value"].status_code == 200  # type: ignore[attr-defined]
    assert [call["model_version"] for call in recorded(a)] == [0, 1]


def test_a_resume_at_the_other_replica_releases_calls_held_at_the_first(
    replicas: tuple[Replica, Replica],
) -> None:
    a, b = replicas
    b.http.post("/api/admission/pause")
    thread, out = in_thread(a.call)
    until(a.admission, lambda s: s["held"] == 1, "the call at a was not held")
    b.http.post("/api/admission/resume")
    thread.join(timeout=30)
    assert out["value"].status_code == 200  # type: ignore[attr-defined]
    assert a.admission()["paused"] is False


def test_a_silent_replica_stops_holding_drains(database_url: str) -> None:
    """A replica killed with a call in flight (its last report says so) holds a drain only until
    its heartbeat is `replica_timeout_s` old."""
    settings = GatewaySettings(database_url=database_url, api_key=ADMIN_KEY, replica_timeout_s=3)

    async def report_killed_replica() -> float:
        store = SqlStore(database_url)
        await store.init()
        now = time.time()
        killed = ReplicaReport(
            replica_id="killed",
            address="killed host",
            seen_epoch=10**6,  # it applied every pause: only its call in flight holds drains
            paused=True,
            in_flight=1,
            held=0,
            started_at=now,
            heartbeat_at=now,
        )
        await store.board.report(killed)
        await store.close()
        return now

    with serve(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        with httpx.Client(base_url=url, headers=ADMIN, timeout=30) as http:
            http.post("/api/admission/pause")
            # While its report is live the drain is held. A machine too busy to drain within
            # the report's 3 s reports it again (it is no test of the hold then): not a sleep.
            for _ in range(5):
                reported = asyncio.run(report_killed_replica())
                replicas = http.get("/api/admission").json()["replicas"]
                drained = http.post("/api/admission/drain", params={"timeout_s": 0.2}).json()
                if time.time() - reported < settings.replica_timeout_s:
                    break
            else:
                pytest.fail("no drain answered within 3 s of the report in 5 tries")
            assert len(replicas) == 2
            assert drained["drained"] is False, "held by a live replica with a call in flight"
            started = time.monotonic()
            drained = http.post("/api/admission/drain", params={"timeout_s": 10}).json()
            assert drained["drained"] is True
            assert time.monotonic() - started < 8
            listed = http.get("/api/admission").json()["replicas"]
            assert [entry["this"] for entry in listed] == [True]


def test_a_gateway_restarted_while_paused_stays_paused_until_resumed(database_url: str) -> None:
    settings = GatewaySettings(database_url=database_url, api_key=ADMIN_KEY)
    with (
        serve(settings) as server,
        httpx.Client(base_url=f"http://127.0.0.1:{server.port}", headers=ADMIN, timeout=30) as http,
    ):
        assert http.get("/api/admission").json()["paused"] is False
        http.post("/api/admission/pause")
    with (
        serve(settings) as server,
        httpx.Client(base_url=f"http://127.0.0.1:{server.port}", headers=ADMIN, timeout=30) as http,
    ):
        assert http.get("/api/admission").json()["paused"] is True
        http.post("/api/admission/resume")
        assert http.get("/api/admission").json()["paused"] is False


def test_on_sqlite_a_joining_gateway_serves_once_the_first_stores_calls_before_answering(
    tmp_path: Path, stub: StubEngine
) -> None:
    """Alone, a SQLite gateway answers a call from its journal before the call's commit; the
    second gateway could close the attempt without seeing it. So the second serves only once
    the first knows it, and from then the first answers a call after its commit: with the file
    write-locked from here, a call through the first waits (before: answered at once)."""
    path = tmp_path / "gateway.db"
    settings = GatewaySettings(database_url=f"sqlite+aiosqlite:///{path}", api_key=ADMIN_KEY)
    lock = sqlite3.connect(path, timeout=30, isolation_level=None)
    with serve(settings) as first:
        url = f"http://127.0.0.1:{first.port}"
        a = Replica(url, httpx.Client(base_url=url, headers=ADMIN, timeout=30))
        a.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
        a.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
        a.http.post("/api/rollouts/r/attempts")
        assert a.call().status_code == 200  # a commit sees the attempt open
        lock.execute("BEGIN IMMEDIATE")
        assert a.call().status_code == 200, "alone, answered from the journal"
        lock.execute("ROLLBACK")
        with serve(settings):
            lock.execute("BEGIN IMMEDIATE")
            sent = len(stub.requests)
            thread, out = in_thread(a.call)
            until(lambda: len(stub.requests), lambda n: n > sent, "the engine's answer")
            time.sleep(0.5)  # the journal answered within milliseconds; 0.5 s is margin
            assert "done_at" not in out, "answered before its commit with another gateway live"
            lock.execute("ROLLBACK")
            thread.join(30)
            assert out["value"].status_code == 200  # type: ignore[attr-defined]
            assert len(recorded(a)) == 3
        a.http.close()
    lock.close()


def test_on_sqlite_a_gateway_restarted_after_a_kill_does_not_wait_for_its_former_self(
    tmp_path: Path, stub: StubEngine
) -> None:
    """The killed gateway's report stays live for `replica_timeout_s`, but its journal lock
    went with it: nobody can answer a call before its commit, so the restart serves at once
    (it waited out the killed one's timeout before)."""
    path = tmp_path / "gateway.db"
    settings = GatewaySettings(
        database_url=f"sqlite+aiosqlite:///{path}", api_key=ADMIN_KEY, replica_timeout_s=60
    )

    async def report_killed_gateway() -> None:
        store = SqlStore(settings.database_url)
        await store.init()
        now = time.time()
        killed = ReplicaReport("killed", "killed host", 0, False, 0, 0, now, now)
        await store.board.report(killed)
        await store.close()

    asyncio.run(report_killed_gateway())
    started = time.monotonic()
    with serve(settings) as server:
        took = time.monotonic() - started
        url = f"http://127.0.0.1:{server.port}"
        with httpx.Client(base_url=url, headers=ADMIN, timeout=30) as http:
            assert len(http.get("/api/admission").json()["replicas"]) == 2  # it is live
    assert took < 30, f"the start waited {took:.1f} s for a killed gateway"


@pytest.mark.slow  # the pause waits its 20 s for the silent replica
def test_a_pause_answers_within_the_clients_timeout_whatever_the_replica_timeout(
    tmp_path: Path,
) -> None:
    """With `REINS_REPLICA_TIMEOUT_S=60`, a live replica that never applies the pause (its host
    hung) kept `POST /api/admission/pause` waiting 61 s, past the clients' 30 s: the trainer's
    pause timed out and each retry waited again. The pause answers after `pause_wait_s` (20 s);
    the drain that follows still waits for that replica."""
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    settings = GatewaySettings(database_url=database_url, api_key=ADMIN_KEY, replica_timeout_s=60)

    async def report_hung_replica() -> None:
        store = SqlStore(database_url)
        await store.init()
        now = time.time()
        hung = ReplicaReport(
            replica_id="hung",
            address="hung host",
            seen_epoch=0,  # it applied no pause
            paused=False,
            in_flight=0,
            held=0,
            started_at=now,
            heartbeat_at=now,
        )
        await store.board.report(hung)
        await store.close()

    with serve(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        with httpx.Client(base_url=url, headers=ADMIN, timeout=30) as http:
            asyncio.run(report_hung_replica())
            assert len(http.get("/api/admission").json()["replicas"]) == 2
            started = time.monotonic()
            paused = http.post("/api/admission/pause")
            assert paused.status_code == 200 and paused.json()["paused"] is True
            assert time.monotonic() - started < 25
            drained = http.post("/api/admission/drain", params={"timeout_s": 0.2}).json()
            assert drained["drained"] is False, "held by the live replica that did not pause"
