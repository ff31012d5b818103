"""The store's schema, what its rows may hold, and their conversion to the wire types.

- Plain `json` columns, not `jsonb`, on PostgreSQL: jsonb rejects "\\u0000", which harness text
  can carry.
- Every JSON document is written as the text `reins.gateway.jsonrule` encoded (`encoded`,
  `serialize`): no NaN, no unpaired surrogate, bounded depth, so every row reads back on both
  databases; text columns refuse unpaired surrogates too (`text_value`).
- An attempt is closed to its harness once it is superseded or its rollout is terminal
  (`closed_reason`, read with `attempt_states`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from reins.gateway import jsonrule
from reins.gateway.store import Invalid
from reins.schemas import (
    NUL_TEXT_MESSAGE,
    TERMINAL_STATES,
    Attempt,
    Event,
    Rollout,
    RolloutConfig,
    RolloutSpec,
    RolloutStatus,
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
    # A packed `model_request` (`reins.packed`, `store.packing`): `data` holds its other fields.
    sa.Column("packed", sa.LargeBinary),
    sa.Column("prompt_tokens", sa.Integer),
    sa.Column("response_tokens", sa.Integer),
    # PostgreSQL only: a packed blob's whole TOAST chunks, `packed` the rest of it, kept in the
    # row (`store.packing.split_blob`); read joined (`store.packing.blob_column`).
    sa.Column("packed_head", sa.LargeBinary),
    sa.UniqueConstraint("rollout_id", "attempt_id", "idempotency_key", name="uq_events_key"),
)
PACKING_COLUMNS = ("packed", "prompt_tokens", "response_tokens")
"""Added to `events` when packing came in: `SqlStore.init` adds them to an older database."""
ADDED_COLUMNS = (*PACKING_COLUMNS, "packed_head")
"""The columns `SqlStore.init` adds to an older database (`packed_head` on 2026-12-06)."""

_IS_REWARD = sa.text("type = 'reward'")
REWARD_EVENTS = sa.Index(
    "ix_events_reward",
    events.c.rollout_id,
    events.c.attempt_id,
    events.c.seq,
    sqlite_where=_IS_REWARD,
    postgresql_where=_IS_REWARD,
)
"""The `reward` events alone, by attempt then seq: the dashboard's sort by reward reads each
rollout's last one (`reads.DashboardReads._last_reward`); the other events' writes skip it."""
ADDED_INDEXES = (REWARD_EVENTS,)
"""The indexes `SqlStore.init` adds to an older database (`ix_events_reward` on 2026-12-07)."""

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

gateway_replicas = sa.Table(
    "gateway_replicas",
    metadata,
    sa.Column("replica_id", sa.String(100), primary_key=True),
    sa.Column("address", sa.String(300), nullable=False),
    sa.Column("seen_epoch", sa.BigInteger, nullable=False),
    sa.Column("paused", sa.Boolean, nullable=False),
    sa.Column("in_flight", sa.Integer, nullable=False),
    sa.Column("held", sa.Integer, nullable=False),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("heartbeat_at", sa.Float, nullable=False),
)
"""Each gateway process sharing this database, as it last reported itself (`store.board`)."""

leases = sa.Table(
    "leases",
    metadata,
    sa.Column("name", sa.String(50), primary_key=True),
    sa.Column("holder", sa.String(300), nullable=False),
    sa.Column("since", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
)
"""One holder at a time of a named role (`store.leases`: the rollout controller)."""

meta = sa.Table(
    "meta",
    metadata,
    sa.Column("key", sa.String(50), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)


def serialize(value: Any) -> str:
    """The JSON text of a column value: already encoded by the store's writes (`encoded`)."""
    if type(value) is jsonrule.Encoded:
        return value.text
    return jsonrule.encode(value).text


def encoded(value: Any, loc: jsonrule.Loc, owner: str) -> jsonrule.Encoded:
    """A document under the JSON rule, or `Invalid` naming `owner` and the field."""
    try:
        return jsonrule.encode(value, loc)
    except jsonrule.JsonRuleError as error:
        raise Invalid(f"{owner}: {error}", [error.error()]) from None


