"""The gateway's durable store: one protocol, one SQL implementation for SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from reins.schemas import (
    Attempt,
    AttemptCreate,
    Event,
    EventIn,
    Mode,
    Model,
    ModelEndpointIn,
    Rollout,
    RolloutDetail,
    RolloutPage,
    RolloutSpec,
    RolloutState,
    RolloutUpdate,
)


class StoreError(Exception):
    """A request the store refuses; the message says what was wrong and what to do."""


class NotFound(StoreError):
    pass


class Conflict(StoreError):
    pass


class Store(Protocol):
    """Every write is idempotent, so callers may retry any of them after a lost reply."""

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
    ) -> RolloutPage:
        """Rollouts whose last change came after `cursor`, in the order of their changes."""

    async def get_rollout(self, rollout_id: str) -> RolloutDetail: ...

    async def update_rollout(self, rollout_id: str, update: RolloutUpdate) -> Rollout:
        """Checks `VALID_TRANSITIONS`; setting the current state again is a no-op."""

    async def open_attempt(self, rollout_id: str, request: AttemptCreate) -> Attempt:
        """Opens the next attempt; a queuing rollout becomes running, a running attempt fails."""

    async def attempt_exists(self, rollout_id: str, attempt_id: int) -> bool: ...

    async def append_events(
        self, rollout_id: str, attempt_id: int, events: Sequence[EventIn]
    ) -> list[Event]:
        """Stored once per idempotency key; a replay returns the stored event."""

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
        """Events in seq order; the latest attempt unless `attempt_id` or `all_attempts`."""

    async def register_models(self, endpoints: Sequence[ModelEndpointIn]) -> list[Model]: ...

    async def list_models(self) -> list[Model]: ...

    async def delete_models(self, model: str | None = None) -> int:
        """Deletes one model's endpoints, or all models when `model` is None; returns a count."""


__all__ = ["Conflict", "NotFound", "Store", "StoreError"]
