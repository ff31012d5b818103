"""The admission gate's controls, for the trainer: held alike by every gateway process on the
same database (`reins.gateway.replicas`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Query, Request

from reins.gateway.deps import Admin
from reins.gateway.guards import GuardedRoute
from reins.gateway.replicas import Replicas

router = APIRouter(prefix="/api/admission", tags=["admission"], route_class=GuardedRoute)


def _replicas(request: Request) -> Replicas:
    replicas: Replicas = request.app.state.replicas
    return replicas


@router.get("")
async def status(request: Request, _: Admin) -> dict[str, object]:
    """This gateway's gate, and every live gateway process on the same database: each with its
    last report, except this one, whose entry is its gate now, as the top level. Its last
    report can be a second old (a lone gateway syncs every second): it listed calls that had
    ended beside a top level that counted none."""
    replicas = _replicas(request)
    listed = await replicas.replicas()
    gate = replicas.gate.status()
    for entry in listed:
        if entry["this"]:
            entry.update(paused=gate.paused, in_flight=gate.in_flight, held=gate.held)
    return {**asdict(gate), "replicas": listed}


@router.post("/pause")
async def pause(request: Request, _: Admin) -> dict[str, object]:
    """New LLM calls wait at every gateway on this database (bounded); calls in flight go on.
    Answers once every live gateway applied the pause, or after 20 s at most (`pause_wait_s`):
    the drain that follows waits for the rest."""
    return asdict(await _replicas(request).pause())


@router.post("/drain")
async def drain(
    request: Request,
    _: Admin,
    timeout_s: Annotated[float, Query(gt=0, le=86_400)] = 600.0,
) -> dict[str, object]:
    """Returns once no LLM call is in flight at any gateway on this database, each having
    applied the pause (`drained: false` if `timeout_s` passed first)."""
    replicas = _replicas(request)
    drained = await replicas.drain(timeout_s)
    return {"drained": drained, **asdict(replicas.gate.status())}


@router.post("/resume")
async def resume(request: Request, _: Admin) -> dict[str, object]:
    """Held calls proceed, at every gateway on this database."""
    return asdict(await _replicas(request).resume())
