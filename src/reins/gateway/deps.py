"""FastAPI dependencies shared by the routes: the store and the caller's identity."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from reins.gateway.auth import Authenticator, Principal
from reins.gateway.settings import GatewaySettings
from reins.gateway.store import Store

RolloutIdPath = Annotated[str, Path(min_length=1, max_length=200, description="Rollout id")]
AttemptIdPath = Annotated[int, Path(ge=1, le=1_000_000, description="Attempt id (1-based)")]


def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def get_auth(request: Request) -> Authenticator:
    auth: Authenticator = request.app.state.auth
    return auth


def get_settings(request: Request) -> GatewaySettings:
    settings: GatewaySettings = request.app.state.settings
    return settings


def require_admin(request: Request) -> Principal:
    return get_auth(request).admin(request)


def require_attempt(
    request: Request, rollout_id: RolloutIdPath, attempt_id: AttemptIdPath
) -> Principal:
    return get_auth(request).attempt(request, rollout_id, attempt_id)


StoreDep = Annotated[Store, Depends(get_store)]
AuthDep = Annotated[Authenticator, Depends(get_auth)]
SettingsDep = Annotated[GatewaySettings, Depends(get_settings)]
Admin = Annotated[Principal, Depends(require_admin)]
AttemptCaller = Annotated[Principal, Depends(require_attempt)]
