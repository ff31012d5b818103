"""Packed `model_request` rows (`reins.packed`): the store's side.

- `CommitPacking` packs each fresh `model_request` of a group commit against the earlier call
  of its attempt that shares the longest token prefix with it, among the attempt's last
  `CANDIDATES` packed calls, those of the same commit included (`rounds`). Those are kept in
  memory after each commit (a bounded LRU of attempts) and rebuilt from the attempt's rows
  after a restart, an eviction, or a write by another gateway process sharing the database.
  Any earlier packed call of the attempt is a correct base, so a stale memory costs bytes,
  never correctness.
- `expand_rows` restores full events for every read; a page that starts mid-attempt first
  reads the attempt's earlier packed rows, since each one is stored against an earlier one.
- Rows written before packing existed (`packed` is NULL) are read as they are.
- On PostgreSQL a blob is stored in two columns (`split_blob`) so that TOAST's pages fill up;
  every read joins them (`blob_column`, `event_columns`).
"""

from __future__ import annotations

import base64
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa

from reins.gateway import jsonrule
from reins.gateway.store import NotFound
from reins.gateway.store.tables import event_of, events, rollouts
from reins.packed import (
    Base,
    Packed,
    Unpacked,
    base_after,
    base_of,
    pack,
    read_arrays,
    read_prefix,
    unpack,
)
from reins.recordbatch import CallParts, RolloutParts
from reins.samples.records import (
    call_state,
    choice_of,
    of_another_model,
    response_logprobs,
    token_ids,
)
from reins.schemas import MODEL_REQUEST, REWARD, Event, PackedEvent

logger = logging.getLogger(__name__)

CANDIDATES = 4
"""Earlier calls of an attempt a new call is compared with: enough for a side call (a title,
a summary, a sub-agent's turn) between two turns of the main conversation."""
MEMORY_TOKENS = 16_000_000
"""Tokens the candidates of all attempts may hold in memory (64 MB of int32)."""

Attempt = tuple[str, int]