def text_value(value: str | None, loc: jsonrule.Loc, owner: str) -> str | None:
    """A text column's value: no unpaired surrogate (it has no UTF-8 form), no NUL (PostgreSQL's
    text cannot hold one: its driver fails the statement, and with it the whole group commit of
    an event; refused on SQLite too, so that both stores keep the same values)."""
    if value is not None:
        problem = jsonrule.find(value, loc)
        if problem is not None:
            raise Invalid(f"{owner}: {problem}", [problem.error()])
        if "\x00" in value:
            where = ".".join(str(part) for part in loc)
            error = {"loc": loc, "msg": NUL_TEXT_MESSAGE, "type": "nul_character"}
            raise Invalid(f"{owner}: {where}: {NUL_TEXT_MESSAGE}", [error])
    return value


def names_no_row(key: str) -> bool:
    """Whether a looked-up id or name (a rollout id from a path, a filter) can name no stored
    row: one with a NUL, which no text field holds (`text_value`), and which PostgreSQL could
    not even compare (its driver fails the statement: a 500, not the 404 it is)."""
    return "\x00" in key


def closed_reason(
    rollout_id: str,
    attempt_id: int,
    attempt_state: str,
    attempt_reason: str | None,
    rollout_state: str,
    attempt_count: int,
) -> str | None:
    """Why an attempt accepts nothing more from its harness; None while it is open."""
    if rollout_state in TERMINAL_STATES:
        return (
            f"rollout {rollout_id} is {rollout_state}; attempt {attempt_id} accepts no more "
            "events or calls from its harness"
        )
    if attempt_id < attempt_count:
        default = f"superseded by attempt {attempt_id + 1}"
        why = f" ({attempt_reason})" if attempt_reason and attempt_reason != default else ""
        return (
            f"attempt {attempt_id} of rollout {rollout_id} was superseded by attempt "
            f"{attempt_count}{why}; it accepts no more events or calls from its harness"
        )
    if attempt_state != "running":
        return (
            f"attempt {attempt_id} of rollout {rollout_id} is {attempt_state}; it accepts no "
            "more events or calls from its harness"
        )
    return None


def closed_reason_of(state: Any) -> str | None:
    """`closed_reason` of a row of `attempt_states` or `ATTEMPT_STATE`."""
    return closed_reason(
        state.rollout_id,
        state.attempt_id,
        state.state,
        state.reason,
        state.rollout_state,
        state.attempt_count,
    )


def attempt_states(
    pairs: Sequence[tuple[str, int]],
) -> sa.Select[Any]:
    """The state of each attempt and of its rollout (the columns `closed_reason` takes)."""
    return (
        sa.select(
            attempts.c.rollout_id,
            attempts.c.attempt_id,
            attempts.c.state,
            attempts.c.reason,
            rollouts.c.state.label("rollout_state"),
            rollouts.c.attempt_count,
        )
        .join(rollouts, rollouts.c.rollout_id == attempts.c.rollout_id)
        .where(sa.tuple_(attempts.c.rollout_id, attempts.c.attempt_id).in_(list(pairs)))
    )


ATTEMPT_STATE = (
    sa.select(
        attempts.c.rollout_id,
        attempts.c.attempt_id,
        attempts.c.state,
        attempts.c.reason,
        rollouts.c.state.label("rollout_state"),
        rollouts.c.attempt_count,
    )
    .join(rollouts, rollouts.c.rollout_id == attempts.c.rollout_id)
    .where(
        attempts.c.rollout_id == sa.bindparam("rollout_id"),
        attempts.c.attempt_id == sa.bindparam("attempt_id"),
    )
)
"""`attempt_states` of one attempt, built once (its compiled form is cached): the proxy runs it
on every call."""


def ts(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def spec_digest(spec: RolloutSpec) -> str:
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def rollout_of(row: sa.Row[Any]) -> Rollout:
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
        created_at=ts(row.created_at),
        updated_at=ts(row.updated_at),
    )


def attempt_of(row: sa.Row[Any]) -> Attempt:
    return Attempt(
        rollout_id=row.rollout_id,
        attempt_id=row.attempt_id,
        state=row.state,
        reason=row.reason,
        created_at=ts(row.created_at),
        ended_at=None if row.ended_at is None else ts(row.ended_at),
    )


def event_of(row: sa.Row[Any]) -> Event:
    # Rows are the store's own, validated when they came in: no second validation.
    return Event.model_construct(
        seq=row.seq,
        rollout_id=row.rollout_id,
        attempt_id=row.attempt_id,
        type=row.type,
        data=row.data,
        idempotency_key=row.idempotency_key,
        created_at=ts(row.created_at),
    )
