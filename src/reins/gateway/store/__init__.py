"""The gateway's durable store: one protocol, one SQL implementation for SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from sqlalchemy import exc as sa_exc

from reins.schemas import (
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
    RolloutStats,
    RolloutUpdate,
)

if TYPE_CHECKING:
    from reins.gateway.store.board import ReplicaBoard
    from reins.gateway.store.leases import Leases
    from reins.recordbatch import RolloutParts


class StoreError(Exception):
    """A request the store refuses; the message says what was wrong and what to do."""


OUTAGES: tuple[type[Exception], ...] = (sa_exc.DBAPIError, ConnectionError)
"""What a write raises when the database (or SQLite's writer process) fails it: the request was
not acknowledged (the gateway answers 503 or 507, `gateway.app`)."""


class NotFound(StoreError):
    pass


class Conflict(StoreError):
    pass


class Invalid(StoreError):
    """A value the store cannot keep faithfully (see `reins.gateway.jsonrule`); answered 422.

    `errors` are pydantic-style (`loc`, `msg`, `type`), `loc` relative to the stored object."""

    def __init__(self, message: str, errors: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.errors = errors


RolloutSort = Literal["created", "updated", "duration", "reward", "state", "id"]
"""Orders of `Store.query_rollouts` (the dashboard's table)."""


@dataclass(frozen=True)
class RolloutQuery:
    """A page of rollouts for the dashboard: filters, an order, an offset."""

    states: Sequence[RolloutState] = ()
    mode: Mode | None = None
    group_id: str | None = None
    run: str | None = None
    """Keep rollouts whose `metadata.run` is this (the trainer's run name)."""
    search: str | None = None
    """Case-insensitive substring of the rollout id or of the input's JSON text."""
    sort: RolloutSort = "created"
    descending: bool = True
    offset: int = 0
    limit: int = 50


class Store(Protocol):
    """Every write is idempotent, so callers may retry any of them after a lost reply."""

    board: ReplicaBoard
    """What the gateway processes sharing the database tell each other (`gateway.replicas`)."""
    leases: Leases
    """One holder at a time of a named role: the rollout controller (`store.leases`)."""

    async def init(self) -> None:
        """Create the tables if needed. Safe to call on every start."""

    async def close(self) -> None: ...

    async def token_secret(self) -> bytes:
        """A random secret made once per database; scoped tokens survive gateway restarts."""

    async def create_rollouts(self, specs: Sequence[RolloutSpec]) -> list[Rollout]:
        """Same id + same spec returns the existing rollout; same id + another spec: Conflict."""

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
        """Rollouts whose last change came after `cursor`, in the order of their changes; the
        page carries the database's `database_id`, since cursors count one database's changes.

        `run` keeps rollouts whose `metadata.run` equals it; `search` is a case-insensitive
        substring of the rollout id or of the input's JSON text.
        """

    async def query_rollouts(self, query: RolloutQuery) -> tuple[list[Rollout], int]:
        """One page of rollouts in the query's order, and how many match in all."""

    async def rollout_stats(
        self, rollout_ids: Sequence[str], model: str | None = None
    ) -> dict[str, RolloutStats]:
        """Calls, tokens, weight versions, reward and times of each rollout's latest attempt.
        With `model`, the versions are those of the calls that model served (and of calls
        recorded without a model)."""

    async def count_rollouts(self) -> dict[tuple[str, str], int]:
        """How many rollouts are in each (state, mode); absent pairs are 0."""

    async def get_rollout(self, rollout_id: str) -> RolloutDetail: ...

    async def update_rollout(self, rollout_id: str, update: RolloutUpdate) -> Rollout:
        """Checks `VALID_TRANSITIONS`; setting the current state again is a no-op."""

    async def open_attempt(self, rollout_id: str, request: AttemptCreate) -> Attempt:
        """Opens the next attempt; a queuing rollout becomes running, a running attempt fails."""

    async def attempt_exists(self, rollout_id: str, attempt_id: int) -> bool: ...

    async def check_open(self, rollout_id: str, attempt_id: int) -> None:
        """Raises NotFound for an unknown attempt, Conflict (saying why) for one that accepts
        nothing more from its harness: superseded by a later attempt, or of a terminal rollout."""

    async def append_events(
        self,
        rollout_id: str,
        attempt_id: int,
        events: Sequence[EventIn],
        *,
        from_harness: bool = False,
    ) -> list[Event]:
        """Stored once per idempotency key; a replay returns the stored event.

        `from_harness`: posted with the attempt's scoped token, so refused (Conflict) once the
        attempt is closed (see `check_open`), checked in the transaction that would store them.
        Values JSON cannot carry are refused (Invalid) whoever posts them.
        """

    async def record_calls(
        self, rollout_id: str, attempt_id: int, events: Sequence[EventIn]
    ) -> None:
        """Stores a proxied call's events as the harness's post (`append_events`,
        `from_harness`); returns once they are durable. A SQLite gateway may return before
        they are in the database (`store.journal`): every read and every close of the
        attempt waits for them."""

    needs_peers_known: bool
    """Whether, after `init`, this gateway must wait before it serves until every other live
    gateway on the database knows it joined (`set_peers`): on SQLite, when another gateway
    holds the call journal, from which it answers calls before their commit."""

    async def set_peers(self, count: int) -> None:
        """How many other gateways serve the database (`gateway.replicas`, after each count).
        With any, each call's answer waits for its commit. Returns once the calls answered
        before their commit are stored."""

    def call_answered(self) -> None:
        """The proxy sent a call's answer: the events `record_calls` returned early may be
        stored now (SQLite: once 16 such calls or 1 MiB of their JSON wait, else 50 ms after
        the first of them)."""

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
        """Events in seq order; the latest attempt unless `attempt_id` or `all_attempts`.
        `token_arrays`: a restored call's `prompt_token_ids` is an int32 array, not a list (a
        long rollout's prompts as lists are millions of ints, which the garbage collector then
        walks, holding up every thread)."""

    async def record_parts(
        self, rollout_ids: Sequence[str], model: str | None = None
    ) -> list[RolloutParts]:
        """The calls (packed as stored) and last reward of each rollout's latest attempt, for
        the trainer's binary read (`reins.recordbatch`); NotFound for an unknown rollout. With
        `model`, the calls another registered model served are marked so (never trained)."""

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
        """`get_events` as stored: packed `model_request`s are not restored."""

    async def register_models(self, endpoints: Sequence[ModelEndpointIn]) -> list[Model]: ...

    async def list_models(self) -> list[Model]: ...

    async def delete_models(self, model: str | None = None) -> int:
        """Deletes one model's endpoints, or all models when `model` is None; returns a count."""


__all__ = [
    "Conflict",
    "Invalid",
    "NotFound",
    "RolloutQuery",
    "RolloutSort",
    "RolloutStats",
    "Store",
    "StoreError",
]
