"""The proxy API: `/proxy/rollout/{id}/attempt/{aid}/mode/{mode}/openai/v1/...`.

A harness becomes trainable by pointing its OpenAI base URL here, with its attempt's scoped token
as the API key (paper appendix A.1, "Proxy API").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response

from reins.gateway import guards, jsonrule
from reins.gateway.auth import Principal
from reins.gateway.deps import AttemptCaller, AttemptIdPath, RolloutIdPath, StoreDep
from reins.gateway.proxy import LLMProxy, openai_error
from reins.gateway.store import Conflict, Store, StoreError
from reins.gateway.wire import WireApi, WireError, messages, responses
from reins.httpjson import JSONResponse
from reins.schemas import AttemptCreate, Mode

PROXY_BASE = "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}"
OPENAI_PREFIX = PROXY_BASE + "/openai/v1"
ANTHROPIC_BASE = PROXY_BASE + "/anthropic"

# The caller first, then the path: a call without a key for attempt 0 is a 401, not a 400 about
# the path (the fast endpoints of the POST routes do the same, `reins.gateway.fast`).
router = APIRouter(prefix=OPENAI_PREFIX, tags=["proxy"], route_class=guards.AuthFirstRoute)
anthropic_router = APIRouter(
    prefix=ANTHROPIC_BASE, tags=["proxy"], route_class=guards.AuthFirstRoute
)

ModePath = Annotated[Mode, Path(description="`train` or `val`: selects the sampling settings")]


async def get_proxy(request: Request) -> LLMProxy:
    proxy: LLMProxy = request.app.state.proxy
    return proxy


ProxyDep = Annotated[LLMProxy, Depends(get_proxy)]


ProxyKind = Literal["chat", "completions", "responses", "messages", "count_tokens"]
"""What a proxied call is: OpenAI chat or text completions, the Responses API, Anthropic
Messages, or Anthropic's token count."""


_WIRE: dict[str, WireApi] = {"responses": responses, "messages": messages}


def error_shape(kind: ProxyKind) -> Callable[[int, str], Response]:
    """Errors in the API of the call: OpenAI's error object (the Responses API's, whose `code`
    is a string or null), or Anthropic's."""
    if kind in ("messages", "count_tokens"):
        return lambda status, message: JSONResponse(messages.error_body(status, message), status)
    if kind == "responses":
        return lambda status, message: JSONResponse(responses.error_body(status, message), status)
    return lambda status, message: openai_error(status, message, "invalid_request_error")


def error_for_path(path: str, status: int, message: str) -> Response | None:
    """A gateway error (auth, validation, an unknown route) for a call under `/proxy/`, in the
    shape of the API the path names, so the harness's SDK shows its message; None elsewhere."""
    if not path.startswith("/proxy/"):
        return None
    kind: ProxyKind = "chat"
    if "/anthropic" in path:
        kind = "messages"
    elif path.rstrip("/").endswith("/openai/v1/responses"):
        kind = "responses"
    # Both APIs answer an invalid request with 400 (their SDKs' BadRequestError); neither has
    # the gateway's own 422.
    return error_shape(kind)(400 if status == 422 else status, message)


async def _body(request: Request, kind: ProxyKind) -> dict[str, Any] | Response:
    fail = error_shape(kind)
    try:
        # The gateway's JSON rule: NaN, an unpaired surrogate or deep nesting is a 400 naming
        # the field, never a stored record that breaks reads (reins.gateway.jsonrule).
        body = await guards.json_body(request)
    except jsonrule.JsonRuleError as error:
        if error.kind == "json_invalid":
            return fail(400, f"the request body is not valid JSON: {error.msg}")
        return fail(400, str(error))
    if not isinstance(body, dict):
        return fail(400, "the request body must be a JSON object")
    return body


async def _ensure_attempt(
    store: Store, caller: Principal, rollout_id: str, attempt_id: int, kind: ProxyKind
) -> Response | None:
    """With the admin key, a call naming an attempt that does not exist yet opens it."""
    if not caller.is_admin or await store.attempt_exists(rollout_id, attempt_id):
        return None
    try:
        await store.open_attempt(rollout_id, AttemptCreate(attempt_id=attempt_id))
    except StoreError as error:
        return error_shape(kind)(409 if isinstance(error, Conflict) else 404, str(error))
    return None


async def forward_call(
    kind: ProxyKind,
    request: Request,
    rollout_id: str,
    attempt_id: int,
    mode: Mode,
    proxy: LLMProxy,
    store: Store,
    caller: Principal,
) -> Response:
    """The work of a proxied call, shared with its fast endpoint (`reins.gateway.fast`)."""
    body = await _body(request, kind)
    if isinstance(body, Response):
        return body
    if kind == "count_tokens":
        return await _count_tokens(body, rollout_id, mode, proxy)
    refused = await _ensure_attempt(store, caller, rollout_id, attempt_id, kind)
    if refused is not None:
        return refused
    # A superseded attempt, or a terminal rollout's, makes no more calls (409 saying why).
    closed = await guards.proxy_refusal(store, rollout_id, attempt_id)
    if closed is not None:
        refusal = error_shape(kind)(*closed)
        # The attempt stays closed: the SDKs' retry of a 409 (openai, anthropic) cannot succeed.
        refusal.headers["x-should-retry"] = "false"
        return refusal
    # A harness that hangs up or times out before its answer: the call is cancelled at the
    # engine and recorded as abandoned (`LLMProxy.unless_abandoned`).
    if kind in ("responses", "messages"):
        api = _WIRE[kind]
        work = proxy.forward_wire(api, rollout_id, attempt_id, mode, body)
        return await proxy.unless_abandoned(
            request.receive,
            work,
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            mode=mode,
            body=body,
            wire=api,
        )
    work = proxy.forward(
        "chat" if kind == "chat" else "completions", rollout_id, attempt_id, mode, body
    )
    return await proxy.unless_abandoned(
        request.receive, work, rollout_id=rollout_id, attempt_id=attempt_id, mode=mode, body=body
    )


