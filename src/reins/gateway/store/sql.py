"""`SqlStore`: the store on SQLAlchemy 2 async, SQLite (aiosqlite, WAL) or PostgreSQL (asyncpg).

Two choices carry the performance and the guarantees:
- Event appends are group-committed: concurrent posts are queued and written by one task in one
  transaction, and every post is answered only after that transaction committed. A killed gateway
  therefore loses no acknowledged event, and 16 clients cost a handful of commits, not 16.
- Rollout changes take the next value of one counter row inside their transaction. The row lock
  orders commits by sequence number, so a reader following `change_seq` never skips a change
  that commits late (the list cursor is safe on PostgreSQL too, not only on SQLite's single writer).

Two more keep every stored row readable and every closed attempt closed:
- Every JSON document is encoded under `reins.gateway.jsonrule` before its statement runs (no
  NaN, no unpaired surrogate, bounded depth), whoever the caller; a refused one is `Invalid` and
  nothing of that write is stored. The encoded text is what the row gets (encoded once).
- A harness's events are checked against the state of their attempt inside the transaction that
  stores them (`appends`), so none is stored after its attempt was superseded or its rollout
  became terminal.

The schema and row conversions are in `tables`, the dashboard's queries in `reads`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from reins.gateway import jsonrule
from reins.gateway.store import Conflict, NotFound
from reins.gateway.store.appends import (
    Commit,
    PendingAppend,
    begin_writing,
    chosen_rows,
    pack_and_insert,
    remember,
    reused_key,
    same_json,
    skipped_posts,
)
from reins.gateway.store.board import ReplicaBoard
from reins.gateway.store.journal import (
    CLEAR_FROM_BYTES,
    CallJournal,
    JournaledPost,
    held_elsewhere,
    journal_path,
)
from reins.gateway.store.leases import Leases
from reins.gateway.store.packing import (
    FetchedRows,
    Key,
    Packer,
    event_columns,
    fetch_chains,
    fetch_parts,
    packed_event_of,
    parts_of,
    prepare_blob_split,
    restore_rows,
)
from reins.gateway.store.pragmas import install_sqlite_pragmas, sqlite_engine, sqlite_file
from reins.gateway.store.reads import DashboardReads, rollout_filters
from reins.gateway.store.tables import (
    ADDED_COLUMNS,
    ADDED_INDEXES,
    ATTEMPT_STATE,
    attempt_of,
    attempts,
    closed_reason_of,
    counters,
    encoded,
    events,
    meta,
    metadata,
    models,
    names_no_row,
    rollout_of,
    rollouts,
    serialize,
    spec_digest,
    text_value,
    ts,
)
from reins.gateway.store.writer import CommitPlace, ProcessWriter, ThreadWriter
from reins.recordbatch import RolloutParts
from reins.schemas import (
    TERMINAL_STATES,
    VALID_TRANSITIONS,
    Attempt,
    AttemptCreate,
    Event,
    EventIn,
    Mode,
    Model,
    ModelEndpointIn,
    PackedEvent,
    Rollout,
    RolloutDetail,
    RolloutPage,
    RolloutSpec,
    RolloutState,
    RolloutUpdate,
)

logger = logging.getLogger(__name__)

_ROLLOUT_CHANGE = "rollout_change"
_MAX_EVENTS_PER_COMMIT = 2000
_INLINE_MAX_ROWS = 4
_INLINE_MAX_CHARS = 64 * 1024
_JOURNALED_SYNCHRONOUS = ("OFF", "NORMAL")
"""The `synchronous` settings under which a journal `write` is as durable as a commit."""
_SETTLE_TIMEOUT_S = 30.0
_JOURNAL_BATCH = 16
_JOURNAL_BATCH_CHARS = 1 << 20
_FLUSH_AFTER_S = 0.05
"""Journaled calls commit once `_JOURNAL_BATCH` of them wait (or their events' JSON holds
`_JOURNAL_BATCH_CHARS`: a long prompt's call commits alone), or this long after the first,
or when a read or a close needs them stored (`_settle`), or with other events' commits. One
commit after each call cost a harness calling one at a time ~0.07 ms of added latency and ~0.3
ms of the gateway's CPU per call (the commit's fixed part, and its thread taking the interpreter
lock from the loop serving the next call): docs/benchmarks.md, "LLM proxy"."""
_RETRY_MAX_S = 5.0


def _commit_place(
    rows: list[dict[str, Any]],
    pending: deque[PendingAppend],
    batch: list[PendingAppend],
    *,
    alone: bool = True,
) -> CommitPlace:
    """Where a group commit runs (`writer`): on the event loop's thread, on a thread of the
    gateway's process, or in the writer (its process, or its thread).

    A lone small commit (one client posting at a time) pays more for the hand-over to the
    writer and back (a wake there and a loop wake here) than for the write itself (~0.5 ms; a
    WAL checkpoint every ~30 commits adds about as much again): the loop's thread. The loop
    never waits for the writer's SQLite lock: the store runs one commit at a time (its write
    lock); but while another gateway serves the file (not `alone`) it might, for as long as
    that one's commit takes: the commit then goes to the writer.
    Journaled calls were answered already: their commit stays off the loop, which serves the
    next call, but in this process: a writer process took ~0.15 ms more CPU per proxied call
    (the pickling and the wakes, both sides) from the 2 cores the engine shares, for no gain,
    since nobody waits for that commit (docs/benchmarks.md, "LLM proxy"). Anything else goes
    to the writer, which runs beside the loop's HTTP work."""
    if batch and all(a.journaled for a in batch):
        return "thread"
    if pending or not alone or len(rows) > _INLINE_MAX_ROWS or any(a.journaled for a in batch):
        return "writer"
    return "loop" if sum(len(row["data"].text) for row in rows) <= _INLINE_MAX_CHARS else "writer"


