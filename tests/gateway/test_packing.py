"""Packed `model_request` rows in the store (`store.packing`), on SQLite and PostgreSQL: rows that
grow with a call's new tokens only, every read exact, replays, restarts, and older databases."""

from __future__ import annotations

import asyncio
import base64
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import sqlalchemy as sa

from reins import recordbatch
from reins.gateway.store import Conflict, sql
from reins.gateway.store.packing import event_columns, toast_chunk
from reins.gateway.store.pragmas import SQLITE_PAGE_SIZE
from reins.gateway.store.sql import SqlStore
from reins.gateway.store.tables import events
from reins.packed import base_of
from reins.schemas import AttemptCreate, EventIn, RolloutSpec
from tests.support import PostgresServer


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[SqlStore]:
    store = SqlStore(database_url)
    await store.init()
    yield store
    await store.close()


def conversation(turns: int, seed: int = 0, observed: int = 50) -> list[dict[str, Any]]:
    """An agent's calls: each prompt is the previous prompt + response + an observation (of
    `observed` tokens), each request the previous messages + the answer + the tool's output."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 150_000, 400).tolist()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "x" * 1600}]
    out = []
    for turn in range(turns):
        response = rng.integers(0, 150_000, 30).tolist()
        answer = f"answer {turn} " * 10
        out.append(
            {
                "prompt_token_ids": prompt,
                "response_token_ids": response,
                "response_logprobs": [float(np.float32(-0.01 * i)) for i in range(30)],
                "request": {"model": "policy", "messages": messages, "temperature": 1.0},
                "response": {"choices": [{"message": {"role": "assistant", "content": answer}}]},
                "model": "policy",
                "model_version": 1,
                "status": 200,
            }
        )
        observation = rng.integers(0, 150_000, observed).tolist()
        prompt = prompt + response + observation
        messages = [
            *messages,
            {"role": "assistant", "content": answer},
            {"role": "tool", "content": f"output {turn} " * 20},
        ]
    return out


async def _open(store: SqlStore, rollout_id: str) -> None:
    await store.create_rollouts([RolloutSpec(rollout_id=rollout_id)])
    await store.open_attempt(rollout_id, AttemptCreate())


async def _post(
    store: SqlStore, rollout_id: str, calls: list[dict[str, Any]], first: int = 0
) -> None:
    for n, data in enumerate(calls, start=first):
        event = EventIn(type="model_request", data=data, idempotency_key=f"call-{n}")
        await store.append_events(rollout_id, 1, [event])


async def _rows(store: SqlStore, rollout_id: str) -> list[sa.Row[Any]]:
    """The rollout's rows, each packed one with its whole blob."""
    async with store.engine.connect() as conn:
        columns = event_columns(conn.dialect.name)
        query = sa.select(*columns).where(events.c.rollout_id == rollout_id).order_by(events.c.seq)
        return list(await conn.execute(query))


def _same(a: Any, b: Any) -> bool:
    return orjson.dumps(a) == orjson.dumps(b)


async def test_rows_grow_with_new_tokens_and_every_read_is_exact(store: SqlStore) -> None:
    calls = conversation(40)
    await _open(store, "r")
    await _post(store, "r", calls)
    rows = await _rows(store, "r")
    assert [row.packed is not None for row in rows] == [True] * 40
    # Each row names the previous call and holds only what is new: the 40th row is about the
    # size of the 2nd, while its prompt is 7x as long.
    assert [base_of(row.packed) for row in rows[1:]] == [row.seq for row in rows[:-1]]
    sizes = [len(row.packed) + len(orjson.dumps(row.data)) for row in rows]
    assert sizes[39] < 1.3 * sizes[1]
    assert len(calls[39]["prompt_token_ids"]) > 7 * len(calls[1]["prompt_token_ids"])
    assert rows[10].prompt_tokens == len(calls[10]["prompt_token_ids"])
    assert rows[10].response_tokens == 30

    stored = await store.get_events("r")
    assert [e.idempotency_key for e in stored] == [f"call-{n}" for n in range(40)]
    assert all(_same(e.data, c) for e, c in zip(stored, calls, strict=True))
    # A page that starts mid-attempt reads its bases first.
    page = await store.get_events("r", after=rows[24].seq, limit=5)
    assert [e.seq for e in page] == [row.seq for row in rows[25:30]]
    assert all(_same(e.data, c) for e, c in zip(page, calls[25:30], strict=True))
    # Prompts as int32 arrays when asked; every other field as before.
    arrays = await store.get_events("r", after=rows[24].seq, limit=5, token_arrays=True)
    for event, call in zip(arrays, calls[25:30], strict=True):
        prompt = event.data["prompt_token_ids"]
        assert isinstance(prompt, np.ndarray) and prompt.dtype == np.int32
        assert prompt.tolist() == call["prompt_token_ids"]
        assert _same({**event.data, "prompt_token_ids": prompt.tolist()}, call)
    stats = (await store.rollout_stats(["r"]))["r"]
    assert stats.prompt_tokens == sum(len(c["prompt_token_ids"]) for c in calls)
    assert stats.response_tokens == 40 * 30


