"""The call journal (`reins.gateway.store.journal`): a SQLite gateway answers a proxied call once
its record is in the journal, stores it right after, and loses none when it is killed between.

Each test that needs the commit to be late holds SQLite's write lock from the test process
(`BEGIN IMMEDIATE` on the gateway's own file), so the gateway cannot commit until the test lets
go: a proxied call answered meanwhile was answered from the journal. The engine is the stub
(tests/stub_engine.py); the gateway, SQLite and the journal file are real.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from reins.gateway.jsonrule import encode
from reins.gateway.store import sql as sql_module
from reins.gateway.store import writer as writer_module
from reins.gateway.store.journal import (
    CallJournal,
    JournaledPost,
    decode_posts,
    encode_post,
    held_elsewhere,
)
from reins.gateway.store.sql import SqlStore
from reins.schemas import AttemptCreate, EventIn, RolloutSpec, RolloutUpdate
from tests.conftest import ADMIN_KEY, Gateway
from tests.stub_engine import StubEngine
from tests.support import GatewayProcess, free_port

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: PostgreSQL has no journal (every call waits for its commit there)."""
    return f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"


def _db_path(url: str) -> Path:
    return Path(url.split(":///", 1)[1])


@contextlib.contextmanager
def write_lock_held(db: Path) -> Iterator[sqlite3.Connection]:
    """SQLite's write lock, taken from this process: the gateway's commits wait meanwhile."""
    conn = sqlite3.connect(db, timeout=30, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def _start_rollout(http: httpx.Client, stub: StubEngine) -> str:
    http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url}).raise_for_status()
    http.post("/api/rollouts", json=[{"rollout_id": "r"}]).raise_for_status()
    answer = http.post("/api/rollouts/r/attempts")
    answer.raise_for_status()
    return str(answer.json()["token"])


def _call(base_url: str, token: str, reply: str, timeout_s: float = 30) -> dict[str, Any]:
    answer = httpx.post(
        f"{base_url}/proxy/rollout/r/attempt/1/mode/train/openai/v1/chat/completions",
        json={"model": "policy", "messages": HI, "stub_reply": reply},
        headers={"Authorization": f"Bearer {token}"},
        timeout=timeout_s,
    )
    assert answer.status_code == 200, answer.text
    data: dict[str, Any] = answer.json()
    return data


def _recorded_replies(http: httpx.Client) -> list[str]:
    answer = http.get("/api/rollouts/r/events", params={"type": "model_request"})
    assert answer.status_code == 200, answer.text
    return [e["data"]["response"]["choices"][0]["message"]["content"] for e in answer.json()]


def _admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)