async def _count_tokens(
    body: dict[str, Any], rollout_id: str, mode: Mode, proxy: LLMProxy
) -> Response:
    """Anthropic's `count_tokens`: the real count, by the engine's tokenizer and template, of
    the prompt the call would send in `mode` (its policy's prompt fields applied)."""
    try:
        chat = {**messages.count_tokens_request(body), "model": body.get("model")}
        count = await proxy.count_tokens(chat, rollout_id, mode)
    except WireError as error:
        return JSONResponse(
            messages.error_body(error.status, error.message, error.kind), error.status
        )
    return JSONResponse({"input_tokens": count})


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


@router.get("/models/{model_id}")
async def model(
    model_id: str,
    rollout_id: RolloutIdPath,
    attempt_id: AttemptIdPath,
    mode: ModePath,
    proxy: ProxyDep,
    _: AttemptCaller,
) -> Response:
    """One registered model, as OpenAI's `GET /v1/models/{model}` answers it."""
    return await proxy.model_card(model_id)


@router.post("/responses")
async def create_response(
    request: Request,
    rollout_id: RolloutIdPath,
    attempt_id: AttemptIdPath,
    mode: ModePath,
    proxy: ProxyDep,
    store: StoreDep,
    caller: AttemptCaller,
) -> Response:
    """The OpenAI Responses API (Codex, the OpenAI Agents SDK, OpenCode), streamed or not;
    translated to the engine's chat completions and recorded with `kind: responses`. The gateway
    stores no responses: harnesses send `store: false` and their whole input each time."""
    return await forward_call(
        "responses", request, rollout_id, attempt_id, mode, proxy, store, caller
    )


@anthropic_router.post("/v1/messages")
async def create_message(
    request: Request,
    rollout_id: RolloutIdPath,
    attempt_id: AttemptIdPath,
    mode: ModePath,
    proxy: ProxyDep,
    store: StoreDep,
    caller: AttemptCaller,
) -> Response:
    """The Anthropic Messages API (Claude Code, OpenCode), streamed or not; translated to the
    engine's chat completions and recorded with `kind: messages`. Point the harness's
    `ANTHROPIC_BASE_URL` at `.../mode/{mode}/anthropic`."""
    return await forward_call(
        "messages", request, rollout_id, attempt_id, mode, proxy, store, caller
    )


@anthropic_router.post("/v1/messages/count_tokens")
async def count_message_tokens(
    request: Request,
    rollout_id: RolloutIdPath,
    attempt_id: AttemptIdPath,
    mode: ModePath,
    proxy: ProxyDep,
    store: StoreDep,
    caller: AttemptCaller,
) -> Response:
    """The prompt's token count by the engine's own tokenizer and chat template."""
    return await forward_call(
        "count_tokens", request, rollout_id, attempt_id, mode, proxy, store, caller
    )


@anthropic_router.head("")
async def anthropic_base(
    rollout_id: RolloutIdPath, attempt_id: AttemptIdPath, mode: ModePath, _: AttemptCaller
) -> Response:
    """Claude Code's reachability check of its base URL."""
    return Response(status_code=200)


@anthropic_router.get("/v1/models")
async def anthropic_models(
    rollout_id: RolloutIdPath,
    attempt_id: AttemptIdPath,
    mode: ModePath,
    proxy: ProxyDep,
    _: AttemptCaller,
    after_id: str | None = None,
    before_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> Response:
    """The registered models in the shape of Anthropic's model list (`client.models.list()`)."""
    names = [model.model for model in await proxy.directory.models()]
    try:
        page = messages.model_list(names, after_id=after_id, before_id=before_id, limit=limit)
    except WireError as error:
        return JSONResponse(messages.error_body(400, error.message), 400)
    return JSONResponse(page)


@anthropic_router.get("/v1/models/{model_id}")
async def anthropic_model(
    model_id: str,
    rollout_id: RolloutIdPath,
    attempt_id: AttemptIdPath,
    mode: ModePath,
    proxy: ProxyDep,
    _: AttemptCaller,
) -> Response:
    """One registered model, as Anthropic's `GET /v1/models/{model_id}` answers it."""
    if model_id not in {model.model for model in await proxy.directory.models()}:
        message = f"model: {model_id} is not served here (GET .../anthropic/v1/models lists them)"
        return JSONResponse(messages.error_body(404, message), 404)
    return JSONResponse(messages.model_info(model_id))
