"""Where SQLite's group commits run. By default in a writer process of their own
(`reins.gateway.store.writer.ProcessWriter`): started by the store's `init`, started again by
the next commit after it died, gone when the store closes or the gateway dies. With the writer
thread (an in-memory database, or when asked): a lone small commit on the event loop's thread
(no hand-over to the writer thread and back), commits with posts queued behind them in the
writer thread. Either way every event is stored once and its post answered with its own seq."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from reins.gateway.store import Conflict
from reins.gateway.store import writer as writer_module
from reins.gateway.store.appends import Commit, pack_and_insert
from reins.gateway.store.pragmas import sqlite_engine
from reins.gateway.store.sql import SqlStore
from reins.gateway.store.writer import ProcessWriter, ThreadWriter, WriterStopped
from reins.packed import base_of
from reins.schemas import AttemptCreate, EventIn, RolloutSpec
from tests.support import PostgresServer, alive, descendants, running_gateway


async def _open_store(path: Path, event_writer: Any) -> SqlStore:
    sql_store = SqlStore(f"sqlite+aiosqlite:///{path}", event_writer=event_writer)
    await sql_store.init()
    await sql_store.create_rollouts([RolloutSpec(rollout_id="r")])
    await sql_store.open_attempt("r", AttemptCreate())
    return sql_store


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlStore]:
    """A store whose commits run in the writer thread."""
    sql_store = await _open_store(tmp_path / "gateway.db", "thread")
    yield sql_store
    await sql_store.close()


@pytest.fixture
async def process_store(tmp_path: Path) -> AsyncIterator[SqlStore]:
    """A store whose commits run in a writer process (the default)."""
    sql_store = await _open_store(tmp_path / "gateway.db", "process")
    yield sql_store
    await sql_store.close()


def _threads_of_commits(store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    assert isinstance(store._writer, ThreadWriter)
    return _threads_of_commits_on(store._writer, monkeypatch)


def _threads_of_commits_on(writer: ThreadWriter, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    names: list[str] = []
    write = writer.write_now

    def spied(*args: Any) -> Any:
        names.append(threading.current_thread().name)
        return write(*args)

    monkeypatch.setattr(writer, "write_now", spied)
    return names


def _call(n: int) -> dict[str, Any]:
    """Call n of a conversation: its prompt extends call n-1's prompt + response."""
    return {
        "prompt_token_ids": list(range(3 * n + 1)),
        "response_token_ids": [3 * n + 1, 3 * n + 2],
        "response_logprobs": [-0.5, -0.25],
        "status": 200,
    }


async def _packed_bases(store: SqlStore) -> list[int | None]:
    async with store.engine.connect() as conn:
        blobs = (await conn.exec_driver_sql("SELECT packed FROM events ORDER BY seq")).scalars()
        return [base_of(blob) for blob in blobs]


def _until(condition: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)  # polling /proc, bounded by the deadline


async def test_commits_run_in_a_writer_process_that_ends_with_the_store(
    tmp_path: Path,
) -> None:
    sql_store = await _open_store(tmp_path / "gateway.db", "process")
    writer = sql_store._writer
    assert isinstance(writer, ProcessWriter)
    acks = await asyncio.gather(*(sql_store.append_events("r", 1, _calls(n, 1)) for n in range(20)))
    pid = writer.pid
    assert pid is not None and pid != os.getpid() and alive(pid)
    stored = await sql_store.get_events("r", attempt_id=1)
    assert {event.idempotency_key: event.seq for event in stored} == {
        ack[0].idempotency_key: ack[0].seq for ack in acks
    }
    assert [event.data for event in stored] == [_call(int(e.idempotency_key[1:])) for e in stored]
    # Packed in the writer, each call but the first against an earlier one.
    bases = await _packed_bases(sql_store)
    assert len(bases) == 20 and bases.count(None) == 1
    await sql_store.close()
    _until(lambda: not alive(pid), "the writer process outlived its store")


def _calls(first: int, count: int = 5) -> list[EventIn]:
    """Calls first.. of the conversation, keyed: a post of 5 (over `_INLINE_MAX_ROWS`) goes to
    the writer process, not the loop's thread."""
    return [
        EventIn(type="model_request", data=_call(n), idempotency_key=f"k{n}")
        for n in range(first, first + count)
    ]


def _kill_with_a_commit_in_its_socket(store: SqlStore, post: EventIn | list[EventIn]) -> Any:
    """Stops the writer so that it cannot read the next commit, posts, and kills the writer
    once that commit is in its socket: (the post's task, the killed pid)."""
    writer = store._writer
    assert isinstance(writer, ProcessWriter) and writer.pid is not None
    pid = writer.pid
    os.kill(pid, signal.SIGSTOP)
    events = post if isinstance(post, list) else [post]
    task = asyncio.create_task(store.append_events("r", 1, events))
    return task, pid