_T = TypeVar("_T")
_F = TypeVar("_F")
_Q = TypeVar("_Q")


@dataclass(frozen=True)
class _EventsQuery:
    rollout_id: str
    attempt_id: int | None
    all_attempts: bool
    types: tuple[str, ...]
    after: int
    limit: int


def _events_select(conn: sa.Connection, q: _EventsQuery) -> sa.Select[Any]:
    """The events of `q`, in seq order; NotFound for a rollout or attempt that does not exist."""
    if names_no_row(q.rollout_id):
        raise NotFound(f"rollout {q.rollout_id!r} does not exist")
    latest = conn.scalar(
        sa.select(rollouts.c.attempt_count).where(rollouts.c.rollout_id == q.rollout_id)
    )
    if latest is None:
        raise NotFound(f"rollout {q.rollout_id} does not exist")
    query = sa.select(*event_columns(conn.dialect.name)).where(events.c.rollout_id == q.rollout_id)
    if not q.all_attempts:
        wanted = latest if q.attempt_id is None else q.attempt_id
        if q.attempt_id is not None and not 1 <= q.attempt_id <= latest:
            raise NotFound(f"rollout {q.rollout_id} has no attempt {q.attempt_id}")
        query = query.where(events.c.attempt_id == wanted)
    if q.types:
        query = query.where(events.c.type.in_([t for t in q.types if not names_no_row(t)]))
    return query.where(events.c.seq > q.after).order_by(events.c.seq).limit(q.limit)


def _fetch_events(conn: sa.Connection, q: _EventsQuery) -> FetchedRows:
    return fetch_chains(conn, conn.execute(_events_select(conn, q)))


def _fetch_rows(conn: sa.Connection, q: _EventsQuery) -> list[sa.Row[Any]]:
    return list(conn.execute(_events_select(conn, q)))


def _packed_events(rows: list[sa.Row[Any]]) -> list[PackedEvent]:
    return [packed_event_of(row) for row in rows]


def _add_packing_columns(conn: sa.Connection) -> None:
    """The migration of a database made before events were packed: its rows stay as they are
    (read whole), new `model_request` rows are packed. The indexes added since are made too."""
    present = {column["name"] for column in sa.inspect(conn).get_columns("events")}
    for name in ADDED_COLUMNS:
        if name not in present:
            column = events.c[name]
            kind = column.type.compile(dialect=conn.dialect)
            guard = "IF NOT EXISTS " if conn.dialect.name == "postgresql" else ""
            conn.execute(sa.text(f"ALTER TABLE events ADD COLUMN {guard}{name} {kind}"))
    for index in ADDED_INDEXES:  # `create_all` makes no index of a table that exists
        index.create(conn, checkfirst=True)


def _stored_or_refused(append: PendingAppend) -> bool:
    done = append.done
    if not done.done() or done.cancelled():
        return False
    error = done.exception()
    return error is None or isinstance(error, NotFound | Conflict)


def _log_unstored(done: asyncio.Future[list[Event]]) -> None:
    """A journaled call refused by its commit: only a second writer of the SQLite file could
    have closed its attempt, since closes wait for journaled calls."""
    if not done.cancelled() and done.exception() is not None:
        logger.error("a call answered from the journal was not stored: %s", done.exception())


_INIT_LOCK = 0x7265696E73  # "reins": the advisory lock that orders replicas' `init`


