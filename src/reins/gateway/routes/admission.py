"""The admission gate's controls, for the trainer in collocated async mode."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Query, Request

from reins.gateway.admission import AdmissionGate
from reins.gateway.deps import Admin
from reins.gateway.guards import GuardedRoute

router = APIRouter(prefix="/api/admission", tags=["admission"], route_class=GuardedRoute)


def _gate(request: Request) -> AdmissionGate:
    gate: AdmissionGate = request.app.state.gate
    return gate


@router.get("")
async def status(request: Request, _: Admin) -> dict[str, object]:
    return asdict(_gate(request).status())


@router.post("/pause")
async def pause(request: Request, _: Admin) -> dict[str, object]:
    """New LLM calls wait at the gateway (bounded); calls in flight go on."""
    return asdict(_gate(request).pause())


@router.post("/drain")
async def drain(
    request: Request,
    _: Admin,
    timeout_s: Annotated[float, Query(gt=0, le=86_400)] = 600.0,
) -> dict[str, object]:
    """Returns once no LLM call is in flight (`drained: false` if `timeout_s` passed first)."""
    gate = _gate(request)
    drained = await gate.drain(timeout_s)
    return {"drained": drained, **asdict(gate.status())}


@router.post("/resume")
async def resume(request: Request, _: Admin) -> dict[str, object]:
    """Held calls proceed."""
    return asdict(_gate(request).resume())
