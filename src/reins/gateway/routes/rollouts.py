"""Rollouts and their attempts (paper table 1)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query
from pydantic import BaseModel, Field

from reins.gateway.deps import Admin, AuthDep, RolloutIdPath, SettingsDep, StoreDep
from reins.gateway.guards import GuardedRoute
from reins.gateway.store import NotFound
from reins.schemas import (
    Attempt,
    AttemptCreate,
    Identifier,
    Mode,
    Rollout,
    RolloutDetail,
    RolloutPage,
    RolloutSpec,
    RolloutState,
    RolloutStats,
    RolloutUpdate,
)

router = APIRouter(prefix="/api/rollouts", tags=["rollouts"], route_class=GuardedRoute)

MAX_BATCH = 10_000


class StatsRequest(BaseModel):
    rollout_ids: list[Identifier] = Field(min_length=1, max_length=MAX_BATCH)
    model: Identifier | None = None
    """The policy's registered name: the versions of the calls another model served (a judge
    on its own engine) are left out, as the trainer leaves those calls out."""


@router.post("")
async def create_rollouts(
    specs: Annotated[list[RolloutSpec], Body(max_length=MAX_BATCH)],
    store: StoreDep,
    _: Admin,
) -> list[Rollout]:
    """Declare a batch of rollouts. Same id + same body returns the existing one (a safe retry)."""
    return await store.create_rollouts(specs)


@router.get("")
async def list_rollouts(
    store: StoreDep,
    settings: SettingsDep,
    _: Admin,
    status: Annotated[
        list[RolloutState] | None,
        Query(description="Keep these states; repeat the parameter for several."),
    ] = None,
    mode: Mode | None = None,
    group_id: Annotated[str | None, Query(max_length=200)] = None,
    cursor: Annotated[
        int, Query(ge=0, le=2**62, description="`next_cursor` of the previous page")
    ] = 0,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 100,
    run: Annotated[
        str | None, Query(max_length=1000, description="Keep rollouts whose `metadata.run` is this")
    ] = None,
    q: Annotated[
        str | None,
        Query(max_length=1000, description="Case-insensitive text in the rollout id or input"),
    ] = None,
) -> RolloutPage:
    """Rollouts in the order of their last change, after `cursor`.

    Following `next_cursor` with `status=succeeded&status=failed` streams completions in the
    order they became terminal, so a trainer never polls rollouts one by one. A `next_cursor`
    below `cursor` means the database went back (restored from an older copy): read again from
    0, as after a `database_id` change.
    """
    return await store.list_rollouts(
        states=status or (),
        mode=mode,
        group_id=group_id,
        cursor=cursor,
        limit=min(limit, settings.max_page_size),
        run=run,
        search=q or None,
    )


@router.post("/stats")
async def rollout_stats(body: StatsRequest, store: StoreDep, _: Admin) -> dict[str, RolloutStats]:
    """Each rollout's latest attempt in figures (calls, tokens, the weight versions that served
    them, last reward, times), computed in the database without reading the events out: what
    the dashboard's table shows, and how the trainer finds the running groups that are already
    too stale to train. 404 when a rollout does not exist."""
    stats = await store.rollout_stats(body.rollout_ids, body.model)
    missing = next((rid for rid in body.rollout_ids if rid not in stats), None)
    if missing is not None:
        raise NotFound(f"rollout {missing!r} does not exist")
    return stats


@router.get("/{rollout_id}")
async def get_rollout(
    rollout_id: RolloutIdPath, store: StoreDep, auth: AuthDep, _: Admin
) -> RolloutDetail:
    """One rollout with its attempts; each attempt carries its scoped token."""
    detail = await store.get_rollout(rollout_id)
    for attempt in detail.attempts:
        attempt.token = auth.scoped_token(rollout_id, attempt.attempt_id)
    return detail


@router.patch("/{rollout_id}")
async def update_rollout(
    rollout_id: RolloutIdPath, update: RolloutUpdate, store: StoreDep, _: Admin
) -> Rollout:
    """Change the status (checked against the transition table) and/or merge metadata."""
    return await store.update_rollout(rollout_id, update)


@router.post("/{rollout_id}/attempts")
async def open_attempt(
    rollout_id: RolloutIdPath,
    store: StoreDep,
    auth: AuthDep,
    _: Admin,
    request: Annotated[AttemptCreate | None, Body()] = None,
) -> Attempt:
    """Open the next attempt, with its scoped token. Name `attempt_id` to make it idempotent."""
    attempt = await store.open_attempt(rollout_id, request or AttemptCreate())
    attempt.token = auth.scoped_token(rollout_id, attempt.attempt_id)
    return attempt
