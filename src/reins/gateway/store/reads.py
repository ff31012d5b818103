"""The dashboard's reads (`reins.monitor`): filters, orders and per-rollout stats, computed in
the database so that a page of the table costs a few queries whatever the number of events.

Harness data is not trusted: a JSON field read as a number is NULL when it is not one, and on
PostgreSQL a document holding "\\u0000" is read with it as U+FFFD (`nul_free`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from reins.gateway.store import RolloutQuery, RolloutStats
from reins.gateway.store.tables import attempts, events, names_no_row, rollout_of, rollouts
from reins.samples.records import call_state, of_another_model
from reins.schemas import (
    MODEL_REQUEST,
    REWARD,
    Mode,
    Rollout,
    RolloutState,
)

_NUL_ESCAPE = r"((^|[^\\])(\\\\)*)\\u0000"
"""A NUL's escape in JSON text (a PostgreSQL regular expression): "\\u0000" after an even number
of backslashes ("\\\\u0000" is a backslash, then the text "u0000")."""


_INT64_TEXT = "-?[0-9]{1,18}"
"""The JSON text of an integer surely within int64 (a PostgreSQL regular expression; longer ones
are read by `call_state`)."""


def nul_free(column: sa.Column[Any]) -> sa.ColumnElement[Any]:
    """A PostgreSQL json column's document with its NUL characters read as U+FFFD: PostgreSQL
    stores "\\u0000" but any JSON operator on a document holding one fails ("unsupported
    Unicode escape sequence"), so its run, reward and counts read as missing. Only documents
    with a NUL pay for the rewrite (two passes: a pass skips every second of several NULs in a
    row, its match having taken the character before)."""
    text = sa.cast(column, sa.Text)
    once = sa.func.regexp_replace(text, _NUL_ESCAPE, r"\1\\ufffd", "g")
    twice = sa.func.regexp_replace(once, _NUL_ESCAPE, r"\1\\ufffd", "g")
    has_nul = sa.and_(sa.func.strpos(text, "\\u0000") > 0, text.op("~")(_NUL_ESCAPE))
    return sa.type_coerce(sa.case((has_nul, sa.cast(twice, column.type)), else_=column), sa.JSON)


def rollout_filters(
    states: Sequence[RolloutState],
    mode: Mode | None,
    group_id: str | None,
    run: str | None,
    search: str | None,
    *,
    sqlite: bool,
) -> list[sa.ColumnElement[bool]]:
    where: list[sa.ColumnElement[bool]] = []
    if any(names_no_row(text) for text in (group_id or "", run or "")):
        return [sa.false()]  # PostgreSQL text cannot hold NUL, so no rollout can match
    if states:
        where.append(rollouts.c.state.in_(list(states)))
    if mode is not None:
        where.append(rollouts.c.mode == mode)
    if group_id is not None:
        where.append(rollouts.c.group_id == group_id)
    if run is not None:
        # A JSON string only: the databases read other values as text differently (`true` is
        # 1 on SQLite, 'true' on PostgreSQL), so `run=1` matched `"run": true` on SQLite alone.
        if sqlite:
            where.append(sa.func.json_type(rollouts.c.metadata, "$.run") == "text")
            where.append(rollouts.c.metadata["run"].as_string() == run)
        else:
            value = nul_free(rollouts.c.metadata)["run"]
            where.append(sa.func.json_typeof(value) == "string")
            where.append(value.as_string() == run)
    if search:
        # The input's JSON text: rows written before the JSON rule escaped non-ASCII characters,
        # later ones keep them (pydantic-core's encoder): match both.
        # A NUL is in no id, but an input holds it escaped (`\u0000`): only that form is
        # looked for then (PostgreSQL fails a statement comparing text that holds a NUL).
        escaped = json.dumps(search)[1:-1]
        needles = {escaped} if names_no_row(search) else {search, escaped}
        text = sa.cast(rollouts.c.input, sa.Text)
        found = [_contains_folded(text, needle, sqlite=sqlite) for needle in needles]
        if not names_no_row(search):
            found.append(_contains_folded(rollouts.c.rollout_id, search, sqlite=sqlite))
        where.append(sa.or_(*found))
    return where


FOLD = "reins_fold"
"""SQLite's name for `fold`: its own `lower()` folds ASCII letters only, PostgreSQL's all."""


def fold(value: object) -> object:
    """Lower case, as PostgreSQL's `lower()` makes it (every script's letters, not only ASCII),
    one character for one: Python's full mapping makes "İ" (U+0130) two, "i" and a combining
    dot, so "istanbul" did not find "İstanbul" on SQLite while it did on PostgreSQL."""
    return value.replace("\u0130", "i").lower() if isinstance(value, str) else value


def _contains_folded(
    column: sa.ColumnElement[str], needle: str, *, sqlite: bool
) -> sa.ColumnElement[bool]:
    """`needle` in `column`, case folded the same way on both databases ("CAFÉ" finds "café")."""
    if not sqlite:
        return column.icontains(needle, autoescape=True)
    return sa.func.reins_fold(column).contains(fold(needle), autoescape=True)


class DashboardReads:
    """The dashboard's queries, mixed into `SqlStore`."""

    engine: AsyncEngine
    is_sqlite: bool

    async def _settle(self) -> None:
        """Waits for the events the store answered before storing them (`SqlStore`)."""

    async def query_rollouts(self, query: RolloutQuery) -> tuple[list[Rollout], int]:
        await self._settle()  # sorted by reward: read from the events
        where = rollout_filters(
            query.states,
            query.mode,
            query.group_id,
            query.run,
            query.search,
            sqlite=self.is_sqlite,
        )
        key, source = self._sort_key(query)
        order = [
            sa.nulls_last(key.desc() if query.descending else key.asc()),
            rollouts.c.created_at.desc(),
            rollouts.c.rollout_id,
        ]
        page = sa.select(rollouts).select_from(source).where(*where).order_by(*order)
        total = sa.select(sa.func.count()).select_from(rollouts).where(*where)
        async with self.engine.connect() as conn:
            count = int(await conn.scalar(total) or 0)
            rows = await conn.execute(page.offset(query.offset).limit(query.limit))
            return [rollout_of(row) for row in rows], count

    def _sort_key(self, query: RolloutQuery) -> tuple[sa.ColumnElement[Any], sa.FromClause]:
        """The page's sort key, and the rows it is read from (`rollouts` and what it joins).
        Every rollout's key is computed to sort them. On PostgreSQL a subquery a rollout was
        12,000 index scans at 12,000 rollouts, and a plan costly enough for its JIT to compile
        (~25-45 ms a page): the keys come from joins there. SQLite's seeks are cheaper."""
        if query.sort == "reward":
            return self._last_reward()
        if query.sort == "duration":
            started, ended, source = self._attempt_times()
            # A running rollout counts up to now, as the dashboard's table shows it: without
            # an end it sorted last, as if it had no duration.
            now = sa.literal(time.time(), sa.Float)
            running = rollouts.c.state == "running"
            key = sa.case((running, sa.func.coalesce(ended, now)), else_=ended) - started
            return key, source
        columns: dict[str, sa.ColumnElement[Any]] = {
            "created": rollouts.c.created_at,
            "updated": rollouts.c.updated_at,
            "state": rollouts.c.state,
            "id": rollouts.c.rollout_id,
        }
        return columns[query.sort], rollouts

    def _attempt_times(
        self,
    ) -> tuple[sa.ColumnElement[Any], sa.ColumnElement[Any], sa.FromClause]:
        """Per rollout row: when its first attempt started, when its latest one ended, and the
        rows they are read from."""
        first = attempts.alias("first_attempt")
        latest = attempts.alias("latest_attempt")
        is_first = sa.and_(first.c.rollout_id == rollouts.c.rollout_id, first.c.attempt_id == 1)
        is_latest = sa.and_(
            latest.c.rollout_id == rollouts.c.rollout_id,
            latest.c.attempt_id == rollouts.c.attempt_count,
        )
        if self.is_sqlite:
            # A seek a rollout is SQLite's cheapest way (joined, it read the rollouts in id
            # order, 4-5x slower).
            started = sa.select(first.c.created_at).where(is_first).scalar_subquery()
            ended = sa.select(latest.c.ended_at).where(is_latest).scalar_subquery()
            return started, ended, rollouts
        source = rollouts.outerjoin(first, is_first).outerjoin(latest, is_latest)
        return first.c.created_at, latest.c.ended_at, source

    def _last_reward(self) -> tuple[sa.ColumnElement[Any], sa.FromClause]:
        """The value of the latest attempt's last `reward` event, per rollout row (NULL when it
        has none), read through the reward events' own index (`tables.REWARD_EVENTS`)."""
        # A literal, not a parameter: a plan made for any type (PostgreSQL's generic plan of a
        # prepared statement) cannot use an index of the `reward` rows alone.
        is_reward = events.c.type == sa.literal_column(f"'{REWARD}'")
        value = self._json_number(events.c.data, "value")
        if self.is_sqlite:
            # SQLite finds each rollout's row in the index: one seek a rollout.
            last = (
                sa.select(value)
                .where(
                    events.c.rollout_id == rollouts.c.rollout_id,
                    events.c.attempt_id == rollouts.c.attempt_count,
                    is_reward,
                )
                .order_by(events.c.seq.desc())
                .limit(1)
                .scalar_subquery()
            )
            return last, rollouts
        # PostgreSQL: the last reward of every attempt in one pass over the reward rows,
        # joined (a scan of the index a rollout was 2x slower, ~15 us each at 12,000 rollouts).
        rewards = (
            sa.select(events.c.rollout_id, events.c.attempt_id, value.label("value"))
            .where(is_reward)
            .distinct(events.c.rollout_id, events.c.attempt_id)
            .order_by(events.c.rollout_id, events.c.attempt_id, events.c.seq.desc())
            .subquery("last_reward")
        )
        source = rollouts.outerjoin(
            rewards,
            sa.and_(
                rewards.c.rollout_id == rollouts.c.rollout_id,
                rewards.c.attempt_id == rollouts.c.attempt_count,
            ),
        )
        return rewards.c.value, source

    def _json_number(self, column: sa.Column[Any], key: str) -> sa.ColumnElement[Any]:
        """`column[key]` when it is a JSON number, else NULL (harness data is not trusted)."""
        if self.is_sqlite:
            path = f'$."{key}"'
            kind = sa.func.json_type(column, path)
            return sa.case((kind.in_(["integer", "real"]), sa.func.json_extract(column, path)))
        value = nul_free(column)[key]
        is_number = sa.func.json_typeof(value) == "number"
        # NUMERIC, not a double: a version past 2**53 stays exact (SQLite's are 64-bit ints).
        return sa.case((is_number, sa.cast(value.as_string(), sa.Numeric)))

    def _call_fields(self) -> _CallFields:
        """The fields of a `model_request` row that the stats read (`rollout_stats`)."""
        if self.is_sqlite:
            return _SqliteCallFields()
        return _PostgresCallFields()

    def _json_length(self, column: sa.Column[Any], key: str) -> sa.ColumnElement[Any]:
        """Length of the JSON array `column[key]`; 0 when it is not an array."""
        if self.is_sqlite:
            path = f'$."{key}"'
            is_array = sa.func.json_type(column, path) == "array"
            return sa.case((is_array, sa.func.json_array_length(column, path)), else_=0)
        value = nul_free(column)[key]
        is_array = sa.func.json_typeof(value) == "array"
        return sa.case((is_array, sa.func.json_array_length(value)), else_=0)

    def _token_count(self, part: str) -> sa.ColumnElement[Any]:
        """A call's prompt or response tokens: the packed row's column, else its JSON array."""
        column = events.c[f"{part}_tokens"]
        return sa.func.coalesce(column, self._json_length(events.c.data, f"{part}_token_ids"))

    async def rollout_stats(
        self, rollout_ids: Sequence[str], model: str | None = None
    ) -> dict[str, RolloutStats]:
        ids = list(dict.fromkeys(rollout_ids))
        if not ids:
            return {}
        await self._settle()
        latest = events.join(
            rollouts,
            sa.and_(
                events.c.rollout_id == rollouts.c.rollout_id,
                events.c.attempt_id == rollouts.c.attempt_count,
            ),
        )
        fields = self._call_fields()
        calls_from = fields.from_clause(latest)
        # The versions of the calls the trainer trains (`samples.records.call_of`): a failed or
        # abandoned call's version must not make a group look too stale to train. SQL reads
        # the calls whose fields have the proxy's types (`_CallFields.plain`: a status not given
        # is `ModelRequest`'s 200); the others are read below by `call_state`, the readers' own
        # rule, so that `"200"`, `1.5` or a version past int64 count as the trainer reads
        # them. Token counts are those of valid token IDs (`store.packing`; rows before
        # 2026-12-07 that were stored whole count their lists' lengths).
        plain = fields.plain()
        tokens = sa.and_(self._token_count("prompt") > 0, self._token_count("response") > 0)
        served = fields.text("model") if model is not None else sa.null()
        each_call = (
            sa.select(
                events.c.rollout_id,
                plain.label("plain"),
                fields.number("status").label("status"),
                fields.is_true("abandoned").label("abandoned"),
                served.label("served"),
                fields.number("model_version").label("version"),
                self._token_count("prompt").label("prompt"),
                self._token_count("response").label("resp"),
            )
            .select_from(calls_from)
            .where(events.c.rollout_id.in_(ids), events.c.type == MODEL_REQUEST)
        )
        if self.is_sqlite:
            # Each field read once a call: SQLite puts a subquery's expressions in place of
            # each use of its columns, unless it has an OFFSET.
            each_call = each_call.limit(-1).offset(0)
        call = each_call.subquery("each_call")
        status = call.c.status
        trained = sa.and_(
            call.c.plain,
            sa.or_(status == 200, status.is_(None)),
            sa.not_(call.c.abandoned),
            call.c.prompt > 0,
            call.c.resp > 0,
        )
        if model is not None:  # another model's calls are not trained either (`of_another_model`)
            trained = sa.and_(trained, sa.or_(call.c.served.is_(None), call.c.served == model))
        version = sa.case((trained, call.c.version))
        calls = sa.select(
            call.c.rollout_id,
            sa.func.count().label("calls"),
            sa.func.sum(sa.case((sa.and_(call.c.plain, status != 200), 1), else_=0)).label(
                "failed"
            ),
            sa.func.sum(call.c.prompt).label("prompt"),
            sa.func.sum(call.c.resp).label("resp"),
            sa.func.min(version).label("min_version"),
            sa.func.max(version).label("max_version"),
            sa.func.sum(sa.case((call.c.plain, 0), else_=1)).label("loose"),
        ).group_by(call.c.rollout_id)

        def loose_calls(rollout_ids: list[str]) -> sa.Select[Any]:
            text = sa.cast(events.c.data, sa.Text).label("data")
            return (
                sa.select(events.c.rollout_id, text, tokens.label("tokens"))
                .select_from(calls_from)
                .where(
                    events.c.rollout_id.in_(rollout_ids),
                    events.c.type == MODEL_REQUEST,
                    sa.not_(plain),
                )
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
            with_loose = []
            for agg in await conn.execute(calls):
                if agg.loose:
                    with_loose.append(agg.rollout_id)
                found[agg.rollout_id].update(
                    calls=int(agg.calls),
                    failed_calls=int(agg.failed or 0),
                    prompt_tokens=int(agg.prompt or 0),
                    response_tokens=int(agg.resp or 0),
                    min_version=None if agg.min_version is None else int(agg.min_version),
                    max_version=None if agg.max_version is None else int(agg.max_version),
                )
            if with_loose:  # rare: only an admin's posts make them
                for rollout_id, text, has_tokens in await conn.execute(loose_calls(with_loose)):
                    _count_loose_call(found[rollout_id], json.loads(text), bool(has_tokens), model)
            for reward in await conn.execute(rewards):
                found[reward.rollout_id]["reward"] = None if reward.v is None else float(reward.v)
        return {rollout_id: RolloutStats(**values) for rollout_id, values in found.items()}

    async def count_rollouts(self) -> dict[tuple[str, str], int]:
        query = sa.select(rollouts.c.state, rollouts.c.mode, sa.func.count()).group_by(
            rollouts.c.state, rollouts.c.mode
        )
        async with self.engine.connect() as conn:
            return {(row[0], row[1]): int(row[2]) for row in await conn.execute(query)}


_CALL_FIELDS = ("status", "abandoned", "model_version", "model")
"""The fields of a `model_request` that the stats read (all in the JSON column of a packed
row, `reins.packed.COLUMN_FIELDS`)."""


class _CallFields:
    """The fields of a `model_request` event row as the stats read them (`rollout_stats`):
    `from_clause` joins whatever they are read from to the events."""

    def from_clause(self, events_join: sa.FromClause) -> sa.FromClause:
        return events_join

    def number(self, key: str) -> sa.ColumnElement[Any]:
        """The field when it is a JSON number, else NULL (harness data is not trusted)."""
        raise NotImplementedError

    def text(self, key: str) -> sa.ColumnElement[Any]:
        """The field when it is a JSON string, else NULL."""
        raise NotImplementedError

    def is_true(self, key: str) -> sa.ColumnElement[bool]:
        """Whether the field is JSON `true`."""
        raise NotImplementedError

    def plain(self) -> sa.ColumnElement[bool]:
        """Whether `status`, `abandoned` and `model_version` are of the types the proxy writes
        (an integer, a boolean, an integer or null; each may be missing), so that SQL reads them
        as `reins.samples.records.call_state` does. Others (`"200"`, `1.5`, `true` as a
        version, an integer past int64), which only an admin's post can store, are read by
        `call_state` itself (`rollout_stats`)."""
        raise NotImplementedError


class _SqliteCallFields(_CallFields):
    """SQLite: JSON functions on the row's document."""

    def _kind(self, key: str) -> sa.ColumnElement[Any]:
        return sa.func.json_type(events.c.data, f'$."{key}"')

    def _value(self, key: str) -> sa.ColumnElement[Any]:
        return sa.func.json_extract(events.c.data, f'$."{key}"')

    def number(self, key: str) -> sa.ColumnElement[Any]:
        return sa.case((self._kind(key).in_(["integer", "real"]), self._value(key)))

    def text(self, key: str) -> sa.ColumnElement[Any]:
        return sa.case((self._kind(key) == "text", self._value(key)))

    def is_true(self, key: str) -> sa.ColumnElement[bool]:
        return sa.func.coalesce(self._kind(key) == "true", sa.false())

    def _int64(self, key: str) -> sa.ColumnElement[bool]:
        # `json_type` says "integer" past int64 too, where `json_extract` gives a REAL.
        exact = sa.func.typeof(self._value(key)) == "integer"
        return sa.and_(self._kind(key) == "integer", exact)

    def plain(self) -> sa.ColumnElement[bool]:
        kind = self._kind
        return sa.and_(
            sa.or_(kind("status").is_(None), self._int64("status")),
            sa.or_(kind("abandoned").is_(None), kind("abandoned").in_(["true", "false"])),
            sa.or_(
                kind("model_version").is_(None),
                kind("model_version") == "null",
                self._int64("model_version"),
            ),
        )


class _PostgresCallFields(_CallFields):
    """PostgreSQL: the fields read once per row, by one `json_to_record` of the `nul_free`
    document. Each `->` parses the whole document again and each `nul_free` reads its text:
    the stats test a call's fields a dozen times, which made them 1.6-2 times as slow."""

    def __init__(self) -> None:
        columns = (sa.column(key, sa.JSON) for key in _CALL_FIELDS)
        record = sa.func.json_to_record(nul_free(events.c.data)).table_valued(*columns)
        self.record = record.render_derived(name="call_fields", with_types=True)

    def from_clause(self, events_join: sa.FromClause) -> sa.FromClause:
        # A function in FROM may read the rows before it (PostgreSQL's implicit LATERAL).
        return events_join.join(self.record, sa.true())

    def _value(self, key: str) -> sa.ColumnElement[Any]:
        """The field's JSON value; SQL NULL when it is missing or JSON null."""
        return self.record.c[key]

    def _source(self, key: str) -> sa.ColumnElement[Any]:
        """The field's JSON text (`7`, `"7"`, `true`, `null`); NULL when it is missing.
        `json_to_record` reads a JSON null as SQL NULL, so a NULL is looked up again: rare,
        the proxy writes every field it reads."""
        value = sa.cast(self._value(key), sa.Text)
        again = sa.cast(nul_free(events.c.data)[key], sa.Text)
        return sa.case((value.is_(None), again), else_=value)

    def number(self, key: str) -> sa.ColumnElement[Any]:
        value = self._value(key)
        # NUMERIC, not a double: a version past 2**53 stays exact (SQLite's are 64-bit ints).
        number = sa.cast(sa.cast(value, sa.Text), sa.Numeric)
        return sa.case((sa.func.json_typeof(value) == "number", number))

    def text(self, key: str) -> sa.ColumnElement[Any]:
        value = self._value(key)
        unquoted = value.op("#>>")(sa.literal_column("'{}'::text[]"))
        return sa.case((sa.func.json_typeof(value) == "string", unquoted))

    def is_true(self, key: str) -> sa.ColumnElement[bool]:
        return sa.func.coalesce(sa.cast(self._value(key), sa.Text) == "true", sa.false())

    def plain(self) -> sa.ColumnElement[bool]:
        status = self._source("status").op("~")(f"^{_INT64_TEXT}$")
        abandoned = self._source("abandoned").in_(["true", "false"])
        # A NULL version is missing or JSON null: both plain.
        version = sa.cast(self._value("model_version"), sa.Text)
        version_plain = version.op("~")(f"^{_INT64_TEXT}$")
        # NULL: the field is missing, which is plain.
        tests = (status, abandoned, version_plain)
        return sa.and_(*(sa.func.coalesce(test, sa.true()) for test in tests))


def _count_loose_call(
    stats: dict[str, Any], data: Any, has_tokens: bool, model: str | None
) -> None:
    """Adds a call whose fields SQL does not read (`_CallFields.plain`) to its
    rollout's `stats`, as the trainer's readers read it (`call_state`)."""
    state = call_state(data) if isinstance(data, dict) else None
    if state is None:
        return  # skipped by the readers: neither failed nor trained
    if state.status != 200:
        stats["failed_calls"] = stats.get("failed_calls", 0) + 1
        return
    version = state.model_version
    trained = not state.abandoned and has_tokens and not of_another_model(data, model)
    if not trained or version is None:
        return
    low, high = stats.get("min_version"), stats.get("max_version")
    stats["min_version"] = version if low is None else min(low, version)
    stats["max_version"] = version if high is None else max(high, version)
