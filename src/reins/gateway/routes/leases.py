"""Leases (`store.leases`): the rollout controller holds `controller`, so that a second one
following the same gateway waits instead of launching every rollout again."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from reins.gateway.deps import Admin
from reins.gateway.guards import GuardedRoute
from reins.gateway.store import Store
from reins.schemas import Lease

router = APIRouter(prefix="/api/leases", tags=["leases"], route_class=GuardedRoute)
LeaseName = Annotated[str, Path(pattern=r"^[a-z][a-z0-9_-]{0,49}$")]
Holder = Annotated[str, Field(min_length=1, max_length=300)]


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
    request: Request, _: Admin, name: LeaseName, holder: Annotated[str, Query(max_length=300)]
) -> dict[str, bool]:
    """Gives the lease up, if `holder` holds it."""
    return {"released": await _store(request).leases.release(name, holder)}
