"""Plain Starlette endpoints for the two hot paths: event posts and proxied LLM calls.

FastAPI's per-request machinery (dependency solving, parameter introspection, response
re-validation) cost about 1.5 ms of CPU per call on a 2-core machine, several times the work
itself. These endpoints are registered ahead of their FastAPI twins, which stay for the OpenAPI
schema and the docs; both call the same code, and the fast ones answer the same 4xx errors.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import Field, TypeAdapter, ValidationError
from starlette.background import BackgroundTask
from starlette.routing import Route

from reins.gateway import guards, jsonrule
from reins.gateway.deps import attempt_number
from reins.gateway.routes import proxy
from reins.gateway.routes.events import MAX_EVENTS_PER_POST, append, header_text
from reins.gateway.store import Store
from reins.schemas import EventAck, EventIn, Mode

_EVENT_BODY: TypeAdapter[EventIn | list[EventIn]] = TypeAdapter(
    EventIn | Annotated[list[EventIn], Field(max_length=MAX_EVENTS_PER_POST)]
)
_ACKS: TypeAdapter[EventAck | list[EventAck]] = TypeAdapter(EventAck | list[EventAck])
_MODES = get_args(Mode)


def _invalid(location: tuple[str, ...], message: str, kind: str) -> RequestValidationError:
    return RequestValidationError([{"loc": location, "msg": message, "type": kind}])


def _path_ids(request: Request) -> tuple[str, int]:
    """The rollout and attempt of the path, checked as the FastAPI twins check them."""
    rollout_id: str = request.path_params["rollout_id"]
    if not 1 <= len(rollout_id) <= 200:
        raise _invalid(
            ("path", "rollout_id"), "String should have 1 to 200 characters", "string_length"
        )
    raw: str = request.path_params["attempt_id"]
    attempt_id = attempt_number(raw)
    if not 1 <= attempt_id <= 1_000_000:
        raise _invalid(
            ("path", "attempt_id"), "Input should be an integer from 1 to 1000000", "int_range"
        )
    return rollout_id, attempt_id


async def append_events(request: Request) -> Response:
    # The caller first, as the twins (`guards.attempt_caller`): a path checked first told a
    # caller with no key about the path (422) rather than the key (401).
    caller = await guards.attempt_caller(request)
    rollout_id, attempt_id = _path_ids(request)
    if request.scope["query_string"]:
        # As its twin refuses it (`GuardedRoute`): an `?idempotency_key=` read as absent would
        # let a retry store the event twice.
        name = next(iter(request.query_params), "")
        raise _invalid(
            ("query", name),
            f"POST {request.url.path} has no such parameter (it takes: none)",
            "extra_forbidden",
        )
    key = header_text(request.headers.get("idempotency-key"))
    if key is not None and len(key) > 200:
        raise _invalid(
            ("header", "idempotency-key"), "String should have at most 200 characters", "too_long"
        )
    if key == "":
        # As an empty key in the body is refused: read as no key, the gateway made one of its
        # own for each try, and a retried post was stored twice.
        raise _invalid(
            ("header", "idempotency-key"),
            "String should have at least 1 character (send a key, or no Idempotency-Key header)",
            "string_too_short",
        )
    raw = await request.body()
    guards.refuse_unless_json(request.headers.get("content-type"), raw)
    try:
        # The JSON rule first (no NaN, no unpaired surrogate, bounded depth), then the schema.
        body = _EVENT_BODY.validate_python(jsonrule.parse(raw))
    except jsonrule.JsonRuleError as refused:
        raise RequestValidationError([refused.error()]) from None
    except ValidationError as error:
        errors: list[Any] = [{**e, "loc": ("body", *e["loc"])} for e in error.errors()]
        raise RequestValidationError(errors) from None
    acks = await append(
        request.app.state.store,
        rollout_id,
        attempt_id,
        body,
        key,
        from_harness=not caller.is_admin,
    )
    return Response(_ACKS.dump_json(acks), media_type="application/json")


def _proxy_endpoint(kind: proxy.ProxyKind) -> Any:
    async def endpoint(request: Request) -> Response:
        caller = await guards.attempt_caller(request)  # first, as in `append_events`
        rollout_id, attempt_id = _path_ids(request)
        mode = request.path_params["mode"]
        if mode not in _MODES:
            raise _invalid(("path", "mode"), "Input should be 'train' or 'val'", "literal_error")
        if request.method == "HEAD":
            return Response(status_code=200)
        store = request.app.state.store
        response = await proxy.forward_call(
            kind, request, rollout_id, attempt_id, mode, request.app.state.proxy, store, caller
        )
        if response.background is None:
            # After the answer's last byte: the call's record, if it went to the journal, may
            # then be stored (with the next calls': `Store.call_answered`).
            response.background = BackgroundTask(_answered, store)
        return response

    return endpoint


async def _answered(store: Store) -> None:
    store.call_answered()


def _proxy_route(path: str, kind: proxy.ProxyKind, methods: list[str] | None = None) -> Route:
    return Route(path, _proxy_endpoint(kind), methods=methods or ["POST"], include_in_schema=False)


PROXY_ROUTES = [
    _proxy_route(proxy.OPENAI_PREFIX + "/chat/completions", "chat"),
    _proxy_route(proxy.OPENAI_PREFIX + "/completions", "completions"),
    _proxy_route(proxy.OPENAI_PREFIX + "/responses", "responses"),
    _proxy_route(proxy.ANTHROPIC_BASE + "/v1/messages", "messages"),
    _proxy_route(proxy.ANTHROPIC_BASE + "/v1/messages/count_tokens", "count_tokens"),
    # Claude Code checks that its base URL answers.
    _proxy_route(proxy.ANTHROPIC_BASE, "messages", ["HEAD"]),
    _proxy_route(proxy.ANTHROPIC_BASE + "/", "messages", ["HEAD"]),
]
ROUTES = [
    Route(
        "/api/rollouts/{rollout_id}/attempt/{attempt_id}/events",
        append_events,
        methods=["POST"],
        include_in_schema=False,
    ),
    *PROXY_ROUTES,
]
