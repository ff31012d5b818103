"""Registered inference endpoints that the proxy forwards to."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query, Request
from pydantic import Field

from reins.gateway.deps import Admin, StoreDep
from reins.gateway.guards import GuardedRoute
from reins.schemas import Model, ModelEndpointIn

router = APIRouter(prefix="/api/models", tags=["models"], route_class=GuardedRoute)


@router.post("")
async def register_models(
    body: Annotated[
        ModelEndpointIn | Annotated[list[ModelEndpointIn], Field(max_length=1000)], Body()
    ],
    store: StoreDep,
    request: Request,
    _: Admin,
) -> list[Model]:
    """Register (or update the weight version of) one endpoint or a list of them."""
    endpoints = body if isinstance(body, list) else [body]
    registered = await store.register_models(endpoints)
    await request.app.state.replicas.models_changed()
    return registered


@router.get("")
async def list_models(store: StoreDep, _: Admin) -> list[Model]:
    return await store.list_models()


@router.delete("")
async def delete_models(
    store: StoreDep,
    request: Request,
    _: Admin,
    model: Annotated[
        str | None, Query(max_length=200, description="Only this model; all when absent")
    ] = None,
) -> dict[str, int]:
    """Remove one model's endpoints, or every model (Agent Lightning semantics)."""
    deleted = await store.delete_models(model)
    await request.app.state.replicas.models_changed()
    return {"deleted": deleted}
