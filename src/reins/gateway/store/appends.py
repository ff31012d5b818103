"""Event appends, the hot path: what one group commit writes, in one transaction.

A commit is one transaction of `INSERT ... ON CONFLICT DO NOTHING RETURNING` for every fresh
event of the posts queued since the last one (one multi-row statement on PostgreSQL, the
driver's cached statement per event on SQLite); a replayed idempotency key is answered with the
stored event. Posts
from a harness (its attempt's scoped token) are first checked against their attempt in the same
transaction: PostgreSQL takes `FOR SHARE` on the attempt row, which closing it (a retry, a
terminal state) must update, and SQLite has one writer; so none is stored after its attempt
closed. The admin key's posts are not checked.

A rollout's events commit in the order of their seqs, so a reader paging them with `after` (the
last seq it read) never skips one that committed late: SQLite has one writer, and a gateway's
commits run one at a time; on PostgreSQL, where several gateways may commit at once, each
commit first takes a transaction lock per rollout it writes (`lock_rollouts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sqlite3
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from reins.gateway import jsonrule
from reins.gateway.store.packing import (
    CommitPacking,
    Key,
    Packer,
    event_columns,
    expand_rows,
    rounds,
)
from reins.gateway.store.tables import (
    ATTEMPT_STATE,
    PACKING_COLUMNS,
    attempt_states,
    attempts,
    closed_reason_of,
    events,
    serialize,
)
from reins.schemas import Event

_ONE_LOCKED = ATTEMPT_STATE.with_for_update(read=True, of=attempts)
_LOCK_ROLLOUTS = sa.text(
    "SELECT pg_advisory_xact_lock(k) FROM unnest(CAST(:keys AS BIGINT[])) AS k"
).bindparams(sa.bindparam("keys", type_=sa.ARRAY(sa.BigInteger)))


def lock_rollouts(conn: sa.Connection, rows: list[dict[str, Any]]) -> None:
    """PostgreSQL: a transaction lock on each rollout of `rows`, taken first in a group commit
    (before its INSERT draws their seqs, and before it reads which keys are stored) and held
    until the commit. Without it two gateways' commits of one rollout
    could draw seqs 10 and 11 and commit 11 first: a reader that read 11 then asked for events
    after 11 never saw 10 (two gateways, 8 harnesses: 150 of 14,926 events skipped). Taken in
    the order of their keys, so two commits never wait for each other's locks."""
    keys = sorted(
        {
            int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), signed=True)
            for rid in {row["rollout_id"] for row in rows}
        }
    )
    conn.execute(_LOCK_ROLLOUTS, {"keys": keys})


@dataclass
class Commit:
    """What one group commit writes: each post's rows, in the order the posts came, whether
    each post is a harness's, and the attempts whose state it checks (of harnesses' posts)."""

    posts: list[list[dict[str, Any]]]
    from_harness: list[bool]
    check: set[tuple[str, int]]

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every row of every post."""
        return [row for post in self.posts for row in post]


def skipped_posts(
    commit: Commit, refused: Collection[int], closed: Collection[tuple[str, int]]
) -> set[int]:
    """The posts (by place) whose rows a commit does not store: a list post refused for reusing
    a key, a harness's post to an attempt that closed."""
    return set(refused) | {
        index
        for index, (post, harness) in enumerate(zip(commit.posts, commit.from_harness, strict=True))
        if harness and post and (post[0]["rollout_id"], post[0]["attempt_id"]) in closed
    }


def chosen_rows(posts: list[list[dict[str, Any]]], skipped: Collection[int]) -> dict[Key, Any]:
    """The row a commit stores for each key: the first posted, among the posts not skipped.
    Decided from the posts, not from the keys alone: a key that a skipped post and another post
    both carry is stored with the other post's event (the writer and the gateway's answers both
    read it from here)."""
    chosen: dict[Key, Any] = {}
    for index, post in enumerate(posts):
        if index not in skipped:
            for row in post:
                chosen.setdefault(key_of(row), row)
    return chosen


@dataclass
class Written:
    """A group commit's outcome."""

    inserted: list[tuple[int, str, int, str]]
    """(seq, rollout, attempt, key) of each inserted event."""
    replayed: list[Event]
    """The stored events of keys that were already there."""
    closed: dict[tuple[str, int], str]
    """Why each closed attempt of the check refused its harness's events."""
    refused: dict[int, str]
    """Why each refused list post (by its place in the commit's posts) was refused."""


