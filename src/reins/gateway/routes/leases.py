"""Leases (`store.leases`): the rollout controller holds `controller`, so that a second one
following the same gateway waits instead of launching every rollout again.

The holder's writes (open an attempt, change a rollout's status, post its events) go through
`/api/leases/{name}/rollouts/...`, the twins of the rollout and event routes, naming the holder
and the `token` of its grant: they are refused (409, `lease not held: ...`) once the lease is
another's, or lapsed, so a controller that paused past its lease cannot act beside the one that
took over.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Header, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from reins.gateway.deps import Admin, AttemptIdPath, AuthDep, RolloutIdPath, StoreDep
from reins.gateway.guards import GuardedRoute
from reins.gateway.routes.events import MAX_EVENTS_PER_POST, MAX_KEY_LENGTH, append, header_text
from reins.gateway.store import Store
from reins.schemas import Attempt, AttemptCreate, EventAck, EventIn, Lease, Rollout, RolloutUpdate

router = APIRouter(prefix="/api/leases", tags=["leases"], route_class=GuardedRoute)
LeaseName = Annotated[str, Path(pattern=r"^[a-z][a-z0-9_-]{0,49}$")]
Holder = Annotated[str, Field(min_length=1, max_length=300)]
HolderQuery = Annotated[str, Query(min_length=1, max_length=300, description="The holder")]
TokenQuery = Annotated[
    str, Query(min_length=1, max_length=100, description="The `token` of the holder's grant")
]


class LeaseClaim(BaseModel):
    model_config = ConfigDict(extra="forbid")

    holder: Holder
    """Who claims it: the same holder renews its own lease."""
    ttl_s: float = Field(gt=0, le=3600)
    """How long it holds unless renewed."""


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


@router.post("/{name}")
async def claim(request: Request, _: Admin, name: LeaseName, body: LeaseClaim) -> Lease:
    """Takes or renews the lease; the lease as it stands (`granted: false`, naming its holder,
    while another one holds it)."""
    return await _store(request).leases.claim(name, body.holder, body.ttl_s)


@router.delete("/{name}")
async def release(
    request: Request,
    _: Admin,
    name: LeaseName,
    holder: Annotated[str, Query(max_length=300)],
    token: Annotated[str | None, Query(max_length=100)] = None,
) -> dict[str, bool]:
    """Gives the lease up, if `holder` holds it (under `token`, when given)."""
    return {"released": await _store(request).leases.release(name, holder, token)}


@router.post("/{name}/rollouts/{rollout_id}/attempts")
async def open_attempt(
    name: LeaseName,
    rollout_id: RolloutIdPath,
    holder: HolderQuery,
    token: TokenQuery,
    store: StoreDep,
    auth: AuthDep,
    _: Admin,
    request: Annotated[AttemptCreate | None, Body()] = None,
) -> Attempt:
    """`POST /api/rollouts/{id}/attempts`, by the lease's holder."""
    async with store.leases.holding(name, holder, token):
        attempt = await store.open_attempt(rollout_id, request or AttemptCreate())
    attempt.token = auth.scoped_token(rollout_id, attempt.attempt_id)
    return attempt


@router.patch("/{name}/rollouts/{rollout_id}")
async def update_rollout(
    name: LeaseName,
    rollout_id: RolloutIdPath,
    holder: HolderQuery,
    token: TokenQuery,
    update: RolloutUpdate,
    store: StoreDep,
    _: Admin,
) -> Rollout:
    """`PATCH /api/rollouts/{id}`, by the lease's holder."""
    async with store.leases.holding(name, holder, token):
        return await store.update_rollout(rollout_id, update)


@router.post("/{name}/rollouts/{rollout_id}/attempt/{attempt_id}/events")
async def append_events(
    name: LeaseName,
    rollout_id: RolloutIdPath,
    attempt_id: AttemptIdPath,
    holder: HolderQuery,
    token: TokenQuery,
    body: Annotated[
        EventIn | Annotated[list[EventIn], Field(max_length=MAX_EVENTS_PER_POST)], Body()
    ],
    store: StoreDep,
    _: Admin,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=MAX_KEY_LENGTH)] = None,
) -> EventAck | list[EventAck]:
    """`POST /api/rollouts/{id}/attempt/{aid}/events`, by the lease's holder (admin)."""
    async with store.leases.holding(name, holder, token):
        key = header_text(idempotency_key)
        return await append(store, rollout_id, attempt_id, body, key, from_harness=False)
