"""`SqlStore`: the store on SQLAlchemy 2 async, SQLite (aiosqlite, WAL) or PostgreSQL (asyncpg).

Two choices carry the performance and the guarantees:
- Event appends are group-committed: concurrent posts are queued and written by one task in one
  transaction, and every post is answered only after that transaction committed. A killed gateway
  therefore loses no acknowledged event, and 16 clients cost a handful of commits, not 16.
- Rollout changes take the next value of one counter row inside their transaction. The row lock
  orders commits by sequence number, so a reader following `change_seq` never skips a change
  that commits late (the list cursor is safe on PostgreSQL too, not only on SQLite's single writer).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pydantic_core
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from reins.gateway.store import Conflict, NotFound, RolloutQuery, RolloutStats
from reins.schemas import (
    MODEL_REQUEST,
    REWARD,
    TERMINAL_STATES,
    VALID_TRANSITIONS,
    Attempt,
    AttemptCreate,
    Event,
    EventIn,
    Mode,
    Model,
    ModelEndpointIn,
    Rollout,
    RolloutConfig,
    RolloutDetail,
    RolloutPage,
    RolloutSpec,
    RolloutState,
    RolloutStatus,
    RolloutUpdate,
)

metadata = sa.MetaData()
# Plain `json`, not `jsonb`, on PostgreSQL: jsonb rejects "\u0000", which harness text can carry.
_json = sa.JSON()
_big_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

rollouts = sa.Table(
    "rollouts",
    metadata,
    sa.Column("rollout_id", sa.String(200), primary_key=True),
    sa.Column("input", _json),
    sa.Column("group_id", sa.String(200), index=True),
    sa.Column("mode", sa.String(8), nullable=False),
    sa.Column("metadata", _json, nullable=False),
    sa.Column("config", _json, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("attempt_count", sa.Integer, nullable=False),
    sa.Column("change_seq", sa.BigInteger, nullable=False, unique=True),
    sa.Column("spec_digest", sa.String(64), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Index("ix_rollouts_state_change", "state", "change_seq"),
)

attempts = sa.Table(
    "attempts",
    metadata,
    sa.Column("rollout_id", sa.String(200), primary_key=True),
    sa.Column("attempt_id", sa.Integer, primary_key=True),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("ended_at", sa.Float),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("seq", _big_id, primary_key=True, autoincrement=True),
    sa.Column("rollout_id", sa.String(200), nullable=False),
    sa.Column("attempt_id", sa.Integer, nullable=False),
    sa.Column("type", sa.String(100), nullable=False),
    sa.Column("data", _json, nullable=False),
    sa.Column("idempotency_key", sa.String(200), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.UniqueConstraint("rollout_id", "attempt_id", "idempotency_key", name="uq_events_key"),
)

models = sa.Table(
    "models",
    metadata,
    sa.Column("model", sa.String(200), primary_key=True),
    sa.Column("endpoint", sa.String(2000), primary_key=True),
    sa.Column("engine", sa.String(100), nullable=False),
    sa.Column("weight_version", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

counters = sa.Table(
    "counters",
    metadata,
    sa.Column("name", sa.String(50), primary_key=True),
    sa.Column("value", sa.BigInteger, nullable=False),
)

meta = sa.Table(
    "meta",
    metadata,
    sa.Column("key", sa.String(50), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

_ROLLOUT_CHANGE = "rollout_change"
_MAX_EVENTS_PER_COMMIT = 2000


def _ts(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def _digest(spec: RolloutSpec) -> str:
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _rollout(row: sa.Row[Any]) -> Rollout:
    return Rollout(
        rollout_id=row.rollout_id,
        input=row.input,
        group_id=row.group_id,
        mode=row.mode,
        metadata=row.metadata,
        config=RolloutConfig.model_validate(row.config),
        status=RolloutStatus(state=row.state, reason=row.reason),
        attempt_count=row.attempt_count,
        change_seq=row.change_seq,
        created_at=_ts(row.created_at),
        updated_at=_ts(row.updated_at),
    )


def _attempt(row: sa.Row[Any]) -> Attempt:
    return Attempt(
        rollout_id=row.rollout_id,
        attempt_id=row.attempt_id,
        state=row.state,
        reason=row.reason,
        created_at=_ts(row.created_at),
        ended_at=None if row.ended_at is None else _ts(row.ended_at),
    )


def _event(row: sa.Row[Any]) -> Event:
    # Rows are the store's own, validated when they came in: no second validation.
    return Event.model_construct(
        seq=row.seq,
        rollout_id=row.rollout_id,
        attempt_id=row.attempt_id,
        type=row.type,
        data=row.data,
        idempotency_key=row.idempotency_key,
        created_at=_ts(row.created_at),
    )


def _unless_nul(column: sa.Column[Any], expr: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """`expr` on a PostgreSQL json column, NULL where the document holds "\\u0000": PostgreSQL
    stores it but any JSON operator on that document fails ("unsupported Unicode escape
    sequence"). Those rows are left out of run filters and per-rollout token counts."""
    return sa.case((sa.func.strpos(sa.cast(column, sa.Text), "\\u0000") > 0, None), else_=expr)


def _rollout_filters(
    states: Sequence[RolloutState],
    mode: Mode | None,
    group_id: str | None,
    run: str | None,
    search: str | None,
    *,
    sqlite: bool,
) -> list[sa.ColumnElement[bool]]:
    where: list[sa.ColumnElement[bool]] = []
    if "\x00" in (run or "") + (search or ""):
        return [sa.false()]  # PostgreSQL text cannot hold NUL, so no rollout can match
    if states:
        where.append(rollouts.c.state.in_(list(states)))
    if mode is not None:
        where.append(rollouts.c.mode == mode)
    if group_id is not None:
        where.append(rollouts.c.group_id == group_id)
    if run is not None:
        if sqlite:
            where.append(rollouts.c.metadata["run"].as_string() == run)
        else:
            where.append(
                _unless_nul(rollouts.c.metadata, rollouts.c.metadata["run"].as_string()) == run
            )
    if search:
        # The input is stored as JSON text, where non-ASCII characters are escaped: match both.
        needles = {search, json.dumps(search)[1:-1]}
        text = sa.cast(rollouts.c.input, sa.Text)
        where.append(
            sa.or_(
                rollouts.c.rollout_id.icontains(search, autoescape=True),
                *(text.icontains(needle, autoescape=True) for needle in needles),
            )
        )
    return where


def _install_sqlite_pragmas(engine: sa.Engine, synchronous: str) -> None:
    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.execute("PRAGMA busy_timeout=10000")
        cursor.close()


def _insert_events(
    conn: sa.Connection, insert: Any, rows: list[dict[str, Any]]
) -> tuple[list[tuple[int, str, int, str]], list[sa.Row[Any]]]:
    """One INSERT of fresh events; returns (seq, rollout, attempt, key) of those inserted and the
    stored rows of keys that were already there (replayed posts)."""
    inserted = [
        (row.seq, row.rollout_id, row.attempt_id, row.idempotency_key)
        for row in conn.execute(
            insert(events)
            .on_conflict_do_nothing(index_elements=["rollout_id", "attempt_id", "idempotency_key"])
            .returning(
                events.c.seq, events.c.rollout_id, events.c.attempt_id, events.c.idempotency_key
            ),
            rows,
        )
    ]
    done = {(r, a, k) for _, r, a, k in inserted}
    by_attempt: dict[tuple[str, int], list[str]] = {}
    for row in rows:
        key = (row["rollout_id"], row["attempt_id"], row["idempotency_key"])
        if key not in done:
            by_attempt.setdefault(key[:2], []).append(key[2])
    replayed: list[sa.Row[Any]] = []
    for (rollout_id, attempt_id), keys in by_attempt.items():
        # Equality on the first two columns, so the whole unique index serves the lookup.
        for start in range(0, len(keys), 5000):
            replayed.extend(
                conn.execute(
                    sa.select(events).where(
                        events.c.rollout_id == rollout_id,
                        events.c.attempt_id == attempt_id,
                        events.c.idempotency_key.in_(keys[start : start + 5000]),
                    )
                )
            )
    return inserted, replayed


@dataclass
class _Append:
    """One event post waiting for the group commit."""

    rollout_id: str
    attempt_id: int
    rows: list[dict[str, Any]]
    done: asyncio.Future[list[Event]]
    results: dict[str, Event] = field(default_factory=dict)


class SqlStore:
    """The `Store` on SQLite or PostgreSQL, chosen by the URL."""

    def __init__(self, url: str, *, sqlite_synchronous: str = "NORMAL") -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            path = url.split(":///", 1)[1]
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.engine: AsyncEngine = create_async_engine(url)
            # Event appends, the hot path, run whole in one thread on a plain sqlite3 connection:
            # one thread hop per group commit instead of one per statement through aiosqlite.
            self._event_engine: sa.Engine | None = sa.create_engine(
                "sqlite:///" + path,
                connect_args={"check_same_thread": False},
                pool_size=1,
                # pydantic-core's encoder: ~15 us per 2 KB event against ~75 us for json.dumps.
                json_serializer=lambda value: pydantic_core.to_json(value).decode(),
            )
            self._event_thread: ThreadPoolExecutor | None = ThreadPoolExecutor(
                1, thread_name_prefix="reins-events"
            )
            for engine in (self.engine.sync_engine, self._event_engine):
                _install_sqlite_pragmas(engine, sqlite_synchronous)
        else:
            self.engine = create_async_engine(url, pool_size=10, max_overflow=10)
            self._event_engine = None
            self._event_thread = None
        self._insert = sqlite.insert if self.is_sqlite else postgresql.insert
        # SQLite has one writer: serialize our writes here instead of spinning on SQLITE_BUSY.
        self._write_lock = asyncio.Lock() if self.is_sqlite else None
        self._pending: deque[_Append] = deque()
        # Attempts are never deleted, so an attempt seen once can skip the existence check.
        self._known_attempts: set[tuple[str, int]] = set()
        self._flusher: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        lock = self._write_lock or contextlib.nullcontext()
        async with lock, self.engine.begin() as conn:
            yield conn

    async def init(self) -> None:
        async with self._write() as conn:
            await conn.run_sync(metadata.create_all)
            await conn.execute(
                self._insert(counters)
                .values(name=_ROLLOUT_CHANGE, value=0)
                .on_conflict_do_nothing(index_elements=["name"])
            )
            await conn.execute(
                self._insert(meta)
                .values(key="token_secret", value=secrets.token_hex(32))
                .on_conflict_do_nothing(index_elements=["key"])
            )

    async def close(self) -> None:
        if self._flusher is not None:
            with contextlib.suppress(Exception):
                await self._flusher
        await self.engine.dispose()
        if self._event_engine is not None and self._event_thread is not None:
            self._event_thread.shutdown(wait=True)
            self._event_engine.dispose()

    async def token_secret(self) -> bytes:
        async with self.engine.connect() as conn:
            value = await conn.scalar(sa.select(meta.c.value).where(meta.c.key == "token_secret"))
        if value is None:
            raise RuntimeError("the store is not initialized: call init() first")
        return bytes.fromhex(value)

    async def _next_change_seqs(self, conn: AsyncConnection, count: int) -> range:
        last = await conn.scalar(
            sa.update(counters)
            .where(counters.c.name == _ROLLOUT_CHANGE)
            .values(value=counters.c.value + count)
            .returning(counters.c.value)
        )
        assert last is not None
        return range(last - count + 1, last + 1)

    # -- rollouts -------------------------------------------------------------------------

    async def create_rollouts(self, specs: Sequence[RolloutSpec]) -> list[Rollout]:
        resolved: dict[str, tuple[RolloutSpec, str]] = {}
        order: list[str] = []
        for spec in specs:
            if spec.rollout_id is None:
                spec = spec.model_copy(update={"rollout_id": f"ro-{uuid.uuid4().hex}"})
            assert spec.rollout_id is not None
            digest = _digest(spec)
            earlier = resolved.get(spec.rollout_id)
            if earlier is not None and earlier[1] != digest:
                raise Conflict(
                    f"rollout {spec.rollout_id} appears twice in this request with different "
                    "bodies; give each rollout its own id"
                )
            if earlier is None:
                order.append(spec.rollout_id)
            resolved[spec.rollout_id] = (spec, digest)
        for _ in range(3):
            try:
                return await self._create_rollouts_once(resolved, order)
            except IntegrityError:
                # A concurrent create of the same id won the race; the retry sees its row.
                continue
        raise Conflict("rollout ids are being created concurrently; retry the request")

    async def _create_rollouts_once(
        self, resolved: dict[str, tuple[RolloutSpec, str]], order: list[str]
    ) -> list[Rollout]:
        async with self._write() as conn:
            existing = {
                row.rollout_id: row
                for row in await conn.execute(
                    sa.select(rollouts).where(rollouts.c.rollout_id.in_(order))
                )
            }
            for rollout_id, row in existing.items():
                if row.spec_digest != resolved[rollout_id][1]:
                    raise Conflict(
                        f"rollout {rollout_id} already exists with a different body; "
                        "a retried create must send the same body, a new rollout needs a new id"
                    )
            new_ids = [rid for rid in order if rid not in existing]
            if new_ids:
                now = time.time()
                seqs = await self._next_change_seqs(conn, len(new_ids))
                rows = []
                for rollout_id, seq in zip(new_ids, seqs, strict=True):
                    spec, digest = resolved[rollout_id]
                    rows.append(
                        {
                            "rollout_id": rollout_id,
                            "input": spec.input,
                            "group_id": spec.group_id,
                            "mode": spec.mode,
                            "metadata": spec.metadata,
                            "config": spec.config.model_dump(mode="json"),
                            "state": "queuing",
                            "reason": None,
                            "attempt_count": 0,
                            "change_seq": seq,
                            "spec_digest": digest,
                            "created_at": now,
                            "updated_at": now,
                        }
                    )
                await conn.execute(sa.insert(rollouts), rows)
                for row in await conn.execute(
                    sa.select(rollouts).where(rollouts.c.rollout_id.in_(new_ids))
                ):
                    existing[row.rollout_id] = row
        return [_rollout(existing[rid]) for rid in order]

    async def list_rollouts(
        self,
        *,
        states: Sequence[RolloutState] = (),
        mode: Mode | None = None,
        group_id: str | None = None,
        cursor: int = 0,
        limit: int = 100,
        run: str | None = None,
        search: str | None = None,
    ) -> RolloutPage:
        # Read the head first: every change up to it has committed (the counter row lock orders
        # commits), so a short page can move the cursor to the head without skipping anything.
        head_query = sa.select(counters.c.value).where(counters.c.name == _ROLLOUT_CHANGE)
        query = sa.select(rollouts).where(
            rollouts.c.change_seq > cursor,
            *_rollout_filters(states, mode, group_id, run, search, sqlite=self.is_sqlite),
        )
        query = query.order_by(rollouts.c.change_seq).limit(limit)
        async with self.engine.connect() as conn:
            head = int(await conn.scalar(head_query) or 0)
            query = query.where(rollouts.c.change_seq <= head)
            items = [_rollout(row) for row in await conn.execute(query)]
        # A short page saw every matching change up to the head, so the follower may skip the
        # changes that did not match its filter.
        next_cursor = items[-1].change_seq if len(items) == limit else max(head, cursor)
        return RolloutPage(items=items, next_cursor=next_cursor)

    # -- dashboard reads (reins.monitor) -------------------------------------------------------

    async def query_rollouts(self, query: RolloutQuery) -> tuple[list[Rollout], int]:
        where = _rollout_filters(
            query.states,
            query.mode,
            query.group_id,
            query.run,
            query.search,
            sqlite=self.is_sqlite,
        )
        key = self._sort_key(query)
        order = [
            sa.nulls_last(key.desc() if query.descending else key.asc()),
            rollouts.c.created_at.desc(),
            rollouts.c.rollout_id,
        ]
        page = sa.select(rollouts).where(*where).order_by(*order)
        total = sa.select(sa.func.count()).select_from(rollouts).where(*where)
        async with self.engine.connect() as conn:
            count = int(await conn.scalar(total) or 0)
            rows = await conn.execute(page.offset(query.offset).limit(query.limit))
            return [_rollout(row) for row in rows], count

    def _sort_key(self, query: RolloutQuery) -> sa.ColumnElement[Any]:
        if query.sort == "reward":
            return self._last_reward()
        if query.sort == "duration":
            first = attempts.alias("first_attempt")
            latest = attempts.alias("latest_attempt")
            started = (
                sa.select(first.c.created_at)
                .where(first.c.rollout_id == rollouts.c.rollout_id, first.c.attempt_id == 1)
                .scalar_subquery()
            )
            ended = (
                sa.select(latest.c.ended_at)
                .where(
                    latest.c.rollout_id == rollouts.c.rollout_id,
                    latest.c.attempt_id == rollouts.c.attempt_count,
                )
                .scalar_subquery()
            )
            return ended - started
        columns: dict[str, sa.ColumnElement[Any]] = {
            "created": rollouts.c.created_at,
            "updated": rollouts.c.updated_at,
            "state": rollouts.c.state,
            "id": rollouts.c.rollout_id,
        }
        return columns[query.sort]

    def _last_reward(self) -> sa.ColumnElement[Any]:
        """The value of the latest attempt's last `reward` event, per rollout row."""
        return (
            sa.select(self._json_number(events.c.data, "value"))
            .where(
                events.c.rollout_id == rollouts.c.rollout_id,
                events.c.attempt_id == rollouts.c.attempt_count,
                events.c.type == REWARD,
            )
            .order_by(events.c.seq.desc())
            .limit(1)
            .scalar_subquery()
        )

    def _json_number(self, column: sa.Column[Any], key: str) -> sa.ColumnElement[Any]:
        """`column[key]` when it is a JSON number, else NULL (harness data is not trusted)."""
        if self.is_sqlite:
            path = f'$."{key}"'
            kind = sa.func.json_type(column, path)
            return sa.case((kind.in_(["integer", "real"]), sa.func.json_extract(column, path)))
        is_number = sa.func.json_typeof(column[key]) == "number"
        return _unless_nul(column, sa.case((is_number, column[key].as_float())))

    def _json_length(self, column: sa.Column[Any], key: str) -> sa.ColumnElement[Any]:
        """Length of the JSON array `column[key]`; 0 when it is not an array."""
        if self.is_sqlite:
            path = f'$."{key}"'
            is_array = sa.func.json_type(column, path) == "array"
            return sa.case((is_array, sa.func.json_array_length(column, path)), else_=0)
        is_array = sa.func.json_typeof(column[key]) == "array"
        length = sa.case((is_array, sa.func.json_array_length(column[key])), else_=0)
        return sa.func.coalesce(_unless_nul(column, length), 0)

    async def rollout_stats(self, rollout_ids: Sequence[str]) -> dict[str, RolloutStats]:
        ids = list(dict.fromkeys(rollout_ids))
        if not ids:
            return {}
        latest = events.join(
            rollouts,
            sa.and_(
                events.c.rollout_id == rollouts.c.rollout_id,
                events.c.attempt_id == rollouts.c.attempt_count,
            ),
        )
        version = self._json_number(events.c.data, "model_version")
        status = self._json_number(events.c.data, "status")
        calls = (
            sa.select(
                events.c.rollout_id,
                sa.func.count().label("calls"),
                sa.func.sum(sa.case((status != 200, 1), else_=0)).label("failed"),
                sa.func.sum(self._json_length(events.c.data, "prompt_token_ids")).label("prompt"),
                sa.func.sum(self._json_length(events.c.data, "response_token_ids")).label("resp"),
                sa.func.min(version).label("min_version"),
                sa.func.max(version).label("max_version"),
            )
            .select_from(latest)
            .where(events.c.rollout_id.in_(ids), events.c.type == MODEL_REQUEST)
            .group_by(events.c.rollout_id)
        )
        rewards = (
            sa.select(events.c.rollout_id, self._json_number(events.c.data, "value").label("v"))
            .select_from(latest)
            .where(events.c.rollout_id.in_(ids), events.c.type == REWARD)
            .order_by(events.c.seq)
        )
        first = attempts.alias("first_attempt")
        last = attempts.alias("latest_attempt")
        times = (
            sa.select(rollouts.c.rollout_id, first.c.created_at, last.c.ended_at)
            .select_from(
                rollouts.outerjoin(
                    first,
                    sa.and_(first.c.rollout_id == rollouts.c.rollout_id, first.c.attempt_id == 1),
                ).outerjoin(
                    last,
                    sa.and_(
                        last.c.rollout_id == rollouts.c.rollout_id,
                        last.c.attempt_id == rollouts.c.attempt_count,
                    ),
                )
            )
            .where(rollouts.c.rollout_id.in_(ids))
        )
        totals = (
            sa.select(events.c.rollout_id, sa.func.count(), sa.func.max(events.c.seq))
            .where(events.c.rollout_id.in_(ids))
            .group_by(events.c.rollout_id)
        )
        found: dict[str, dict[str, Any]] = {}
        async with self.engine.connect() as conn:
            for row in await conn.execute(times):
                found[row.rollout_id] = {"started_at": row.created_at, "ended_at": row.ended_at}
            for rollout_id, count, last_seq in await conn.execute(totals):
                found[rollout_id].update(events=int(count), last_seq=int(last_seq))
            for agg in await conn.execute(calls):
                found[agg.rollout_id].update(
                    calls=int(agg.calls),
                    failed_calls=int(agg.failed or 0),
                    prompt_tokens=int(agg.prompt or 0),
                    response_tokens=int(agg.resp or 0),
                    min_version=None if agg.min_version is None else int(agg.min_version),
                    max_version=None if agg.max_version is None else int(agg.max_version),
                )
            for reward in await conn.execute(rewards):
                found[reward.rollout_id]["reward"] = None if reward.v is None else float(reward.v)
        return {rollout_id: RolloutStats(**values) for rollout_id, values in found.items()}

    async def count_rollouts(self) -> dict[tuple[str, str], int]:
        query = sa.select(rollouts.c.state, rollouts.c.mode, sa.func.count()).group_by(
            rollouts.c.state, rollouts.c.mode
        )
        async with self.engine.connect() as conn:
            return {(row[0], row[1]): int(row[2]) for row in await conn.execute(query)}

    async def get_rollout(self, rollout_id: str) -> RolloutDetail:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(sa.select(rollouts).where(rollouts.c.rollout_id == rollout_id))
            ).first()
            if row is None:
                raise NotFound(f"rollout {rollout_id} does not exist")
            attempt_rows = await conn.execute(
                sa.select(attempts)
                .where(attempts.c.rollout_id == rollout_id)
                .order_by(attempts.c.attempt_id)
            )
            return RolloutDetail(
                rollout=_rollout(row), attempts=[_attempt(a) for a in attempt_rows]
            )

    async def _lock_rollout(self, conn: AsyncConnection, rollout_id: str) -> sa.Row[Any]:
        row = (
            await conn.execute(
                sa.select(rollouts).where(rollouts.c.rollout_id == rollout_id).with_for_update()
            )
        ).first()
        if row is None:
            raise NotFound(f"rollout {rollout_id} does not exist")
        return row

    async def update_rollout(self, rollout_id: str, update: RolloutUpdate) -> Rollout:
        async with self._write() as conn:
            row = await self._lock_rollout(conn, rollout_id)
            now = time.time()
            values: dict[str, Any] = {}
            if update.status is not None and update.status.state != row.state:
                new_state = update.status.state
                if new_state not in VALID_TRANSITIONS[row.state]:
                    allowed = sorted(VALID_TRANSITIONS[row.state]) or ["nothing: it is terminal"]
                    raise Conflict(
                        f"rollout {rollout_id} is {row.state}; it cannot become {new_state} "
                        f"(from {row.state} it can become: {', '.join(allowed)})"
                    )
                values.update(state=new_state, reason=update.status.reason)
                if new_state == "running" and row.attempt_count == 0:
                    await self._insert_attempt(conn, rollout_id, 1, now)
                    values["attempt_count"] = 1
                if new_state in TERMINAL_STATES and row.attempt_count > 0:
                    await conn.execute(
                        sa.update(attempts)
                        .where(
                            attempts.c.rollout_id == rollout_id,
                            attempts.c.attempt_id == row.attempt_count,
                            attempts.c.state == "running",
                        )
                        .values(state=new_state, reason=update.status.reason, ended_at=now)
                    )
            if update.metadata is not None:
                merged = {**row.metadata, **update.metadata}
                if merged != row.metadata:
                    values["metadata"] = merged
            if not values:
                return _rollout(row)
            (values["change_seq"],) = await self._next_change_seqs(conn, 1)
            values["updated_at"] = now
            new_row = (
                await conn.execute(
                    sa.update(rollouts)
                    .where(rollouts.c.rollout_id == rollout_id)
                    .values(**values)
                    .returning(*rollouts.c)
                )
            ).one()
            return _rollout(new_row)

    async def _insert_attempt(
        self, conn: AsyncConnection, rollout_id: str, attempt_id: int, now: float
    ) -> None:
        await conn.execute(
            sa.insert(attempts).values(
                rollout_id=rollout_id, attempt_id=attempt_id, state="running", created_at=now
            )
        )

    async def open_attempt(self, rollout_id: str, request: AttemptCreate) -> Attempt:
        async with self._write() as conn:
            row = await self._lock_rollout(conn, rollout_id)
            wanted = request.attempt_id
            if wanted is not None and wanted <= row.attempt_count:
                existing = (
                    await conn.execute(
                        sa.select(attempts).where(
                            attempts.c.rollout_id == rollout_id, attempts.c.attempt_id == wanted
                        )
                    )
                ).one()
                return _attempt(existing)
            if row.state in TERMINAL_STATES:
                raise Conflict(
                    f"rollout {rollout_id} is {row.state}; no new attempt can start on it"
                )
            next_id = row.attempt_count + 1
            if wanted is not None and wanted != next_id:
                raise Conflict(
                    f"attempt {wanted} cannot open: the next attempt of rollout {rollout_id} "
                    f"is {next_id}"
                )
            now = time.time()
            if row.attempt_count > 0:
                await conn.execute(
                    sa.update(attempts)
                    .where(
                        attempts.c.rollout_id == rollout_id,
                        attempts.c.attempt_id == row.attempt_count,
                        attempts.c.state == "running",
                    )
                    .values(
                        state="failed",
                        reason=request.reason or f"superseded by attempt {next_id}",
                        ended_at=now,
                    )
                )
            await self._insert_attempt(conn, rollout_id, next_id, now)
            (seq,) = await self._next_change_seqs(conn, 1)
            await conn.execute(
                sa.update(rollouts)
                .where(rollouts.c.rollout_id == rollout_id)
                .values(state="running", attempt_count=next_id, change_seq=seq, updated_at=now)
            )
            return Attempt(
                rollout_id=rollout_id, attempt_id=next_id, state="running", created_at=_ts(now)
            )

    async def attempt_exists(self, rollout_id: str, attempt_id: int) -> bool:
        if (rollout_id, attempt_id) in self._known_attempts:
            return True
        async with self.engine.connect() as conn:
            found = await conn.scalar(
                sa.select(attempts.c.attempt_id).where(
                    attempts.c.rollout_id == rollout_id, attempts.c.attempt_id == attempt_id
                )
            )
        if found is not None:
            self._known_attempts.add((rollout_id, attempt_id))
        return found is not None

    # -- events ---------------------------------------------------------------------------

    async def append_events(
        self, rollout_id: str, attempt_id: int, events_in: Sequence[EventIn]
    ) -> list[Event]:
        if not events_in:
            if not await self.attempt_exists(rollout_id, attempt_id):
                raise NotFound(f"rollout {rollout_id} has no attempt {attempt_id}")
            return []
        now = time.time()
        rows = [
            {
                "rollout_id": rollout_id,
                "attempt_id": attempt_id,
                "type": event.type,
                "data": event.data,
                "idempotency_key": event.idempotency_key or f"srv-{uuid.uuid4().hex}",
                "created_at": now,
            }
            for event in events_in
        ]
        keys = [row["idempotency_key"] for row in rows]
        if len(set(keys)) != len(keys):
            raise Conflict("two events in one post share an idempotency key")
        append = _Append(rollout_id, attempt_id, rows, asyncio.get_running_loop().create_future())
        self._pending.append(append)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_pending())
        return await asyncio.shield(append.done)

    async def _flush_pending(self) -> None:
        while self._pending:
            batch: list[_Append] = []
            size = 0
            while self._pending and size < _MAX_EVENTS_PER_COMMIT:
                batch.append(self._pending.popleft())
                size += len(batch[-1].rows)
            try:
                await self._commit_appends(batch)
            except Exception as error:
                for append in batch:
                    if not append.done.done():
                        append.done.set_exception(error)

    async def _commit_appends(self, batch: list[_Append]) -> None:
        unknown = {(a.rollout_id, a.attempt_id) for a in batch} - self._known_attempts
        if unknown:
            async with self.engine.connect() as conn:
                found = await conn.execute(
                    sa.select(attempts.c.rollout_id, attempts.c.attempt_id).where(
                        sa.tuple_(attempts.c.rollout_id, attempts.c.attempt_id).in_(list(unknown))
                    )
                )
                self._known_attempts.update((row.rollout_id, row.attempt_id) for row in found)
        live: list[_Append] = []
        for append in batch:
            if (append.rollout_id, append.attempt_id) in self._known_attempts:
                live.append(append)
            else:
                append.done.set_exception(
                    NotFound(f"rollout {append.rollout_id} has no attempt {append.attempt_id}")
                )
        fresh: dict[tuple[str, int, str], dict[str, Any]] = {}
        for append in live:
            for row in append.rows:
                fresh.setdefault(
                    (row["rollout_id"], row["attempt_id"], row["idempotency_key"]), row
                )
        if not fresh:
            return
        rows = list(fresh.values())
        async with self._write_lock or contextlib.nullcontext():
            if self._event_engine is not None:
                inserted, replayed = await asyncio.get_running_loop().run_in_executor(
                    self._event_thread, self._insert_events_in_thread, rows
                )
            else:
                async with self.engine.begin() as conn:
                    inserted, replayed = await conn.run_sync(_insert_events, self._insert, rows)
        stored = {
            (row.rollout_id, row.attempt_id, row.idempotency_key): _event(row) for row in replayed
        }
        for seq, rollout_id, attempt_id, key in inserted:
            row = fresh[(rollout_id, attempt_id, key)]
            stored[(rollout_id, attempt_id, key)] = Event.model_construct(
                seq=seq,
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                type=row["type"],
                data=row["data"],
                idempotency_key=key,
                created_at=_ts(row["created_at"]),
            )
        for append in live:
            self._resolve(append, stored)

    def _insert_events_in_thread(
        self, rows: list[dict[str, Any]]
    ) -> tuple[list[tuple[int, str, int, str]], list[sa.Row[Any]]]:
        assert self._event_engine is not None
        with self._event_engine.begin() as conn:
            return _insert_events(conn, self._insert, rows)

    @staticmethod
    def _resolve(append: _Append, stored: dict[tuple[str, int, str], Event]) -> None:
        out: list[Event] = []
        for row in append.rows:
            event = stored[(row["rollout_id"], row["attempt_id"], row["idempotency_key"])]
            if event.type != row["type"] or event.data != row["data"]:
                append.done.set_exception(
                    Conflict(
                        f"idempotency key {row['idempotency_key']} of rollout "
                        f"{append.rollout_id} attempt {append.attempt_id} was already used for "
                        "another event; a retried post must send the same event"
                    )
                )
                return
            out.append(event)
        append.done.set_result(out)

    async def get_events(
        self,
        rollout_id: str,
        *,
        attempt_id: int | None = None,
        all_attempts: bool = False,
        types: Sequence[str] = (),
        after: int = 0,
        limit: int = 1000,
    ) -> list[Event]:
        async with self.engine.connect() as conn:
            latest = await conn.scalar(
                sa.select(rollouts.c.attempt_count).where(rollouts.c.rollout_id == rollout_id)
            )
            if latest is None:
                raise NotFound(f"rollout {rollout_id} does not exist")
            query = sa.select(events).where(events.c.rollout_id == rollout_id)
            if not all_attempts:
                wanted = latest if attempt_id is None else attempt_id
                if attempt_id is not None and not 1 <= attempt_id <= latest:
                    raise NotFound(f"rollout {rollout_id} has no attempt {attempt_id}")
                query = query.where(events.c.attempt_id == wanted)
            if types:
                query = query.where(events.c.type.in_(list(types)))
            query = query.where(events.c.seq > after).order_by(events.c.seq).limit(limit)
            return [_event(row) for row in await conn.execute(query)]

    # -- models ---------------------------------------------------------------------------

    async def register_models(self, endpoints: Sequence[ModelEndpointIn]) -> list[Model]:
        now = time.time()
        async with self._write() as conn:
            for item in endpoints:
                statement = self._insert(models).values(
                    model=item.model,
                    endpoint=item.endpoint,
                    engine=item.engine,
                    weight_version=item.weight_version,
                    created_at=now,
                    updated_at=now,
                )
                await conn.execute(
                    statement.on_conflict_do_update(
                        index_elements=["model", "endpoint"],
                        set_={
                            "engine": statement.excluded.engine,
                            "weight_version": statement.excluded.weight_version,
                            "updated_at": statement.excluded.updated_at,
                        },
                    )
                )
        names = {item.model for item in endpoints}
        return [m for m in await self.list_models() if m.model in names]

    async def list_models(self) -> list[Model]:
        async with self.engine.connect() as conn:
            rows = list(
                await conn.execute(
                    sa.select(models).order_by(
                        models.c.model, models.c.created_at, models.c.endpoint
                    )
                )
            )
        grouped: dict[str, list[sa.Row[Any]]] = {}
        for row in rows:
            grouped.setdefault(row.model, []).append(row)
        return [
            Model(
                model=name,
                endpoints=[r.endpoint for r in group],
                engine=max(group, key=lambda r: r.updated_at).engine,
                weight_version=max(r.weight_version for r in group),
                updated_at=_ts(max(r.updated_at for r in group)),
            )
            for name, group in grouped.items()
        ]

    async def delete_models(self, model: str | None = None) -> int:
        statement = sa.delete(models)
        if model is not None:
            statement = statement.where(models.c.model == model)
        async with self._write() as conn:
            result = await conn.execute(statement)
        return int(result.rowcount)