async def test_every_bulk_read_restores_off_the_event_loop(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long rollout's restore is ~0.8 s of CPU: on the loop's thread it held up every other
    request (on PostgreSQL a /healthz waited 4.1 s during a dashboard page and a JSON read)."""
    await _open(store, "r")
    await _post(store, "r", conversation(3))
    threads: dict[str, str] = {}

    def on_thread(name: str, work: Any) -> Any:
        def run(*args: Any, **options: Any) -> Any:
            threads[name] = threading.current_thread().name
            return work(*args, **options)

        return run

    for name in ("restore_rows", "_packed_events", "parts_of"):
        monkeypatch.setattr(sql, name, on_thread(name, getattr(sql, name)))
    loop_thread = threading.current_thread().name
    assert len(await store.get_events("r")) == 3
    assert len(await store.get_packed_events("r")) == 3
    assert [len(parts.calls) for parts in await store.record_parts(["r"])] == [3]
    assert sorted(threads) == ["_packed_events", "parts_of", "restore_rows"]
    assert loop_thread not in threads.values()
    assert set(threads.values()) == {"reins-bulk-reads_0"}


async def test_calls_posted_together_are_packed_against_each_other(store: SqlStore) -> None:
    """A list post (a harness uploading its trajectory) and concurrent posts to one attempt
    land in one group commit: each call is still stored against the previous one, in the
    order posted, with the other events of the post between them."""
    calls = conversation(12)
    await _open(store, "listed")
    listed = [
        EventIn(type="model_request", data=c, idempotency_key=f"c{n}") for n, c in enumerate(calls)
    ]
    listed.insert(3, EventIn(type="reward", data={"value": 0.5}, idempotency_key="mid"))
    acks = await store.append_events("listed", 1, listed)
    rows = await _rows(store, "listed")
    assert [row.idempotency_key for row in rows] == [e.idempotency_key for e in listed]
    assert [row.seq for row in rows] == [a.seq for a in acks] == sorted(a.seq for a in acks)
    packed = [row for row in rows if row.type == "model_request"]
    assert [base_of(row.packed) for row in packed] == [None] + [row.seq for row in packed[:-1]]
    sizes = [len(row.packed) for row in packed]
    assert sizes[11] < 1.3 * sizes[1]
    stored = [e for e in await store.get_events("listed") if e.type == "model_request"]
    assert all(_same(e.data, c) for e, c in zip(stored, calls, strict=True))

    await _open(store, "concurrent")
    await _post(store, "concurrent", calls[:1])
    await asyncio.gather(
        *(_post(store, "concurrent", [c], first=n) for n, c in enumerate(calls[1:], 1))
    )
    rows = await _rows(store, "concurrent")
    # In whatever order the commit took them: each call after the first against an earlier
    # call of the attempt, no longer against the first call alone.
    bases = [base_of(row.packed) for row in rows]
    assert bases[0] is None and all(
        b is not None and b < row.seq for b, row in zip(bases[1:], rows[1:], strict=True)
    )
    assert len(set(bases[1:])) > 1
    assert sum(len(row.packed) for row in rows) < 0.5 * sum(
        len(orjson.dumps(c["prompt_token_ids"])) for c in calls
    )
    stored = await store.get_events("concurrent")
    by_key = {e.idempotency_key: e.data for e in stored}
    assert all(_same(by_key[f"call-{n}"], c) for n, c in enumerate(calls))


async def test_a_replay_returns_the_stored_call_and_another_call_under_its_key_conflicts(
    store: SqlStore,
) -> None:
    calls = conversation(3)
    await _open(store, "r")
    await _post(store, "r", calls)
    again = await store.append_events(
        "r", 1, [EventIn(type="model_request", data=calls[2], idempotency_key="call-2")]
    )
    assert _same(again[0].data, calls[2])
    other = {**calls[2], "prompt_token_ids": calls[2]["prompt_token_ids"][:-1]}
    # Equal in Python but another JSON document: 1.0 for 1, true for 1, -0.0 for 0.0, the keys
    # in another order.
    first = calls[2]["response_logprobs"][0]
    assert first == 0.0
    lookalikes = [
        {**calls[2], "model_version": 1.0},
        {**calls[2], "model_version": True},
        {**calls[2], "response_logprobs": [-first, *calls[2]["response_logprobs"][1:]]},
        dict(reversed(calls[2].items())),
    ]
    for data in [other, *lookalikes]:
        with pytest.raises(Conflict, match="already used"):
            await store.append_events(
                "r", 1, [EventIn(type="model_request", data=data, idempotency_key="call-2")]
            )
    reward = EventIn(type="reward", data={"value": 1, "source": "judge"}, idempotency_key="rw")
    await store.append_events("r", 1, [reward])
    for data in ({"value": 1.0, "source": "judge"}, {"source": "judge", "value": 1}):
        with pytest.raises(Conflict, match="already used"):
            await store.append_events(
                "r", 1, [EventIn(type="reward", data=data, idempotency_key="rw")]
            )
    (same,) = await store.append_events("r", 1, [reward])
    assert same.data == {"value": 1, "source": "judge"}


async def test_a_restarted_store_packs_against_the_calls_before_the_restart(
    database_url: str,
) -> None:
    calls = conversation(6)
    first = SqlStore(database_url)
    await first.init()
    await _open(first, "r")
    await _post(first, "r", calls[:3])
    await first.close()
    second = SqlStore(database_url)
    await second.init()
    try:
        await _post(second, "r", calls[3:], first=3)
        rows = await _rows(second, "r")
        assert base_of(rows[3].packed) == rows[2].seq
        stored = await second.get_events("r")
        assert all(_same(e.data, c) for e, c in zip(stored, calls, strict=True))
    finally:
        await second.close()


async def test_calls_of_two_attempts_and_other_events_stay_apart(store: SqlStore) -> None:
    calls = conversation(4)
    await _open(store, "r")
    await _post(store, "r", calls[:2])
    await store.open_attempt("r", AttemptCreate(reason="crashed"))
    posted = [
        EventIn(type="model_request", data=c, idempotency_key=f"b{n}") for n, c in enumerate(calls)
    ]
    posted.insert(2, EventIn(type="reward", data={"value": 1.0}))
    for event in posted:
        await store.append_events("r", 2, [event])
    rows = [row for row in await _rows(store, "r") if row.attempt_id == 2]
    assert base_of(rows[0].packed) is None  # attempt 1's calls are not bases of attempt 2
    assert rows[2].packed is None and rows[2].data == {"value": 1.0}
    stored = await store.get_events("r", types=["model_request"])
    assert all(_same(e.data, c) for e, c in zip(stored, calls, strict=True))
    assert len(await store.get_events("r", attempt_id=1)) == 2


async def test_a_database_from_before_packing_is_migrated_and_its_rows_read_whole(
    database_url: str,
) -> None:
    calls = conversation(4)
    old = SqlStore(database_url)
    await old.init()
    await _open(old, "r")
    await _post(old, "r", calls[:2])
    async with old.engine.begin() as conn:  # as an older reins wrote them: whole, no columns
        await conn.execute(sa.delete(events))
        for column in ("packed", "prompt_tokens", "response_tokens", "packed_head"):
            await conn.execute(sa.text(f"ALTER TABLE events DROP COLUMN {column}"))
        for n, data in enumerate(calls[:2]):
            await conn.execute(
                sa.text(
                    "INSERT INTO events (rollout_id, attempt_id, type, data, idempotency_key, "
                    "created_at) VALUES ('r', 1, 'model_request', :data, :key, 0)"
                ),
                {"data": orjson.dumps(data).decode(), "key": f"call-{n}"},
            )
    await old.close()
    store = SqlStore(database_url)
    await store.init()
    try:
        await _post(store, "r", calls[2:], first=2)
        rows = await _rows(store, "r")
        assert [row.packed is None for row in rows] == [True, True, False, False]
        stored = await store.get_events("r")
        assert all(_same(e.data, c) for e, c in zip(stored, calls, strict=True))
        stats = (await store.rollout_stats(["r"]))["r"]
        assert stats.prompt_tokens == sum(len(c["prompt_token_ids"]) for c in calls)
    finally:
        await store.close()


async def test_rows_of_packed_format_1_are_read_and_new_calls_packed_against_them(
    store: SqlStore,
) -> None:
    """A database written by reins before packed format 2 (rows from
    tests/fixtures/packed_format1.json, written by reins at b1cd759): its calls read back
    exactly, the record read decodes them, and the next call is packed against the last one."""
    fixture = Path(__file__).parents[1] / "fixtures" / "packed_format1.json"
    rows = orjson.loads(fixture.read_bytes())["rows"]
    await _open(store, "r")
    async with store.engine.begin() as conn:
        for row in rows:
            blob = base64.b64decode(row["packed"])
            await conn.execute(
                sa.insert(events).values(
                    seq=row["seq"],
                    rollout_id="r",
                    attempt_id=1,
                    type="model_request",
                    data=row["skeleton"],
                    idempotency_key=f"call-{row['seq'] - 1}",
                    created_at=0.0,
                    packed=blob,
                    prompt_tokens=len(row["data"]["prompt_token_ids"]),
                    response_tokens=len(row["data"]["response_token_ids"]),
                )
            )
        if conn.dialect.name == "postgresql":  # explicit seqs do not move the sequence
            await conn.execute(sa.text("SELECT setval(pg_get_serial_sequence('events', 'seq'), 4)"))
    following = conversation_of_fixture(rows)
    await _post(store, "r", [following], first=len(rows))
    stored = await _rows(store, "r")
    assert [row.packed[0] for row in stored] == [1, 1, 1, 1, 2]  # each blob's format
    assert base_of(stored[4].packed) == stored[3].seq
    restored = await store.get_events("r")
    expected = [row["data"] for row in rows] + [following]
    assert all(_same(e.data, c) for e, c in zip(restored, expected, strict=True))
    (parts,) = await store.record_parts(["r"])
    (decoded,) = recordbatch.decode(recordbatch.encode([parts]))
    assert [c.prompt.tolist() for c in decoded.calls] == [c["prompt_token_ids"] for c in expected]


def conversation_of_fixture(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The call after the fixture's last: its prompt + response + an observation."""
    last = rows[-1]["data"]
    prompt = last["prompt_token_ids"] + last["response_token_ids"] + [5, 6, 7]
    return {**last, "prompt_token_ids": prompt, "response_token_ids": [8, 9]} | {
        "response_logprobs": [-0.5, -0.25]
    }


async def test_a_new_sqlite_database_has_64_kb_pages_and_an_older_one_keeps_its_own(
    tmp_path: Path,
) -> None:
    """Packed calls of ~3 KB fill 64 KB pages; 4 KB ones held one each (docs/benchmarks.md)."""
    older = tmp_path / "older.db"
    with sqlite3.connect(older) as conn:  # as SQLite's default made it
        conn.execute("PRAGMA page_size=4096")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE unrelated (x)")
    for path, pages in ((tmp_path / "new.db", SQLITE_PAGE_SIZE), (older, 4096)):
        store = SqlStore(f"sqlite+aiosqlite:///{path}")
        await store.init()
        try:
            await _open(store, "r")
            await _post(store, "r", conversation(3))
            assert len(await store.get_events("r")) == 3
            async with store.engine.connect() as conn:  # the WAL stays ~4 MB between checkpoints
                frames = (await conn.execute(sa.text("PRAGMA wal_autocheckpoint"))).scalar()
            assert frames == 4 * 2**20 // pages
        finally:
            await store.close()
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA page_size").fetchone()[0] == pages


async def _assert_read_exactly(store: SqlStore, calls: list[dict[str, Any]]) -> None:
    """Rollout "r" reads back as `calls`, through the JSON read and the trainer's."""
    stored = await store.get_events("r")
    assert all(_same(e.data, c) for e, c in zip(stored, calls, strict=True))
    (parts,) = await store.record_parts(["r"])
    (decoded,) = recordbatch.decode(recordbatch.encode([parts]))
    assert [c.prompt.tolist() for c in decoded.calls] == [c["prompt_token_ids"] for c in calls]


async def _toast_figures(store: SqlStore) -> dict[str, Any]:
    async with store.engine.connect() as conn:
        storage = await conn.execute(
            sa.text(
                "SELECT attname, attstorage::text FROM pg_attribute "
                "WHERE attrelid = 'events'::regclass AND attname IN ('packed', 'packed_head')"
            )
        )
        parts = await conn.execute(
            sa.select(events.c.packed_head, events.c.packed)
            .where(events.c.packed.is_not(None))
            .order_by(events.c.seq)
        )
        return {
            "storage": {name: str(kind) for name, kind in storage},
            "parts": [(head, rest) for head, rest in parts],
            "chunk": await conn.scalar(
                sa.text("SELECT max_toast_chunk_size FROM pg_control_init()")
            ),
            "toast_bytes": await conn.scalar(
                sa.text(
                    "SELECT pg_relation_size(reltoastrelid) FROM pg_class "
                    "WHERE oid = 'events'::regclass"
                )
            ),
        }


@pytest.mark.slow
async def test_postgresql_keeps_whole_toast_chunks_out_of_the_row_and_the_rest_in_it(
    postgres: PostgresServer,
) -> None:
    """A blob in one column left each TOAST page ~1.3 KB short (its last chunk partial): TOAST
    held 1.13-1.26x the blobs' bytes. Split, TOAST holds whole chunks only, each page full."""
    store = SqlStore(postgres.create_database("split"))
    await store.init()
    try:
        calls = conversation(60, observed=1500)  # ~3.4 KB blobs: a chunk and a part of one
        await _open(store, "r")
        await _post(store, "r", calls)
        figures = await _toast_figures(store)
        assert figures["storage"] == {"packed": "m", "packed_head": "e"}
        chunk = figures["chunk"]
        assert toast_chunk(8192) == chunk == 1996  # the formula, against the server's own
        heads = [len(head) for head, _ in figures["parts"] if head is not None]
        assert len(figures["parts"]) == 60
        assert len(heads) == 59  # all but the first call's: under a chunk, all in the row
        assert all(n % chunk == 0 for n in heads)
        assert all(len(rest) < chunk for _, rest in figures["parts"])
        # 4 tuples of a chunk each to an 8 KB page, 2,032 bytes with their headers: 98 %.
        assert figures["toast_bytes"] <= sum(heads) * 1.03 + 8192
        await _assert_read_exactly(store, calls)
    finally:
        await store.close()


@pytest.mark.slow
async def test_a_postgresql_database_from_before_the_split_reads_its_whole_blobs(
    postgres: PostgresServer,
) -> None:
    """Rows stored with the blob in one column (no `packed_head`, the storage PostgreSQL gives
    a new column) read back exactly after the migration, and the next calls are split and
    packed against them."""
    url = postgres.create_database("before_split")
    calls = conversation(6, observed=1500)
    old = SqlStore(url)
    await old.init()
    old._packer.toast_chunk = None  # as reins stored them before the split
    await _open(old, "r")
    await _post(old, "r", calls[:3])
    async with old.engine.begin() as conn:
        await conn.execute(sa.text("ALTER TABLE events DROP COLUMN packed_head"))
        await conn.execute(sa.text("ALTER TABLE events ALTER COLUMN packed SET STORAGE EXTENDED"))
    await old.close()
    store = SqlStore(url)
    await store.init()
    try:
        await _post(store, "r", calls[3:], first=3)
        figures = await _toast_figures(store)
        assert figures["storage"] == {"packed": "m", "packed_head": "e"}
        heads = [head for head, _ in figures["parts"]]
        assert heads[:3] == [None] * 3 and all(head is not None for head in heads[3:])
        assert all(len(rest) > figures["chunk"] for _, rest in figures["parts"][1:3])  # whole
        rows = await _rows(store, "r")
        assert base_of(rows[3].packed) == rows[2].seq  # packed against a call stored whole
        await _assert_read_exactly(store, calls)
    finally:
        await store.close()