class Packer:
    def __init__(self, memory_tokens: int = MEMORY_TOKENS) -> None:
        self.memory_tokens = memory_tokens
        self._candidates: OrderedDict[Attempt, list[Base]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()  # used from the loop's thread and the writer thread
        self.toast_chunk: int | None = None
        """PostgreSQL's TOAST chunk size (`prepare_blob_split`): blobs are stored split there."""

    def commit(self, conn: sa.Connection) -> CommitPacking:
        """The packing of one group commit on `conn`."""
        return CommitPacking(self, conn)

    def remember(self, attempt: Attempt, base: Base) -> None:
        """A packed call committed: a candidate for the next calls of its attempt."""
        with self._lock:
            held = self._candidates.pop(attempt, [])
            kept = [*held, base][-CANDIDATES:]
            self._held += sum(b.tokens.size for b in kept) - sum(b.tokens.size for b in held)
            self._candidates[attempt] = kept
            while self._held > self.memory_tokens and len(self._candidates) > 1:
                _, dropped = self._candidates.popitem(last=False)
                self._held -= sum(b.tokens.size for b in dropped)

    def forget(self, rollout_id: str) -> None:
        """The rollout's attempts are closed: their calls are no longer bases."""
        with self._lock:
            for attempt in [a for a in self._candidates if a[0] == rollout_id]:
                self._held -= sum(b.tokens.size for b in self._candidates.pop(attempt))

    def bases(self, conn: sa.Connection, attempt: Attempt) -> list[Base]:
        """The attempt's candidates, oldest first (a copy)."""
        with self._lock:
            held = self._candidates.get(attempt)
            if held is not None:
                self._candidates.move_to_end(attempt)
                return list(held)
        # Not in memory: rebuilt from the attempt's packed rows, each against its own base.
        rows = conn.execute(
            sa.select(events.c.seq, blob_column(conn.dialect.name))
            .where(
                events.c.rollout_id == attempt[0],
                events.c.attempt_id == attempt[1],
                events.c.packed.is_not(None),
            )
            .order_by(events.c.seq)
        )
        built: dict[int, Base] = {}
        for seq, blob in rows:
            base_seq = base_of(blob)
            base = None if base_seq is None else built.get(base_seq)
            if base_seq is not None and base is None:
                raise RuntimeError(f"event {seq} is packed against {base_seq}, which is missing")
            arrays = read_arrays(blob, None if base is None else base.text)
            built[seq] = base_after(seq, arrays, base)
        found = list(built.values())[-CANDIDATES:]
        with self._lock:  # kept even when empty: an attempt whose calls cannot be packed is not
            # read again on every call
            if attempt not in self._candidates:
                self._candidates[attempt] = found
                self._held += sum(b.tokens.size for b in found)
        return found


Key = tuple[str, int, str]
"""(rollout, attempt, idempotency key): one event."""


class CommitPacking:
    """One group commit's packing. Its fresh rows are inserted in `rounds`, so that a call
    posted in the same commit as an earlier call of its attempt (a list post, or concurrent
    posts) is packed against that call, which has its seq by then."""

    def __init__(self, packer: Packer, conn: sa.Connection) -> None:
        self._packer = packer
        self._conn = conn
        self._bases: dict[Attempt, list[Base]] = {}
        self.packed: dict[Key, Packed] = {}
        """The packed form of each packed row, by its key."""

    def params(self, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """The INSERT parameters of `rows` (every row gets the packing columns)."""
        out: list[dict[str, Any]] = []
        for row in rows:
            params = {**row, "packed": None, "prompt_tokens": None, "response_tokens": None}
            chunk = self._packer.toast_chunk
            if chunk:
                params["packed_head"] = None
            if row["type"] == MODEL_REQUEST:
                attempt = (row["rollout_id"], row["attempt_id"])
                if attempt not in self._bases:
                    self._bases[attempt] = self._packer.bases(self._conn, attempt)
                result = pack(row["data"].value, self._bases[attempt])
                if result is not None:
                    self.packed[(*attempt, row["idempotency_key"])] = result
                    params["data"] = jsonrule.Encoded(result.skeleton, _text(result.skeleton))
                    if chunk:
                        params["packed_head"], params["packed"] = split_blob(result.blob, chunk)
                    else:
                        params["packed"] = result.blob
                    params["prompt_tokens"] = result.prompt_tokens
                    params["response_tokens"] = result.response_tokens
                else:  # stored whole: its valid token IDs, as the trainer counts them
                    data = row["data"].value
                    if isinstance(data, dict):
                        for part in ("prompt", "response"):
                            ids = token_ids(data.get(f"{part}_token_ids", []))
                            params[f"{part}_tokens"] = 0 if ids is None else int(ids.size)
            out.append(params)
        return out

    def inserted(self, rows: Iterable[tuple[int, str, int, str]]) -> None:
        """Rows inserted, (seq, rollout, attempt, key): the packed ones are bases for the calls
        of the next rounds."""
        for seq, rollout_id, attempt_id, key in rows:
            result = self.packed.get((rollout_id, attempt_id, key))
            if result is not None:
                bases = self._bases[(rollout_id, attempt_id)]
                bases.append(result.as_base(seq))
                del bases[:-CANDIDATES]


def split_blob(blob: bytes, chunk: int) -> tuple[bytes | None, bytes]:
    """A blob as PostgreSQL stores it: (head, rest). The head, whole TOAST chunks, goes out of the
    row (`STORAGE EXTERNAL`) and fills every chunk it takes; the rest (under a chunk) stays in
    the row (`STORAGE MAIN`). Stored in one column, each blob's last chunk was a partial one,
    and the pages of a TOAST table (4 chunks each) kept ~1.3 KB empty that the next full chunk
    could not use: TOAST held 1.13-1.26x the blobs' bytes (docs/benchmarks.md)."""
    cut = len(blob) // chunk * chunk
    return blob[:cut] or None, blob[cut:]


@functools.cache
def blob_column(dialect: str) -> sa.ColumnElement[Any]:
    """A row's packed blob as read (NULL when the row is not packed): on PostgreSQL its two
    columns joined (`split_blob`; a row stored whole, before the split, has no head)."""
    if dialect != "postgresql":
        return events.c.packed
    head = sa.func.coalesce(events.c.packed_head, sa.literal(b"", sa.LargeBinary))
    return head.op("||", return_type=sa.LargeBinary)(events.c.packed).label("packed")


@functools.cache
def event_columns(dialect: str) -> tuple[sa.ColumnElement[Any], ...]:
    """The columns of an events row as read: `packed` is its whole blob."""
    kept = [c for c in events.c if c.name not in ("packed", "packed_head")]
    return (*kept, blob_column(dialect))


def toast_chunk(block_size: int) -> int:
    """PostgreSQL's TOAST chunk size (`TOAST_MAX_CHUNK_SIZE`, heaptoast.h) for 8-byte alignment:
    4 chunk tuples to a page of `block_size` bytes (1,996 for 8 KB pages), less each tuple's
    header (23 bytes, aligned), chunk id, sequence number and length."""
    line_pointers = 24 + 4 * 4  # the page header and 4 line pointers
    per_tuple = (block_size - _aligned(line_pointers)) // 4 // 8 * 8
    return per_tuple - _aligned(23) - 4 - 4 - 4


def _aligned(n: int) -> int:
    return (n + 7) // 8 * 8


def prepare_blob_split(conn: sa.Connection) -> int | None:
    """PostgreSQL: the storage `split_blob` counts on (a head out of the row, uncompressed: the
    blob is compressed already; the rest in it), set once; the chunk size to split at. None
    (blobs stored whole, as before) when the table's storage cannot be set: a role that does
    not own it, or a lock not granted within 10 s."""
    storage = {
        name: str(kind)
        for name, kind in conn.execute(
            sa.text(
                "SELECT attname, attstorage::text FROM pg_attribute "
                "WHERE attrelid = 'events'::regclass AND attname IN ('packed', 'packed_head')"
            )
        )
    }
    if storage != {"packed": "m", "packed_head": "e"}:
        try:
            with conn.begin_nested():
                # Once, at the first start after the upgrade: the ALTER's lock waits for the
                # other gateways' transactions on events, and queues theirs behind it meanwhile.
                conn.execute(sa.text("SET LOCAL lock_timeout = '10s'"))
                conn.execute(
                    sa.text(
                        "ALTER TABLE events ALTER COLUMN packed SET STORAGE MAIN, "
                        "ALTER COLUMN packed_head SET STORAGE EXTERNAL"
                    )
                )
                conn.execute(sa.text("SET LOCAL lock_timeout = DEFAULT"))
        except sa.exc.DBAPIError as error:
            logger.warning(
                "packed calls are stored whole, not split for TOAST's pages (up to ~25 %% more "
                "space): the storage of table events could not be set: %s",
                error,
            )
            return None
    return toast_chunk(int(conn.scalar(sa.text("SELECT current_setting('block_size')"))))


def rounds(rows: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """`rows` split so that no round holds two `model_request`s of one attempt; an attempt's
    rows keep their order (a later round holds only rows posted after the earlier rounds')."""
    out: list[list[dict[str, Any]]] = []
    at: dict[Attempt, int] = {}
    called: set[tuple[Attempt, int]] = set()
    for row in rows:
        attempt = (row["rollout_id"], row["attempt_id"])
        index = at.get(attempt, 0)
        if row["type"] == MODEL_REQUEST:
            if (attempt, index) in called:
                index += 1
                at[attempt] = index
            called.add((attempt, index))
        if index == len(out):
            out.append([])
        out[index].append(row)
    return out


def _text(value: Any) -> str:
    return jsonrule.encode(value).text


@dataclass(frozen=True)
class FetchedRows:
    """Rows read for `restore_rows`, with what restoring them needs: each attempt's packed rows
    in seq order, from its first packed call (each is stored against an earlier one)."""

    rows: list[sa.Row[Any]]
    chains: dict[Attempt, list[sa.Row[Any]]]


def fetch_chains(conn: sa.Connection, rows: Iterable[sa.Row[Any]]) -> FetchedRows:
    """`rows` (any rollouts and types, in any order) and the earlier packed rows of their
    attempts that a page starting mid-attempt lacks: the reads; `restore_rows` does the rest
    without the database (in a thread, off the event loop)."""
    rows = list(rows)
    chains: dict[Attempt, list[sa.Row[Any]]] = {}
    for row in rows:
        if row.packed is not None:
            chains.setdefault((row.rollout_id, row.attempt_id), []).append(row)
    for (rollout_id, attempt_id), chain in chains.items():
        chain.sort(key=lambda r: r.seq)
        if not _complete(chain):
            chains[(rollout_id, attempt_id)] = list(
                conn.execute(
                    sa.select(events.c.seq, events.c.data, blob_column(conn.dialect.name))
                    .where(
                        events.c.rollout_id == rollout_id,
                        events.c.attempt_id == attempt_id,
                        events.c.packed.is_not(None),
                        events.c.seq <= chain[-1].seq,
                    )
                    .order_by(events.c.seq)
                )
            )
    return FetchedRows(rows, chains)


def restore_rows(fetched: FetchedRows, *, token_arrays: bool = False) -> list[Event]:
    """The events of the fetched rows, packed ones restored (`token_arrays`: their prompts as
    int32 arrays, `reins.packed.unpack`)."""
    restored: dict[int, Unpacked] = {}
    for chain in fetched.chains.values():
        for row in chain:
            base_seq = base_of(row.packed)
            base = None if base_seq is None else restored[base_seq]
            restored[row.seq] = unpack(
                row.seq, row.data, row.packed, base, token_arrays=token_arrays
            )
    out = []
    for row in fetched.rows:
        event = event_of(row)
        if row.packed is not None:
            event.data = restored[row.seq].data
        out.append(event)
    return out


def expand_rows(conn: sa.Connection, rows: Iterable[sa.Row[Any]]) -> list[Event]:
    """Events of `rows` (any rollouts and types, in any order) with packed ones restored."""
    return restore_rows(fetch_chains(conn, rows))


def packed_event_of(row: sa.Row[Any]) -> PackedEvent:
    """A row as stored: a packed one's blob in base64, its `data` the other fields."""
    event = event_of(row)
    blob = None if row.packed is None else base64.b64encode(row.packed).decode()
    return PackedEvent.model_construct(**event.__dict__, packed=blob)


def _complete(chain: list[sa.Row[Any]]) -> bool:
    """Whether every base the chain's rows name is in the chain."""
    seqs = {row.seq for row in chain}
    return all((base := base_of(row.packed)) is None or base in seqs for row in chain)


@dataclass(frozen=True)
class FetchedParts:
    """What `parts_of` builds records from: the rollouts asked for, each one's latest attempt,
    and the rows of their calls and rewards."""

    rollout_ids: list[str]
    attempts: dict[str, int]
    rows: list[Any]
    """Rows of (rollout, seq, type, data as text, blob)."""


def fetch_parts(conn: sa.Connection, rollout_ids: Sequence[str]) -> FetchedParts:
    """The reads of the trainer's records (`Store.record_parts`); `parts_of` does the rest
    without the database."""
    found = {
        row.rollout_id: row.attempt_count
        for row in conn.execute(
            sa.select(rollouts.c.rollout_id, rollouts.c.attempt_count).where(
                rollouts.c.rollout_id.in_(list(rollout_ids))
            )
        )
    }
    missing = [rid for rid in rollout_ids if rid not in found]
    if missing:
        raise NotFound(f"rollouts {missing[:5]} do not exist")
    query = (
        sa.select(
            events.c.rollout_id,
            events.c.seq,
            events.c.type,
            # Read as text and parsed here (orjson): the JSON type's reader is most of a row's cost.
            sa.cast(events.c.data, sa.Text).label("data"),
            blob_column(conn.dialect.name),
        )
        .join(
            rollouts,
            sa.and_(
                events.c.rollout_id == rollouts.c.rollout_id,
                events.c.attempt_id == rollouts.c.attempt_count,
            ),
        )
        .where(events.c.rollout_id.in_(list(found)), events.c.type.in_([MODEL_REQUEST, REWARD]))
        .order_by(events.c.rollout_id, events.c.seq)
    )
    return FetchedParts(list(rollout_ids), found, list(conn.execute(query)))


def parts_of(fetched: FetchedParts, model: str | None = None) -> list[RolloutParts]:
    """The calls and last reward of each rollout's latest attempt, as `reins.recordbatch`
    carries them: packed calls as stored (no prompt is rebuilt here), whole ones as arrays.
    With `model` (the policy's registered name), the calls another model served are marked
    (`of_another_model`: a packed call keeps its `model` in the JSON column)."""
    found = fetched.attempts
    parts = {rid: RolloutParts(rid, found[rid], None) for rid in found}
    index: dict[int, int] = {}  # seq -> index of the call in its rollout's list
    for rollout_id, seq, kind, text, blob in fetched.rows:
        rollout = parts[rollout_id]
        decoded = orjson.loads(text)
        if kind == REWARD:
            rollout.reward = decoded
            continue
        data = decoded if isinstance(decoded, dict) else {}
        # `rollout_from_events`'s rule (`reins.samples.records.call_of`): a state that does not
        # validate makes the call skipped (status None).
        state = call_state(data)
        status, gave_up, version = (
            (state.status, state.abandoned, state.model_version) if state else (None, False, None)
        )
        if blob is not None:
            prefix = read_prefix(blob)  # the token stream goes out compressed, as stored
            base_seq = prefix.base_seq
            call = CallParts(
                seq,
                -1 if base_seq is None else index[base_seq],
                prefix.keep,
                prefix.tail,
                prefix.response,
                "none" if prefix.logprob_kind in ("absent", "null") else prefix.logprob_kind,
                status,
                gave_up,
                version,
                stream=memoryview(blob)[prefix.stream],
            )
        else:
            call = _whole_call(seq, data, status, gave_up, version)
        call.other_model = of_another_model(data, model)
        call.choice = choice_of(data)  # a packed call keeps one but 0 in the JSON column
        if call.tokens:
            index[seq] = len(rollout.calls)
        rollout.calls.append(call)
    return [parts[rid] for rid in fetched.rollout_ids]


def _whole_call(
    seq: int, data: dict[str, Any], status: Any, gave_up: Any, version: Any
) -> CallParts:
    """A call stored whole (before packing, or not packable) as the batch carries it."""
    prompt = token_ids(data.get("prompt_token_ids", []))
    response = token_ids(data.get("response_token_ids", []))
    if prompt is None or response is None:
        return CallParts(seq, -1, 0, 0, 0, "none", status, gave_up, version, tokens=False)
    logprobs = response_logprobs(data.get("response_logprobs"), response.size)
    kind = "none" if logprobs is None else "f4"
    arrays = (prompt, response, logprobs)
    return CallParts(
        seq, -1, 0, prompt.size, response.size, kind, status, gave_up, version, arrays=arrays
    )