def commit_events(engine: sa.Engine, packer: Packer, commit: Commit) -> Written:
    """One group commit on a SQLite connection of its own; its packed calls are then bases."""
    with engine.begin() as conn:
        begin_writing(conn)
        written, packing = pack_and_insert(conn, sqlite_insert, packer, commit)
    remember(packer, packing, written.inserted)
    return written


def begin_writing(conn: sa.Connection) -> None:
    """SQLite: takes the database's write lock before the transaction reads anything. Python's
    sqlite3 begins a transaction only at its first INSERT or UPDATE, so what the transaction
    read before (whether an attempt is still open) could be changed by another gateway's commit
    while it waited for the lock, and be acted on after that commit."""
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def pack_and_insert(
    conn: sa.Connection, insert: Any, packer: Packer, commit: Commit
) -> tuple[Written, CommitPacking]:
    """One group commit's statements: the list posts that reuse a key refused, the rows
    packed, inserted, the replays read back."""
    rows = commit.rows
    if rows and conn.dialect.name == "postgresql":
        # First: another gateway's commit of these rollouts is then committed, its keys
        # seen by `_reusing_lists` and its seqs below the ones drawn here.
        lock_rollouts(conn, rows)
    refused = _reusing_lists(conn, commit.posts)
    packing = packer.commit(conn)
    inserted, replayed, closed = insert_events(conn, insert, commit, refused, packing)
    return Written(inserted, expand_rows(conn, replayed), closed, refused), packing


def remember(
    packer: Packer, packing: CommitPacking, inserted: list[tuple[int, str, int, str]]
) -> None:
    """After the commit: its packed calls are bases for their attempts' next calls."""
    for seq, rollout_id, attempt_id, key in inserted:
        packed = packing.packed.get((rollout_id, attempt_id, key))
        if packed is not None:
            packer.remember((rollout_id, attempt_id), packed.as_base(seq))


def _reusing_lists(conn: sa.Connection, posts: list[list[dict[str, Any]]]) -> dict[int, str]:
    """Why each post of several events that reuses a stored key for another event is
    refused, by its place in `posts`. A post is stored whole or not at all: found only
    after its INSERT (as a single event's is), its new events would be stored while it is
    answered 409. Posts of one event need no look-up: a reused key inserts nothing."""
    lists = [(i, post) for i, post in enumerate(posts) if len(post) > 1]
    if not lists:
        return {}
    stored = {
        (e.rollout_id, e.attempt_id, e.idempotency_key): e
        for e in expand_rows(
            conn, stored_rows(conn, [key_of(row) for _, post in lists for row in post])
        )
    }
    refused: dict[int, str] = {}
    for index, post in lists:
        for row in post:
            event = stored.get(key_of(row))
            if event is not None and (
                event.type != row["type"] or not same_json(event.data, row["data"])
            ):
                refused[index] = f"{reused_key(row)}; nothing of this post was stored"
                break
    return refused


def reused_key(row: dict[str, Any]) -> str:
    return (
        f"idempotency key {row['idempotency_key']} of rollout {row['rollout_id']} attempt "
        f"{row['attempt_id']} was already used for another event; a retried post must send the "
        "same event"
    )


def same_json(stored: Any, posted: jsonrule.Encoded) -> bool:
    """Whether a stored event's data is the posted document exactly: as JSON, where `1`,
    `1.0` and `true` differ, and so do `0.0` and `-0.0` and the order of keys."""
    return stored is posted.value or jsonrule.encode(stored).text == posted.text


def insert_events(
    conn: sa.Connection,
    insert: Any,
    commit: Commit,
    refused: Collection[int],
    packing: CommitPacking,
) -> tuple[list[tuple[int, str, int, str]], list[sa.Row[Any]], dict[tuple[str, int], str]]:
    """The INSERTs of the commit's events but those of `refused` posts and of harnesses' posts
    to attempts of its `check` that closed (`packing` packs them: one INSERT per round, usually
    one); returns (seq, rollout, attempt, key) of those inserted, the stored rows of the other
    keys of the posts not refused (replayed posts), and why each closed attempt refused."""
    closed: dict[tuple[str, int], str] = {}
    check = commit.check
    if check:
        # PostgreSQL: a close updates the attempt row, so it waits for this transaction, or this
        # one reads the closed state after it.
        locked = conn.dialect.name == "postgresql"
        if len(check) == 1:  # the usual case: a statement compiled once
            ((rollout_id, attempt_id),) = check
            query = _ONE_LOCKED if locked else ATTEMPT_STATE
            states = conn.execute(query, {"rollout_id": rollout_id, "attempt_id": attempt_id})
        else:
            many = attempt_states(list(check))
            states = conn.execute(many.with_for_update(read=True, of=attempts) if locked else many)
        for state in states:
            reason = closed_reason_of(state)
            if reason is not None:
                closed[(state.rollout_id, state.attempt_id)] = reason
    fresh = list(chosen_rows(commit.posts, skipped_posts(commit, refused, closed)).values())
    inserted: list[tuple[int, str, int, str]] = []
    for part in rounds(fresh):
        done_now = _insert_fresh(conn, insert, packing.params(part))
        packing.inserted(done_now)
        inserted += done_now
    done = {(r, a, k) for _, r, a, k in inserted}
    asked = dict.fromkeys(
        key_of(row) for i, post in enumerate(commit.posts) if i not in refused for row in post
    )
    replayed = stored_rows(conn, [key for key in asked if key not in done])
    return inserted, replayed, closed