class SqlStore(DashboardReads):
    """The `Store` on SQLite or PostgreSQL, chosen by the URL."""

    def __init__(
        self,
        url: str,
        *,
        sqlite_synchronous: str = "NORMAL",
        event_writer: Literal["process", "thread"] = "process",
    ) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        self._journal: CallJournal | None = None
        if self.is_sqlite:
            path = sqlite_file(url)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if sqlite_synchronous.upper() in _JOURNALED_SYNCHRONOUS:
                self._journal = CallJournal(journal_path(path))
            self.engine: AsyncEngine = create_async_engine(url, json_serializer=serialize)
            install_sqlite_pragmas(self.engine.sync_engine, sqlite_synchronous)
            # Event appends, the hot path: the group commits run in a writer process (or thread)
            # on a plain sqlite3 connection of their own (`writer`).
            self._writer: ProcessWriter | ThreadWriter | None = (
                ProcessWriter(path, sqlite_synchronous)
                if event_writer == "process"
                else ThreadWriter(path, sqlite_synchronous)
            )
            # The proxy's per-call attempt check, the same way on a reader connection of its own
            # (a statement through aiosqlite costs ~1.5 ms of CPU on 2 cores; this ~0.1 ms).
            self._read_engine: sa.Engine | None = sqlite_engine(path, sqlite_synchronous)
            self._read_thread: ThreadPoolExecutor | None = ThreadPoolExecutor(
                1, thread_name_prefix="reins-reads"
            )
            # Events and records, restored off the event loop; a thread of their own, so that
            # the attempt check above never waits behind a long rollout's read.
            self._bulk_thread = ThreadPoolExecutor(1, thread_name_prefix="reins-bulk-reads")
        else:
            self.engine = create_async_engine(
                url, pool_size=10, max_overflow=10, json_serializer=serialize
            )
            self._writer = None
            self._read_engine = None
            self._read_thread = None
            # The rows are read on the loop (asyncpg) and restored in this thread, off the
            # loop, as on SQLite.
            self._bulk_thread = ThreadPoolExecutor(1, thread_name_prefix="reins-bulk-reads")
        self._insert = sqlite.insert if self.is_sqlite else postgresql.insert
        # SQLite has one writer: serialize our writes here instead of spinning on SQLITE_BUSY.
        self._write_lock = asyncio.Lock() if self.is_sqlite else None
        self._pending: deque[PendingAppend] = deque()
        # Attempts are never deleted, so an attempt seen once can skip the existence check.
        self._known_attempts: set[tuple[str, int]] = set()
        # SQLite only: the attempt of each rollout last seen open by an event commit. A close
        # drops it under the write lock, so the proxy's check before a call skips the query,
        # and its call may be answered from the journal, while nothing closed it. Every commit
        # still checks (another gateway on the file may close it: that commit then drops it).
        self._open_attempt: dict[str, int] = {}
        self.needs_peers_known = False
        """Set by `init`: another gateway holds the call journal (`Store.needs_peers_known`)."""
        self._peers = 0
        """Other live gateways on this database (`set_peers`): while there are any, the
        journal and `_open_attempt` answer nothing, since another gateway may close an attempt."""
        # Rollouts whose update or new attempt (either may close an attempt) waits for the
        # journaled calls: their calls wait for their commit meanwhile.
        self._closing: Counter[str] = Counter()
        self._last_journaled: asyncio.Future[list[Event]] | None = None
        self._journal_error: Exception | None = None
        self._in_journal: list[PendingAppend] = []
        """The posts of the journal's records not yet known stored (`_journal_stored`)."""
        self._flusher: asyncio.Task[None] | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        self._packer = Packer()  # PostgreSQL's (SQLite's is its writer's)
        self.board = ReplicaBoard(self.engine, self._insert, self._write)
        self.leases = Leases(self.engine, self._insert, self._write)
        """What the gateway processes sharing this database tell each other."""
        self.database_id: str | None = None
        """A random id made with the database (read by `init`): pages of rollout changes carry
        it, since their cursor counts this database's changes only."""

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        lock = self._write_lock or contextlib.nullcontext()
        async with lock, self.engine.begin() as conn:
            if self.is_sqlite:
                await conn.run_sync(begin_writing)
            yield conn

    async def init(self) -> None:
        async with self._write() as conn:
            if not self.is_sqlite:
                # Replicas started together (two pods of one deployment) would create the
                # tables at once and race in PostgreSQL's catalog (a unique violation on
                # `pg_type` ended one at its start): one at a time, until its commit.
                await conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_INIT_LOCK)))
            await conn.run_sync(metadata.create_all)
            await conn.run_sync(_add_packing_columns)
            if not self.is_sqlite:
                self._packer.toast_chunk = await conn.run_sync(prepare_blob_split)
            await conn.execute(
                self._insert(counters)
                .values(name=_ROLLOUT_CHANGE, value=0)
                .on_conflict_do_nothing(index_elements=["name"])
            )
            made_once = {"token_secret": secrets.token_hex(32), "database_id": uuid.uuid4().hex}
            for key, value in made_once.items():
                await conn.execute(
                    self._insert(meta)
                    .values(key=key, value=value)
                    .on_conflict_do_nothing(index_elements=["key"])
                )
            self.database_id = await conn.scalar(
                sa.select(meta.c.value).where(meta.c.key == "database_id")
            )
            await self.board.init(conn)
        if isinstance(self._writer, ProcessWriter):
            self._writer.start_soon()
        if self.is_sqlite and self._journal is None:
            self.needs_peers_known = held_elsewhere(journal_path(sqlite_file(self.url)))
        if self._journal is not None:
            if self._journal.open():
                await self._replay_journal(self._journal)
            else:
                self.needs_peers_known = True
                logger.warning(
                    "%s is held by another gateway process: this one answers a proxied call "
                    "only after its commit",
                    self._journal.path,
                )

    async def _replay_journal(self, journal: CallJournal) -> None:
        """Stores the calls a stopped gateway answered but did not store, then empties the
        journal. Checked as the harness's posts they were: their attempts were open when they
        were answered, and this gateway closed none before storing them, but another gateway
        on the same file may have (while this one was down): those are refused, logged, not
        stored after the close the trainer read."""
        posts = journal.read()
        if posts:
            appends = [
                PendingAppend(
                    post.rollout_id,
                    post.attempt_id,
                    post.rows,
                    asyncio.get_running_loop().create_future(),
                    from_harness=True,
                )
                for post in posts
            ]
            self._in_journal.extend(appends)
            for append in appends:
                self._enqueue(append)
            outcomes = await asyncio.gather(*(a.done for a in appends), return_exceptions=True)
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            for error in failed:
                if not isinstance(error, NotFound | Conflict):
                    raise error  # the database cannot store them now: start later
                logger.warning("a journaled call was not stored: %s", error)
            logger.info(
                "replayed %d calls a stopped gateway had answered from its journal (%s)",
                len(posts) - len(failed),
                journal.path,
            )
        if self._journal_stored():
            journal.clear()

    async def close(self) -> None:
        self.flush_soon()
        if self._flusher is not None:
            with contextlib.suppress(Exception):
                # A journaled call that cannot be stored keeps its commit retrying: after this
                # long its record stays in the journal, for the next start.
                await asyncio.wait_for(self._flusher, _SETTLE_TIMEOUT_S)
        if self._journal is not None and self._journal.is_open:
            if not self._pending and self._journal_error is None and self._journal_stored():
                self._journal.clear()
            self._journal.close()
        await self.engine.dispose()
        if self._writer is not None:
            await self._writer.close()
        for thread in (self._read_thread, self._bulk_thread):
            if thread is not None:
                thread.shutdown(wait=True)
        if self._read_engine is not None:
            self._read_engine.dispose()

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
        resolved: dict[str, tuple[RolloutSpec, str, dict[str, jsonrule.Encoded]]] = {}
        order: list[str] = []
        for spec in specs:
            if spec.rollout_id is None:
                spec = spec.model_copy(update={"rollout_id": f"ro-{uuid.uuid4().hex}"})
            assert spec.rollout_id is not None
            owner = f"rollout {spec.rollout_id}"
            documents = {
                "input": encoded(spec.input, ("input",), owner),
                "metadata": encoded(spec.metadata, ("metadata",), owner),
                "config": encoded(spec.config.model_dump(mode="json"), ("config",), owner),
            }
            digest = spec_digest(spec)
            earlier = resolved.get(spec.rollout_id)
            if earlier is not None and earlier[1] != digest:
                raise Conflict(
                    f"rollout {spec.rollout_id} appears twice in this request with different "
                    "bodies; give each rollout its own id"
                )
            if earlier is None:
                order.append(spec.rollout_id)
            resolved[spec.rollout_id] = (spec, digest, documents)
        for _ in range(3):
            try:
                return await self._create_rollouts_once(resolved, order)
            except IntegrityError:
                # A concurrent create of the same id won the race; the retry sees its row.
                continue
        raise Conflict("rollout ids are being created concurrently; retry the request")

    async def _create_rollouts_once(
        self,
        resolved: dict[str, tuple[RolloutSpec, str, dict[str, jsonrule.Encoded]]],
        order: list[str],
    ) -> list[Rollout]:
        async with self._write() as conn:
            existing = {
                row.rollout_id: row
                for row in await conn.execute(
                    sa.select(rollouts).where(rollouts.c.rollout_id.in_(order))
                )
            }
            for rollout_id in order:  # the first in the request's order, on both stores
                row = existing.get(rollout_id)
                if row is not None and row.spec_digest != resolved[rollout_id][1]:
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
                    spec, digest, documents = resolved[rollout_id]
                    rows.append(
                        {
                            "rollout_id": rollout_id,
                            "group_id": spec.group_id,
                            "mode": spec.mode,
                            **documents,
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
        return [rollout_of(existing[rid]) for rid in order]

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
            *rollout_filters(states, mode, group_id, run, search, sqlite=self.is_sqlite),
        )
        query = query.order_by(rollouts.c.change_seq).limit(limit)
        async with self.engine.connect() as conn:
            head = int(await conn.scalar(head_query) or 0)
            query = query.where(rollouts.c.change_seq <= head)
            items = [rollout_of(row) for row in await conn.execute(query)]
        # A short page saw every matching change up to the head, so the follower may skip the
        # changes that did not match its filter. A cursor past the head counts changes this
        # database does not have (restored from an older copy): the head, below the cursor,
        # says so, and the next page holds the changes made since.
        next_cursor = items[-1].change_seq if len(items) == limit else head
        return RolloutPage(items=items, next_cursor=next_cursor, database_id=self.database_id)

    async def get_rollout(self, rollout_id: str) -> RolloutDetail:
        if names_no_row(rollout_id):
            raise NotFound(f"rollout {rollout_id!r} does not exist")
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
                rollout=rollout_of(row), attempts=[attempt_of(a) for a in attempt_rows]
            )

    async def _lock_rollout(self, conn: AsyncConnection, rollout_id: str) -> sa.Row[Any]:
        if names_no_row(rollout_id):
            raise NotFound(f"rollout {rollout_id!r} does not exist")
        row = (
            await conn.execute(
                sa.select(rollouts).where(rollouts.c.rollout_id == rollout_id).with_for_update()
            )
        ).first()
        if row is None:
            raise NotFound(f"rollout {rollout_id} does not exist")
        return row

    @contextlib.asynccontextmanager
    async def _closing_after_journal(self, rollout_id: str) -> AsyncIterator[None]:
        """Around a change that may close an attempt of the rollout: the calls answered from
        the journal are stored first (so none is refused by the close), and no call of the
        rollout is answered from the journal until the change is done."""
        self._closing[rollout_id] += 1
        try:
            await self._settle()
            yield
        finally:
            self._closing[rollout_id] -= 1
            if not self._closing[rollout_id]:
                del self._closing[rollout_id]

    async def _settle(self) -> None:
        """Waits until every call answered from the journal so far is in the database: reads
        then see every answered call, as they see every acknowledged post."""
        last = self._last_journaled
        if last is None or last.done():
            return
        self.flush_soon()
        try:
            await asyncio.wait_for(asyncio.shield(last), _SETTLE_TIMEOUT_S)
        except TimeoutError:
            raise ConnectionError(
                f"calls answered by the proxy are not stored yet ({self._journal_error!r}); "
                "they are kept in the journal and stored once the database accepts them"
            ) from None
        except Exception:
            pass  # answered from the journal and refused by its commit: logged there

    async def update_rollout(self, rollout_id: str, update: RolloutUpdate) -> Rollout:
        async with self._closing_after_journal(rollout_id):
            return await self._update_rollout(rollout_id, update)

    async def _update_rollout(self, rollout_id: str, update: RolloutUpdate) -> Rollout:
        owner = f"rollout {rollout_id}"
        if update.status is not None:
            text_value(update.status.reason, ("body", "status", "reason"), owner)
        if update.metadata is not None:
            encoded(update.metadata, ("metadata",), owner)
        async with self._write() as conn:
            row = await self._lock_rollout(conn, rollout_id)
            self._open_attempt.pop(rollout_id, None)  # may close it: the next append checks
            if update.status is not None and update.status.state in TERMINAL_STATES:
                self._forget_bases(rollout_id)
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
                merged = encoded({**row.metadata, **update.metadata}, ("metadata",), owner)
                # Compared as JSON text, not as Python values, where `true == 1 == 1.0`: a
                # PATCH of `{"done": true}` over `{"done": 1}` was answered 200, not stored.
                if merged.text != serialize(row.metadata):
                    values["metadata"] = merged
            if not values:
                return rollout_of(row)
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
            return rollout_of(new_row)

    async def _insert_attempt(
        self, conn: AsyncConnection, rollout_id: str, attempt_id: int, now: float
    ) -> None:
        await conn.execute(
            sa.insert(attempts).values(
                rollout_id=rollout_id, attempt_id=attempt_id, state="running", created_at=now
            )
        )

    async def open_attempt(self, rollout_id: str, request: AttemptCreate) -> Attempt:
        async with self._closing_after_journal(rollout_id):
            return await self._open_attempt_now(rollout_id, request)

    async def _open_attempt_now(self, rollout_id: str, request: AttemptCreate) -> Attempt:
        text_value(request.reason, ("body", "reason"), f"rollout {rollout_id}")
        async with self._write() as conn:
            row = await self._lock_rollout(conn, rollout_id)
            self._open_attempt.pop(rollout_id, None)  # supersedes it: the next append checks
            self._forget_bases(rollout_id)
            wanted = request.attempt_id
            if wanted is not None and wanted <= row.attempt_count:
                existing = (
                    await conn.execute(
                        sa.select(attempts).where(
                            attempts.c.rollout_id == rollout_id, attempts.c.attempt_id == wanted
                        )
                    )
                ).one()
                return attempt_of(existing)
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
                rollout_id=rollout_id, attempt_id=next_id, state="running", created_at=ts(now)
            )

    async def attempt_exists(self, rollout_id: str, attempt_id: int) -> bool:
        if (rollout_id, attempt_id) in self._known_attempts:
            return True
        if names_no_row(rollout_id):
            return False
        async with self.engine.connect() as conn:
            found = await conn.scalar(
                sa.select(attempts.c.attempt_id).where(
                    attempts.c.rollout_id == rollout_id, attempts.c.attempt_id == attempt_id
                )
            )
        if found is not None:
            self._known_attempts.add((rollout_id, attempt_id))
        return found is not None

    async def check_open(self, rollout_id: str, attempt_id: int) -> None:
        if (
            self._write_lock is not None
            and not self._peers
            and self._open_attempt.get(rollout_id) == attempt_id
        ):
            # SQLite: an event commit saw it open and this gateway closed nothing since (a
            # close drops it first), so the proxy's check before each call costs no query. Only
            # a commit under the write lock may add to `_open_attempt`: a read here could race
            # a close. Not while another gateway serves the file (`set_peers`).
            return
        if names_no_row(rollout_id):
            raise NotFound(f"rollout {rollout_id!r} has no attempt {attempt_id}")
        ids = {"rollout_id": rollout_id, "attempt_id": attempt_id}
        state: Any
        if self._read_engine is not None:
            state = await asyncio.get_running_loop().run_in_executor(
                self._read_thread, self._attempt_state, ids
            )
        else:
            async with self.engine.connect() as conn:
                state = (await conn.execute(ATTEMPT_STATE, ids)).first()
        if state is None:
            raise NotFound(f"rollout {rollout_id} has no attempt {attempt_id}")
        reason = closed_reason_of(state)
        if reason is not None:
            raise Conflict(reason)

    def _attempt_state(self, ids: dict[str, Any]) -> Any:
        assert self._read_engine is not None
        with self._read_engine.connect() as conn:
            return conn.execute(ATTEMPT_STATE, ids).first()

    # -- events ---------------------------------------------------------------------------

    async def append_events(
        self,
        rollout_id: str,
        attempt_id: int,
        events_in: Sequence[EventIn],
        *,
        from_harness: bool = False,
    ) -> list[Event]:
        if names_no_row(rollout_id):
            # Refused here: in a group commit, its attempt's lookup would fail the others' posts.
            raise NotFound(f"rollout {rollout_id!r} has no attempt {attempt_id}")
        if not events_in:
            if not await self.attempt_exists(rollout_id, attempt_id):
                raise NotFound(f"rollout {rollout_id} has no attempt {attempt_id}")
            if from_harness:
                await self.check_open(rollout_id, attempt_id)
            return []
        append = PendingAppend(
            rollout_id,
            attempt_id,
            self._rows_of(rollout_id, attempt_id, events_in),
            asyncio.get_running_loop().create_future(),
            from_harness=from_harness,
        )
        self._enqueue(append)
        return await asyncio.shield(append.done)

    async def record_calls(
        self, rollout_id: str, attempt_id: int, events_in: Sequence[EventIn]
    ) -> None:
        journal = self._journal
        if (
            not events_in
            or journal is None
            or not journal.is_open
            or self._peers
            or self._open_attempt.get(rollout_id) != attempt_id
            or rollout_id in self._closing
        ):
            await self.append_events(rollout_id, attempt_id, events_in, from_harness=True)
            return
        # A commit saw the attempt open and nothing may close it before this record is stored
        # (`_closing_after_journal`): the journal's write is the durable one.
        rows = self._rows_of(rollout_id, attempt_id, events_in)
        try:
            journal.append(JournaledPost(rollout_id, attempt_id, rows))
        except OSError as error:
            logger.warning("the call journal refused a record (%s): storing it directly", error)
            await self.append_events(rollout_id, attempt_id, events_in, from_harness=True)
            return
        append = PendingAppend(
            rollout_id,
            attempt_id,
            rows,
            asyncio.get_running_loop().create_future(),
            from_harness=True,
            journaled=True,
        )
        append.done.add_done_callback(_log_unstored)
        self._in_journal.append(append)
        self._last_journaled = append.done
        # Its commit waits for the answer to be sent, and for the next calls' (`call_answered`):
        # started at once, its first steps would run on the loop before the answer goes out.
        self._pending.append(append)
        if (self._flusher is None or self._flusher.done()) and self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(
                _FLUSH_AFTER_S, self.flush_soon
            )

    async def set_peers(self, count: int) -> None:
        """Another gateway on the file may close an attempt this one saw open, and could not
        see the calls this one answered from its journal: while `count` others are live, every
        call waits for its commit (which checks its attempt) and the check before a call
        queries. Returns once the calls answered from the journal before are stored."""
        self._peers = count
        if count:
            await self._settle()

    def _forget_bases(self, rollout_id: str) -> None:
        """The rollout's attempts closed: their calls are no longer packing bases."""
        if self._writer is not None:
            self._writer.forget(rollout_id)
        else:
            self._packer.forget(rollout_id)

    def call_answered(self) -> None:
        pending = self._pending
        if (
            len(pending) >= _JOURNAL_BATCH
            or sum(len(row["data"].text) for append in pending for row in append.rows)
            >= _JOURNAL_BATCH_CHARS
        ):
            self.flush_soon()

    def flush_soon(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._pending and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.create_task(self._flush_pending())

    def _enqueue(self, append: PendingAppend) -> None:
        self._pending.append(append)
        self.flush_soon()

    @staticmethod
    def _rows_of(
        rollout_id: str, attempt_id: int, events_in: Sequence[EventIn]
    ) -> list[dict[str, Any]]:
        now = time.time()
        rows = []
        for index, event in enumerate(events_in):
            owner = f"event {index} of the post"
            key = event.idempotency_key or f"srv-{uuid.uuid4().hex}"
            rows.append(
                {
                    "rollout_id": rollout_id,
                    "attempt_id": attempt_id,
                    "type": text_value(event.type, ("type",), owner),
                    "data": encoded(event.data, ("data",), owner),
                    "idempotency_key": text_value(key, ("idempotency_key",), owner),
                    "created_at": now,
                }
            )
        keys = [row["idempotency_key"] for row in rows]
        if len(set(keys)) != len(keys):
            raise Conflict("two events in one post share an idempotency key")
        return rows

    async def _flush_pending(self) -> None:
        retry_s = 0.05
        while self._pending:
            batch: list[PendingAppend] = []
            size = 0
            while self._pending and size < _MAX_EVENTS_PER_COMMIT:
                batch.append(self._pending.popleft())
                size += len(batch[-1].rows)
            try:
                await self._commit_appends(batch)
            except Exception as error:
                waiting = [a for a in batch if a.journaled and not a.done.done()]
                for append in batch:
                    if not append.journaled and not append.done.done():
                        append.done.set_exception(error)
                if waiting:
                    # Answered already, and kept in the journal: retried, in their order, until
                    # the database takes them (a full disk, a lock held elsewhere).
                    self._journal_error = error
                    logger.warning(
                        "%d answered calls are not stored yet (%s); retrying in %.2f s",
                        len(waiting),
                        error,
                        retry_s,
                    )
                    self._pending.extendleft(reversed(waiting))
                    await asyncio.sleep(retry_s)
                    retry_s = min(2 * retry_s, _RETRY_MAX_S)
                continue
            retry_s = 0.05
            self._journal_error = None
        journal = self._journal
        if (
            journal is not None
            and journal.is_open
            and journal.size >= CLEAR_FROM_BYTES
            and self._journal_stored()
        ):
            journal.clear()

    def _journal_stored(self) -> bool:
        """Whether every record in the journal is stored, or refused for good (its attempt gone
        or closed: logged), so the file may be emptied. A post whose commit failed otherwise (a
        database that refused the replay at a start, a commit cut off by a stop) is not: its
        record stays for the next start, though nothing is queued any more."""
        self._in_journal = [a for a in self._in_journal if not _stored_or_refused(a)]
        return not self._in_journal

    async def _commit_appends(self, batch: list[PendingAppend]) -> None:
        unknown = {(a.rollout_id, a.attempt_id) for a in batch} - self._known_attempts
        if unknown:
            async with self.engine.connect() as conn:
                found = await conn.execute(
                    sa.select(attempts.c.rollout_id, attempts.c.attempt_id).where(
                        sa.tuple_(attempts.c.rollout_id, attempts.c.attempt_id).in_(list(unknown))
                    )
                )
                self._known_attempts.update((row.rollout_id, row.attempt_id) for row in found)
        live: list[PendingAppend] = []
        for append in batch:
            if (append.rollout_id, append.attempt_id) in self._known_attempts:
                live.append(append)
            else:
                append.done.set_exception(
                    NotFound(f"rollout {append.rollout_id} has no attempt {append.attempt_id}")
                )
        if not any(append.rows for append in live):
            return
        commit = Commit(
            [append.rows for append in live], [append.from_harness for append in live], set()
        )
        async with self._write_lock or contextlib.nullcontext():
            # Every harness's attempt is checked, also one this gateway knows open: another
            # gateway on the same SQLite file may have closed it (`test_replicas.py` runs two).
            # One indexed read per commit; with the journal's batches, one per 16 proxied calls.
            check = {(a.rollout_id, a.attempt_id) for a in live if a.from_harness and a.rows}
            commit.check = check
            if self._writer is not None:
                written = await self._writer.write(
                    commit, _commit_place(commit.rows, self._pending, batch, alone=not self._peers)
                )
            else:
                async with self.engine.begin() as conn:
                    written, packing = await conn.run_sync(
                        pack_and_insert, self._insert, self._packer, commit
                    )
                remember(self._packer, packing, written.inserted)
            if self._write_lock is not None:
                for rollout_id, attempt_id in written.closed:  # closed by another gateway
                    if self._open_attempt.get(rollout_id) == attempt_id:
                        del self._open_attempt[rollout_id]
                self._open_attempt.update(
                    (r, a)
                    for r, a in check
                    if (r, a) not in written.closed and r not in self._closing
                )
        refused, closed = written.refused, written.closed
        # The row the commit stored for each key, as the writer chose it (`chosen_rows`).
        chosen = chosen_rows(commit.posts, skipped_posts(commit, refused, closed))
        stored = {(e.rollout_id, e.attempt_id, e.idempotency_key): e for e in written.replayed}
        for seq, rollout_id, attempt_id, key in written.inserted:
            row = chosen[(rollout_id, attempt_id, key)]
            stored[(rollout_id, attempt_id, key)] = Event.model_construct(
                seq=seq,
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                type=row["type"],
                data=row["data"].value,
                idempotency_key=key,
                created_at=ts(row["created_at"]),
            )
        for index, append in enumerate(live):
            if index in refused:
                append.done.set_exception(Conflict(refused[index]))
                continue
            refusal = closed.get((append.rollout_id, append.attempt_id))
            self._resolve(append, stored, refusal if append.from_harness else None)

    @staticmethod
    def _resolve(
        append: PendingAppend, stored: dict[Key, Event], refusal: str | None = None
    ) -> None:
        """Answers a post with its stored events. A post to a closed attempt (`refusal`) was
        not stored: it is answered only if every event of it was already there (a retry)."""
        out: list[Event] = []
        for row in append.rows:
            event = stored.get((row["rollout_id"], row["attempt_id"], row["idempotency_key"]))
            if event is None and refusal is not None:
                append.done.set_exception(Conflict(refusal))
                return
            assert event is not None
            if event.type != row["type"] or not same_json(event.data, row["data"]):
                append.done.set_exception(Conflict(reused_key(row)))
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
        token_arrays: bool = False,
    ) -> list[Event]:
        query = _EventsQuery(rollout_id, attempt_id, all_attempts, tuple(types), after, limit)
        restore = partial(restore_rows, token_arrays=token_arrays)
        return await self._read(_fetch_events, restore, query)

    async def get_packed_events(
        self,
        rollout_id: str,
        *,
        attempt_id: int | None = None,
        all_attempts: bool = False,
        types: Sequence[str] = (),
        after: int = 0,
        limit: int = 1000,
    ) -> list[PackedEvent]:
        query = _EventsQuery(rollout_id, attempt_id, all_attempts, tuple(types), after, limit)
        return await self._read(_fetch_rows, _packed_events, query)

    async def record_parts(
        self, rollout_ids: Sequence[str], model: str | None = None
    ) -> list[RolloutParts]:
        ids = list(rollout_ids)
        unnamed = [rid for rid in ids if names_no_row(rid)]
        if unnamed:
            raise NotFound(f"rollouts {unnamed[:5]} do not exist")
        return await self._read(fetch_parts, partial(parts_of, model=model), ids)

    async def _read(
        self,
        fetch: Callable[[sa.Connection, _Q], _F],
        finish: Callable[[_F], _T],
        query: _Q,
    ) -> _T:
        """`finish(fetch(conn, query))` after the journaled records are stored, `finish` (the
        restore: ~0.8 s of CPU for a rollout of 200 calls to 128k tokens) off the event loop,
        where it held up every call the proxy was serving (on PostgreSQL a /healthz waited
        4.1 s while the dashboard and a JSON read restored such a rollout). On SQLite the reads
        run in that thread too, on a connection of its own."""
        await self._settle()
        loop = asyncio.get_running_loop()
        if self._read_engine is not None:
            return await loop.run_in_executor(
                self._bulk_thread, self._read_in_thread, fetch, finish, query
            )
        async with self.engine.connect() as conn:
            fetched = await conn.run_sync(fetch, query)
        return await loop.run_in_executor(self._bulk_thread, finish, fetched)

    def _read_in_thread(
        self, fetch: Callable[[sa.Connection, _Q], _F], finish: Callable[[_F], _T], query: _Q
    ) -> _T:
        assert self._read_engine is not None
        with self._read_engine.connect() as conn:
            return finish(fetch(conn, query))

    # -- models ---------------------------------------------------------------------------

    async def register_models(self, endpoints: Sequence[ModelEndpointIn]) -> list[Model]:
        now = time.time()
        for index, item in enumerate(endpoints):
            owner = f"endpoint {index} of the request"
            text_value(item.endpoint, ("endpoint",), owner)
            text_value(item.engine, ("engine",), owner)
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
        # First registered first: the proxy sends a name it does not know to the first model.
        by_registration = sorted(grouped.items(), key=lambda item: item[1][0].created_at)
        return [
            Model(
                model=name,
                endpoints=[r.endpoint for r in group],
                engine=max(group, key=lambda r: r.updated_at).engine,
                engines=[r.engine for r in group],
                weight_version=max(r.weight_version for r in group),
                updated_at=ts(max(r.updated_at for r in group)),
            )
            for name, group in by_registration
        ]

    async def delete_models(self, model: str | None = None) -> int:
        if model is not None and names_no_row(model):
            return 0
        statement = sa.delete(models)
        if model is not None:
            statement = statement.where(models.c.model == model)
        async with self._write() as conn:
            result = await conn.execute(statement)
        return int(result.rowcount)
