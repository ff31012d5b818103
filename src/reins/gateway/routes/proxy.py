"""The proxy API: `/proxy/rollout/{id}/attempt/{aid}/mode/{mode}/openai/v1/...`.

A harness becomes trainable by pointing its OpenAI base URL here, with its attempt's scoped token
as the API key (paper appendix A.1, "Proxy API").
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response

from reins.gateway.auth import Principal
from reins.gateway.deps import AttemptCaller, AttemptIdPath, RolloutIdPath, StoreDep
from reins.gateway.proxy import LLMProxy, openai_error
from reins.gateway.store import Store, StoreError
from reins.schemas import AttemptCreate, Mode

router = APIRouter(
    prefix="/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1",
    tags=["proxy"],
)

ModePath = Annotated[Mode, Path(description="`train` or `val`: selects the sampling settings")]


async def get_proxy(request: Request) -> LLMProxy:
    proxy: LLMProxy = request.app.state.proxy
    return proxy


ProxyDep = Annotated[LLMProxy, Depends(get_proxy)]


async def _body(request: Request) -> dict[str, Any] | Response:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return openai_error(400, f"the request body is not valid JSON: {error}", "invalid_json")
    if not isinstance(body, dict):
        return openai_error(400, "the request body must be a JSON object", "invalid_request")
    return body


async def _ensure_attempt(
    store: Store, caller: Principal, rollout_id: str, attempt_id: int
) -> Response | None:
    """With the admin key, a call naming an attempt that does not exist yet opens it."""
    if not caller.is_admin or await store.attempt_exists(rollout_id, attempt_id):
        return None
    try:
        await store.open_attempt(rollout_id, AttemptCreate(attempt_id=attempt_id))
    except StoreError as error:
        return openai_error(409 if "cannot" in str(error) else 404, str(error), "invalid_attempt")
    return None


async def forward_call(
    kind: str,
    request: Request,
    rollout_id: str,
    attempt_id: int,
    mode: Mode,
    proxy: LLMProxy,
    store: Store,
    caller: Principal,
) -> Response:
    """The work of a proxied call, shared with its fast endpoint (`reins.gateway.fast`)."""
    body = await _body(request)
    if isinstance(body, Response):
        return body
    refused = await _ensure_attempt(store, caller, rollout_id, attempt_id)
    if refused is not None:
        return refused
    return await proxy.forward(
        "chat" if kind == "chat" else "completions", rollout_id, attempt_id, mode, body
    )


@router.post("/chat/completions")
async def chat_completions(
    request: Request,
    rollout_id: RolloutIdPath,
    attempt_id: AttemptIdPath,
    mode: ModePath,
    proxy: ProxyDep,
    store: StoreDep,
    caller: AttemptCaller,
) -> Response:
    """OpenAI chat completions, streamed or not; recorded as `model_request` events."""
    return await forward_call("chat", request, rollout_id, attempt_id, mode, proxy, store, caller)


@router.post("/completions")
async def completions(
    request: Request,
    rollout_id: RolloutIdPath,
    attempt_id: AttemptIdPath,
    mode: ModePath,
    proxy: ProxyDep,
    store: StoreDep,
    caller: AttemptCaller,
) -> Response:
    """OpenAI text completions (a token-ID list prompt too), streamed or not."""
    return await forward_call(
        "completions", request, rollout_id, attempt_id, mode, proxy, store, caller
    )


@router.get("/models")
async def models(
    rollout_id: RolloutIdPath,
    attempt_id: AttemptIdPath,
    mode: ModePath,
    proxy: ProxyDep,
    _: AttemptCaller,
) -> dict[str, Any]:
    """The registered models, in OpenAI's list format."""
    return await proxy.list_models()