def key_of(row: dict[str, Any]) -> Key:
    """(rollout, attempt, idempotency key) of an event row: what the unique index holds."""
    return row["rollout_id"], row["attempt_id"], row["idempotency_key"]


def stored_rows(conn: sa.Connection, keys: list[Key]) -> list[sa.Row[Any]]:
    """The stored rows of these keys (those stored; any order)."""
    by_attempt: dict[tuple[str, int], list[str]] = {}
    for rollout_id, attempt_id, key in keys:
        by_attempt.setdefault((rollout_id, attempt_id), []).append(key)
    found: list[sa.Row[Any]] = []
    for (rollout_id, attempt_id), names in by_attempt.items():
        # Equality on the first two columns, so the whole unique index serves the lookup.
        for start in range(0, len(names), 5000):
            found.extend(
                conn.execute(
                    sa.select(*event_columns(conn.dialect.name)).where(
                        events.c.rollout_id == rollout_id,
                        events.c.attempt_id == attempt_id,
                        events.c.idempotency_key.in_(names[start : start + 5000]),
                    )
                )
            )
    return found


_COLUMNS = ("rollout_id", "attempt_id", "type", "data", "idempotency_key", "created_at")
_SQLITE_INSERT = (
    f"INSERT INTO events ({', '.join(_COLUMNS + PACKING_COLUMNS)}) "
    f"VALUES ({', '.join('?' * len(_COLUMNS + PACKING_COLUMNS))}) "
    "ON CONFLICT (rollout_id, attempt_id, idempotency_key) DO NOTHING RETURNING seq"
)


def _insert_fresh(
    conn: sa.Connection, insert: Any, rows: list[dict[str, Any]]
) -> list[tuple[int, str, int, str]]:
    """INSERT ... ON CONFLICT DO NOTHING RETURNING: (seq, rollout, attempt, key) of each row
    inserted (a key already stored inserts nothing)."""
    driver = conn.connection.driver_connection
    if isinstance(driver, sqlite3.Connection):
        # The gateway's hot path on SQLite: one cached statement of the driver per row, in
        # the same transaction. Through SQLAlchemy the same INSERT of one event cost ~1 ms of
        # CPU in the running gateway (building the statement, its cache key, the
        # many-values rewrite), a third of a proxied call's durable write.
        out = []
        try:
            with contextlib.closing(driver.cursor()) as cursor:
                for row in rows:
                    values = [row[name] for name in _COLUMNS]
                    values[3] = serialize(values[3])
                    found = cursor.execute(
                        _SQLITE_INSERT, (*values, *(row.get(name) for name in PACKING_COLUMNS))
                    ).fetchone()
                    if found is not None:
                        key = (row["rollout_id"], row["attempt_id"], row["idempotency_key"])
                        out.append((found[0], *key))
        except sqlite3.Error as error:
            # As SQLAlchemy raises it, so the gateway's answers stay (a full disk is 507, a
            # locked or vanished database 503).
            raise sa.exc.DBAPIError.instance(
                _SQLITE_INSERT, None, error, sqlite3.Error, dialect=conn.dialect
            ) from error
        return out
    return [
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


@dataclass
class PendingAppend:
    """One event post waiting for the group commit."""

    rollout_id: str
    attempt_id: int
    rows: list[dict[str, Any]]
    done: asyncio.Future[list[Event]]
    from_harness: bool = False
    journaled: bool = False
    """A proxied call already answered: its record is in the call journal (`journal`)."""
    results: dict[str, Event] = field(default_factory=dict)
