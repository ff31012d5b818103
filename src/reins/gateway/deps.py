"""FastAPI dependencies shared by the routes: the store and the caller's identity.

All `async def`: FastAPI runs a plain `def` dependency in a worker thread, a cost per request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request
from pydantic import BeforeValidator

from reins.gateway.auth import Authenticator, Principal
from reins.gateway.settings import GatewaySettings
from reins.gateway.store import Store

RolloutIdPath = Annotated[str, Path(min_length=1, max_length=200, description="Rollout id")]


def attempt_number(raw: str) -> int:
    """A path's attempt id as written in decimal digits; 0 (no attempt) for anything else:
    Python's `int()`, and so pydantic, read `1_0` as 10 and `+5` or ` 5` as 5."""
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 8 else 0


def _decimal(value: object) -> object:
    """Pydantic's lax int refused unless written as `attempt_number` reads it."""
    if isinstance(value, str) and not (value.isascii() and value.isdigit()):
        raise ValueError("an attempt id is written in decimal digits only")
    return value


AttemptIdPath = Annotated[
    int, Path(ge=1, le=1_000_000, description="Attempt id (1-based)"), BeforeValidator(_decimal)
]


async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def get_auth(request: Request) -> Authenticator:
    auth: Authenticator = request.app.state.auth
    return auth


async def get_settings(request: Request) -> GatewaySettings:
    settings: GatewaySettings = request.app.state.settings
    return settings


async def require_admin(request: Request) -> Principal:
    auth: Authenticator = request.app.state.auth
    return auth.admin(request)


async def require_attempt(
    request: Request, rollout_id: RolloutIdPath, attempt_id: AttemptIdPath
) -> Principal:
    auth: Authenticator = request.app.state.auth
    return auth.attempt(request, rollout_id, attempt_id)


StoreDep = Annotated[Store, Depends(get_store)]
AuthDep = Annotated[Authenticator, Depends(get_auth)]
SettingsDep = Annotated[GatewaySettings, Depends(get_settings)]
Admin = Annotated[Principal, Depends(require_admin)]
AttemptCaller = Annotated[Principal, Depends(require_attempt)]