def _stored_calls(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        (count,) = conn.execute(
            "SELECT count(*) FROM events WHERE type = 'model_request'"
        ).fetchone()
    return int(count)


def test_a_call_answered_from_the_journal_survives_a_kill(
    tmp_path: Path, stub: StubEngine, database_url: str
) -> None:
    db = _db_path(database_url)
    gateway = GatewayProcess(database_url=database_url, api_key=ADMIN_KEY, port=free_port())
    gateway.start()
    try:
        with _admin(gateway.url) as http:
            token = _start_rollout(http, stub)
            _call(gateway.url, token, "first")  # its commit sees the attempt open
            with write_lock_held(db):
                # Answered although nothing can commit: from the journal (a call waiting for
                # its commit would get a 503 after SQLite's 10 s busy timeout).
                second = _call(gateway.url, token, "second", timeout_s=8)
                assert second["choices"][0]["message"]["content"] == "second"
                gateway.kill()
    finally:
        gateway.stop()
    assert _stored_calls(db) == 1  # the second call is only in the journal
    journal = Path(f"{db}-calls")
    assert journal.stat().st_size > 0

    restarted = GatewayProcess(database_url=database_url, api_key=ADMIN_KEY, port=free_port())
    restarted.start()
    try:
        with _admin(restarted.url) as http:
            assert _recorded_replies(http) == ["first", "second"]
    finally:
        restarted.stop()
    assert journal.stat().st_size == 0  # replayed, then emptied
    assert _stored_calls(db) == 2


def test_a_read_waits_for_the_calls_answered_before_it(gateway: Gateway, stub: StubEngine) -> None:
    token = _start_rollout(gateway.http, stub)
    _call(gateway.url, token, "first")
    with ThreadPoolExecutor(1) as pool:
        with write_lock_held(_db_path(gateway.settings.database_url)):
            _call(gateway.url, token, "second", timeout_s=8)
            read = pool.submit(_recorded_replies, gateway.http)
            with pytest.raises(FutureTimeout):
                read.result(timeout=1.0)  # the read waits for the second call's commit
        assert read.result(timeout=30) == ["first", "second"]


def test_closing_the_rollout_stores_the_calls_answered_before_it(
    gateway: Gateway, stub: StubEngine
) -> None:
    token = _start_rollout(gateway.http, stub)
    _call(gateway.url, token, "first")
    with ThreadPoolExecutor(1) as pool:
        with write_lock_held(_db_path(gateway.settings.database_url)):
            # The second call's commit starts and waits for the lock; the third's waits in the
            # queue behind it, where a close that did not wait for it would overtake it.
            _call(gateway.url, token, "second", timeout_s=8)
            _call(gateway.url, token, "third", timeout_s=8)
            close = pool.submit(
                gateway.http.patch, "/api/rollouts/r", json={"status": {"state": "succeeded"}}
            )
            with pytest.raises(FutureTimeout):
                close.result(timeout=1.0)  # it waits (for the calls, or for the lock)
        assert close.result(timeout=30).status_code == 200
    assert _recorded_replies(gateway.http) == ["first", "second", "third"]  # none refused
    late = httpx.post(
        f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train/openai/v1/chat/completions",
        json={"model": "policy", "messages": HI},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert late.status_code == 409, late.text
    assert _recorded_replies(gateway.http) == ["first", "second", "third"]


def _post(key: str, value: Any) -> JournaledPost:
    row = {
        "rollout_id": "r",
        "attempt_id": 1,
        "type": "note",
        "data": encode({"value": value}),
        "idempotency_key": key,
        "created_at": 1700000000.25,
    }
    return JournaledPost("r", 1, [row])


def test_journaled_calls_commit_together_or_when_a_read_needs_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once 16 wait or their JSON reaches 1 MiB, 50 ms after the first (here made an hour,
    so nothing else starts the commit), or at once for a read: one commit per call cost each
    call latency and CPU."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    monkeypatch.setattr(sql_module, "_FLUSH_AFTER_S", 3600.0)

    def note(n: int) -> list[EventIn]:
        data = {"n": n, "prompt": "x" * (1 << 20) if n in (19, 20) else ""}
        return [EventIn(type="model_request", data=data, idempotency_key=f"call-{n}")]

    async def scenario() -> tuple[list[int], list[int]]:
        store = SqlStore(url, event_writer="thread")
        await store.init()
        await store.create_rollouts([RolloutSpec(rollout_id="r")])
        await store.open_attempt("r", AttemptCreate())
        opened = EventIn(type="note", data={}, idempotency_key="opened")
        await store.append_events("r", 1, [opened], from_harness=True)  # a commit sees it open
        stored = []
        for n in range(1, 18):
            await store.record_calls("r", 1, note(n))
            store.call_answered()
            if store._flusher is not None:
                await store._flusher
            stored.append(_stored_calls(tmp_path / "g.db"))
        read = [e.data["n"] for e in await store.get_events("r", types=["model_request"])]
        for n in (18, 19, 20):  # a long prompt's call commits at once, with those before it
            await store.record_calls("r", 1, note(n))
            store.call_answered()
            if store._flusher is not None:
                await store._flusher
            stored.append(_stored_calls(tmp_path / "g.db"))
        await store.close()
        return stored, read

    stored, read = asyncio.run(scenario())
    assert stored == [0] * 15 + [16, 16, 17, 19, 20]
    assert read == list(range(1, 18))
    assert _stored_calls(tmp_path / "g.db") == 20


def test_records_read_back_exactly_up_to_a_torn_one() -> None:
    posts = [_post("a", 2**70), _post("b", "ünïcode \u2028"), _post("c", [1.5, -0.0, None])]
    raw = b"".join(encode_post(p) for p in posts)
    read, used = decode_posts(raw)
    assert used == len(raw)
    assert [p.rows[0]["data"].value for p in read] == [
        {"value": 2**70},
        *({"value": v} for v in ("ünïcode \u2028", [1.5, -0.0, None])),
    ]
    assert [p.rows[0]["data"].text for p in read] == [p.rows[0]["data"].text for p in posts]
    assert read[0].rows[0]["created_at"] == 1700000000.25
    # A write the crash cut short, and one whose bytes changed: reading stops before them.
    first = len(encode_post(posts[0]))
    assert [p.rows[0]["idempotency_key"] for p in decode_posts(raw[:-1])[0]] == ["a", "b"]
    flipped = bytearray(raw)
    flipped[first + 12] ^= 0xFF
    assert [p.rows[0]["idempotency_key"] for p in decode_posts(bytes(flipped))[0]] == ["a"]
    # A tail of zeros (what an OS crash can leave): its empty payload matches the CRC 0. And a
    # record whose CRC matches but which is not a record.
    keys = ["a", "b", "c"]
    zeros, used = decode_posts(raw + bytes(4096))
    assert ([p.rows[0]["idempotency_key"] for p in zeros], used) == (keys, len(raw))
    junk = b"not json"
    framed = struct.pack("<II", len(junk), zlib.crc32(junk)) + junk
    after_junk, used = decode_posts(raw + framed + encode_post(posts[0]))
    assert ([p.rows[0]["idempotency_key"] for p in after_junk], used) == (keys, len(raw))


def test_a_second_process_on_the_same_database_does_without_the_journal(tmp_path: Path) -> None:
    first, second = CallJournal(tmp_path / "db-calls"), CallJournal(tmp_path / "db-calls")
    assert first.open()
    assert not second.open()  # flock: held by the first
    first.close()
    assert second.open()
    second.close()


def test_a_restart_replays_the_journal_once_per_key(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"

    async def scenario() -> list[tuple[str, Any]]:
        store = SqlStore(url)
        await store.init()
        await store.create_rollouts([RolloutSpec(rollout_id="r")])
        await store.open_attempt("r", AttemptCreate())
        stored = EventIn(type="note", data={"value": 2**70}, idempotency_key="a")
        await store.append_events("r", 1, [stored])
        await store.close()
        # What a killed gateway leaves: a record already stored, and one that is not.
        journal = CallJournal(tmp_path / "g.db-calls")
        assert journal.open()
        journal.append(_post("a", 2**70))
        journal.append(_post("b", "only in the journal"))
        journal.close()
        store = SqlStore(url)
        await store.init()
        events = await store.get_events("r")
        await store.close()
        return [(e.idempotency_key, e.data) for e in events]

    assert asyncio.run(scenario()) == [
        ("a", {"value": 2**70}),
        ("b", {"value": "only in the journal"}),
    ]
    assert (tmp_path / "g.db-calls").stat().st_size == 0


def test_a_replay_stores_nothing_into_an_attempt_closed_meanwhile(tmp_path: Path) -> None:
    """What another gateway on the same file did while this one was down counts: a call it
    answered from its journal into an attempt closed since is refused at the replay (the
    trainer read the closed rollout without it), and the start goes on."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"

    async def scenario() -> tuple[list[str], list[str]]:
        store = SqlStore(url, event_writer="thread")
        await store.init()
        for rollout_id in ("r", "open"):
            await store.create_rollouts([RolloutSpec(rollout_id=rollout_id)])
            await store.open_attempt(rollout_id, AttemptCreate())
        await store.update_rollout(
            "r", RolloutUpdate.model_validate({"status": {"state": "succeeded"}})
        )
        await store.close()
        journal = CallJournal(tmp_path / "g.db-calls")
        assert journal.open()
        journal.append(_post("late", 1))  # rollout r, closed
        still_open = {**_post("kept", 2).rows[0], "rollout_id": "open"}
        journal.append(JournaledPost("open", 1, [still_open]))
        journal.close()
        store = SqlStore(url, event_writer="thread")
        await store.init()
        closed = [e.idempotency_key for e in await store.get_events("r")]
        kept = [e.idempotency_key for e in await store.get_events("open")]
        await store.close()
        return closed, kept

    assert asyncio.run(scenario()) == ([], ["kept"])
    assert (tmp_path / "g.db-calls").stat().st_size == 0


@pytest.mark.parametrize(("synchronous", "journaled"), [("NORMAL", True), ("FULL", False)])
def test_the_journal_only_where_a_write_is_as_durable_as_a_commit(
    tmp_path: Path, synchronous: str, journaled: bool
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"

    async def scenario() -> None:
        store = SqlStore(url, sqlite_synchronous=synchronous)
        await store.init()
        await store.close()

    asyncio.run(scenario())
    assert (tmp_path / "g.db-calls").exists() is journaled


def test_a_replay_the_database_refuses_keeps_every_record_for_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The records stay until they are stored: a start whose replay the database refuses (a
    lock held elsewhere, a full disk) fails and leaves the journal whole, even past the size
    at which a flush empties it."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    path = tmp_path / "g.db-calls"

    def refused(*_: Any) -> Any:
        raise sa.exc.OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))

    async def scenario() -> list[tuple[str, Any]]:
        store = SqlStore(url, event_writer="thread")
        await store.init()
        await store.create_rollouts([RolloutSpec(rollout_id="r")])
        await store.open_attempt("r", AttemptCreate())
        await store.close()
        journal = CallJournal(path)
        assert journal.open()
        journal.append(_post("a", 1))
        journal.append(_post("b", 2))
        journal.close()
        size = path.stat().st_size
        with monkeypatch.context() as patched:
            patched.setattr(sql_module, "CLEAR_FROM_BYTES", 0)  # a flush would empty it
            patched.setattr(writer_module, "commit_events", refused)
            store = SqlStore(url, event_writer="thread")
            with pytest.raises(sa.exc.OperationalError):
                await store.init()
            await store.close()
        assert path.stat().st_size == size
        store = SqlStore(url, event_writer="thread")
        await store.init()
        events = await store.get_events("r")
        await store.close()
        return [(e.idempotency_key, e.data) for e in events]

    assert asyncio.run(scenario()) == [("a", {"value": 1}), ("b", {"value": 2})]
    assert path.stat().st_size == 0


async def test_a_store_knows_when_another_gateway_holds_the_journal(tmp_path: Path) -> None:
    """`needs_peers_known`: another gateway holds the journal (it may answer calls before their
    commit), seen by a store with a journal of its own and by one without (`FULL`)."""
    path = tmp_path / "gateway.db"
    url = f"sqlite+aiosqlite:///{path}"
    journal = Path(f"{path}-calls")
    assert not held_elsewhere(journal)  # no file
    first = SqlStore(url)
    await first.init()
    try:
        assert first.needs_peers_known is False  # it holds the journal
        assert held_elsewhere(journal)
        for synchronous in ("NORMAL", "FULL"):
            second = SqlStore(url, sqlite_synchronous=synchronous)
            await second.init()
            assert second.needs_peers_known is True, synchronous
            await second.close()
    finally:
        await first.close()
    assert not held_elsewhere(journal)  # the file is there, unlocked
    alone = SqlStore(url, sqlite_synchronous="FULL")
    await alone.init()
    assert alone.needs_peers_known is False
    await alone.close()