async def _sent_then_killed(writer: ProcessWriter, pid: int) -> None:
    deadline = time.monotonic() + 10
    while not writer._answers:
        assert time.monotonic() < deadline, "the commit never reached the writer's socket"
        await asyncio.sleep(0)
    os.kill(pid, signal.SIGKILL)


async def test_a_commit_whose_writer_was_killed_before_it_is_stored_by_a_new_writer(
    process_store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    writer = process_store._writer
    assert isinstance(writer, ProcessWriter)
    first = await process_store.append_events("r", 1, _calls(0))
    post, pid = _kill_with_a_commit_in_its_socket(process_store, _calls(5))
    await _sent_then_killed(writer, pid)
    second = await post  # answered: sent again to a new writer, which stored it
    assert f"process {pid} ended during a commit" in caplog.text
    assert writer.pid not in (None, pid)
    _until(lambda: not alive(pid), "the killed writer is still there")
    replayed = await process_store.append_events("r", 1, _calls(5))
    assert [e.seq for e in replayed] == [e.seq for e in second]
    assert min(e.seq for e in second) > max(e.seq for e in first)
    stored = await process_store.get_events("r", attempt_id=1)
    assert [event.seq for event in stored] == [e.seq for e in first + second]
    assert [event.data for event in stored] == [_call(n) for n in range(10)]
    # Packed against the earlier calls: the new writer rebuilt its bases from the rows.
    bases = await _packed_bases(process_store)
    assert bases[0] is None and all(b is not None for b in bases[1:])


async def test_a_commit_whose_writer_died_after_committing_is_answered_with_what_it_stored(
    process_store: SqlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite committed it, the writer died before its answer: the commit sent again stores
    nothing twice and answers the stored events. (The commit that landed is made here, on
    the same file, by the writer's own code; a kill landing between a real writer's COMMIT
    and its answer cannot be timed from a test.) Answered 503 instead, the harness's retry of
    a proxied call stored it twice, under a new key."""
    writer = process_store._writer
    assert isinstance(writer, ProcessWriter)
    await process_store.append_events("r", 1, _calls(0))
    sent: list[Commit] = []
    as_sent = writer_module._as_sent
    monkeypatch.setattr(writer_module, "_as_sent", lambda c: sent.append(c) or as_sent(c))
    post, pid = _kill_with_a_commit_in_its_socket(process_store, _calls(5))
    await _sent_then_killed(writer, pid)
    landed = ThreadWriter(str(tmp_path / "gateway.db"), "NORMAL")
    try:
        stored_first = landed.write_now(sent[-1])  # the loop has not run since the kill
    finally:
        await landed.close()
    acks = await post
    assert len(sent) == 2  # sent again
    assert [(e.seq, e.idempotency_key) for e in acks] == [
        (seq, key) for seq, _, _, key in stored_first.inserted
    ]
    stored = await process_store.get_events("r", attempt_id=1)
    assert [event.data for event in stored] == [_call(n) for n in range(10)]


def test_a_writer_that_ends_as_it_starts_is_a_writer_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between its fork and the gateway's pidfd of it: its commit is not acknowledged
    (`WriterStopped`: 503), as for a writer that dies later, not a bare error (500)."""
    channels: list[Any] = []

    def gone(pid: int) -> int:
        raise ProcessLookupError(pid)

    real_socketpair = writer_module.socket.socketpair

    def kept(*args: Any) -> Any:
        pair = real_socketpair(*args)
        channels.append(pair[0])
        return pair

    monkeypatch.setattr(writer_module.os, "pidfd_open", gone)
    monkeypatch.setattr(writer_module.socket, "socketpair", kept)
    fork_server = writer_module._ForkServer()
    with pytest.raises(WriterStopped, match="ended as it started"):
        fork_server.fork_writer(str(tmp_path / "g.db"), "NORMAL")
    assert channels[-1].fileno() == -1  # its channel closed: the writer reads its end and goes
    assert fork_server._control is not None and fork_server._process is not None
    fork_server._control.close()  # as when the gateway goes: the fork server ends
    assert fork_server._process.wait(timeout=30) is not None


def test_the_fork_server_ends_quietly_when_the_gateway_goes_before_its_reply(
    tmp_path: Path,
) -> None:
    """A gateway killed while it asks for a writer: the fork server's reply finds the socket
    closed; it ends without a traceback on the gateway's terminal."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    code = f"import {writer_module.__name__} as w; w.fork_server({theirs.fileno()})"
    server = subprocess.Popen(
        [sys.executable, "-c", code], pass_fds=[theirs.fileno()], stderr=subprocess.PIPE
    )
    theirs.close()
    gateway_end, writer_end = socket.socketpair()
    request = pickle.dumps((str(tmp_path / "g.db"), "NORMAL"))
    socket.send_fds(ours, [request], [writer_end.fileno()])
    writer_end.close()
    ours.close()  # before the server read the request: its reply cannot be sent
    gateway_end.close()  # the writer it forks reads the end and goes (it shares the stderr)
    _, stderr = server.communicate(timeout=30)
    assert server.returncode == 0
    assert b"Traceback" not in stderr, stderr.decode()


async def test_lone_commits_run_on_the_loop_and_the_rest_in_the_writer_process(
    process_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone small commit skips the hand-over (`inline`); each side packs against the calls
    it remembers or reads back, so every call but the first still names an earlier one."""
    writer = process_store._writer
    assert isinstance(writer, ProcessWriter)
    threads = _threads_of_commits_on(writer._here, monkeypatch)
    lone = [EventIn(type="model_request", data=_call(0), idempotency_key="k0")]
    await process_store.append_events("r", 1, lone)  # on the loop's thread
    await process_store.append_events("r", 1, _calls(1))  # in the writer process
    await process_store.append_events("r", 1, _calls(6, 1))  # on the loop's thread again
    assert threads == [threading.current_thread().name] * 2
    stored = await process_store.get_events("r", attempt_id=1)
    assert [event.data for event in stored] == [_call(n) for n in range(7)]
    seqs = [event.seq for event in stored]
    bases = await _packed_bases(process_store)
    assert bases[0] is None
    assert all(
        base is not None and base < seq for base, seq in zip(bases[1:], seqs[1:], strict=True)
    )


async def test_with_another_gateway_on_the_file_no_commit_runs_on_the_loop(
    process_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other gateway's commit holds SQLite's lock: a commit on the loop's thread would
    stop every request of this gateway while it waits."""
    writer = process_store._writer
    assert isinstance(writer, ProcessWriter)
    threads = _threads_of_commits_on(writer._here, monkeypatch)
    await process_store.set_peers(1)
    lone = [EventIn(type="model_request", data=_call(0), idempotency_key="k0")]
    await process_store.append_events("r", 1, lone)
    assert threads == []  # in the writer process
    await process_store.set_peers(0)
    await process_store.append_events("r", 1, _calls(1, 1))
    assert threads == [threading.current_thread().name]


async def test_journaled_calls_commit_on_a_thread_of_the_gateways_process(
    process_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxied call answered from the call journal is committed beside the loop, not handed
    to the writer process: nobody waits for that commit, and the hand-over cost each call
    ~0.15 ms of the CPU the engine shares."""
    writer = process_store._writer
    assert isinstance(writer, ProcessWriter)
    threads = _threads_of_commits_on(writer._here, monkeypatch)
    sent: list[Commit] = []
    as_sent = writer_module._as_sent
    monkeypatch.setattr(writer_module, "_as_sent", lambda c: sent.append(c) or as_sent(c))
    lone = [EventIn(type="model_request", data=_call(0), idempotency_key="k0")]
    # A harness's post: its commit checks the attempt and sees it open.
    await process_store.append_events("r", 1, lone, from_harness=True)
    for n in (1, 2, 3):
        calls = [EventIn(type="model_request", data=_call(n), idempotency_key=f"k{n}")]
        await process_store.record_calls("r", 1, calls)
    assert process_store._journal is not None and process_store._journal.size > 0
    stored = await process_store.get_events("r", attempt_id=1)  # waits for the journaled calls
    assert [event.data for event in stored] == [_call(n) for n in range(4)]
    loop_thread = threading.current_thread().name
    assert threads[0] == loop_thread
    assert len(threads) >= 2  # the journaled calls' commits: one, or more
    assert all(name.startswith("reins-events") for name in threads[1:]), threads
    assert sent == []
    bases = await _packed_bases(process_store)
    assert bases[0] is None and all(base is not None for base in bases[1:])


@pytest.mark.slow
def test_a_real_gateways_writer_takes_a_large_commit_and_ends_with_the_gateway(
    tmp_path: Path,
) -> None:
    """`reins gateway` (uvicorn's loop): a commit of 8 MB reaches its writer whole (a blocking
    send on the socket, which that loop made non-blocking, failed with EAGAIN past the socket's
    buffer); then SIGKILL of the gateway: its writer process (and the fork server it came from)
    read the end of their sockets and exit, nothing of the gateway keeps the database open."""
    import httpx

    with running_gateway(f"sqlite:///{tmp_path / 'gateway.db'}", "kill-key") as gateway:
        headers = {"Authorization": "Bearer kill-key"}
        with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
            http.post("/api/rollouts", json=[{"rollout_id": "r"}]).raise_for_status()
            http.post("/api/rollouts/r/attempts").raise_for_status()
            large = [{"type": "log", "data": {"i": i, "text": "x" * 8000}} for i in range(1000)]
            acks = http.post("/api/rollouts/r/attempt/1/events", json=large)
            assert acks.status_code == 200, acks.text
            assert [ack["seq"] for ack in acks.json()] == list(range(1, 1001))
            page = http.get("/api/rollouts/r/events", params={"after": 990, "limit": 5}).json()
            assert [event["data"]["i"] for event in page] == [990, 991, 992, 993, 994]
        assert gateway.process is not None
        children = descendants(gateway.process.pid)
        # The fork server and the writer it forked.
        assert len(children) == 2
        gateway.kill()
        _until(lambda: not any(alive(pid) for pid in children), "a writer outlived its gateway")


@pytest.mark.slow
def test_a_sigterm_to_the_gateways_process_group_stops_it_quietly(tmp_path: Path) -> None:
    """A service manager stops the whole group (systemd, a container's init): the writer used
    to end at once and the gateway's shutdown logged "the event writer process N ended". Now
    the gateway stops first, and its writer and fork server end with it."""
    import httpx

    with running_gateway(f"sqlite:///{tmp_path / 'gateway.db'}", "term-key") as gateway:
        headers = {"Authorization": "Bearer term-key"}
        with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
            http.post("/api/rollouts", json=[{"rollout_id": "r"}]).raise_for_status()
            http.post("/api/rollouts/r/attempts").raise_for_status()
            logs = [{"type": "log", "data": {"i": i}} for i in range(20)]
            http.post("/api/rollouts/r/attempt/1/events", json=logs).raise_for_status()
        assert gateway.process is not None and gateway.log_path is not None
        children = descendants(gateway.process.pid)
        assert len(children) == 2  # the fork server and its writer
        os.killpg(gateway.process.pid, signal.SIGTERM)  # its own session: the group's id
        # uvicorn stops gracefully, then raises the signal again to end as it would have.
        assert gateway.process.wait(timeout=30) == -signal.SIGTERM
        said = gateway.log_path.read_text()
        _until(lambda: not any(alive(pid) for pid in children), "a writer outlived its gateway")
    assert "event writer process" not in said, said
    assert "Traceback" not in said, said


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


def test_the_event_connection_keeps_statement_journals_in_memory(tmp_path: Path) -> None:
    """SQLite's default puts each commit's statement journal in a temp file (created, written,
    unlinked: ~9 system calls a commit); the event connection keeps it in memory (2)."""
    path = str(tmp_path / "gateway.db")
    for_events, other = (sqlite_engine(path, "NORMAL", for_events=kind) for kind in (True, False))
    try:
        for engine, expected in ((for_events, 2), (other, 0)):
            with engine.connect() as conn:
                (temp_store,) = conn.exec_driver_sql("PRAGMA temp_store").one()
            assert temp_store == expected
    finally:
        for_events.dispose()
        other.dispose()


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
            await conn.run_sync(
                pack_and_insert, first._insert, first._packer, Commit([rows], [False], set())
            )
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
            await conn.run_sync(
                pack_and_insert, first._insert, first._packer, Commit([rows], [False], set())
            )
            post = asyncio.create_task(second.append_events("r", 1, reused))
            await asyncio.sleep(1.0)
        with pytest.raises(Conflict, match="nothing of this post was stored"):
            await post
        stored = await second.get_events("r")
        assert [(event.idempotency_key, event.data) for event in stored] == [("k", {"v": 1})]


@pytest.mark.parametrize(("setting", "kind"), [(None, ProcessWriter), ("thread", ThreadWriter)])
def test_the_gateways_setting_chooses_where_event_commits_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | None, kind: type
) -> None:
    from reins.gateway.app import create_app
    from reins.gateway.settings import GatewaySettings

    if setting is not None:
        monkeypatch.setenv("REINS_SQLITE_EVENT_WRITER", setting)
    app = create_app(GatewaySettings(database_url=f"sqlite:///{tmp_path / 'gateway.db'}"))
    assert type(app.state.store._writer) is kind
