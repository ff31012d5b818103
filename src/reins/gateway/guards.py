"""What the gateway checks before it does any work for a request, in this order:

1. **Who calls**, before a byte of the body is read. FastAPI reads and parses a route's body
   before it solves the route's dependencies, so an auth dependency alone let a client without a
   key make the gateway parse 25 MB (1.2 s of the event loop) before its 401. `GuardedRoute`
   authenticates first, with the rule the route declares (its `Admin` or `AttemptCaller`
   dependency), and the dependency still runs afterwards for the route's own use.
2. **The body**, under the JSON rule (`reins.gateway.jsonrule`): parsed once, here, so a NaN, an
   unpaired surrogate or a body nested 10,000 deep is a 422 naming the field, never a 500 or
   FastAPI's vague 400. A body that is not JSON is a 415, a body sent to a route that takes
   none a 422, and so is a query parameter the route does not take (FastAPI ignores both).
3. **The attempt**, for the proxy: a call for an attempt that is superseded, or whose rollout is
   terminal, is refused with 409 (`proxy_refusal`), as the store refuses its harness's events.
"""

from __future__ import annotations

import email.message
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response, status
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from reins.gateway import jsonrule
from reins.gateway.auth import Authenticator, Principal
from reins.gateway.deps import require_admin, require_attempt
from reins.gateway.store import Conflict, NotFound, Store

MAX_ATTEMPT_ID = 1_000_000


class GuardedRoute(APIRoute):
    """An `APIRoute` that authenticates before it reads the body, then parses the body under the
    JSON rule. Routers of the gateway's API use it (`APIRouter(route_class=GuardedRoute)`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        authenticate = _authenticator_of(self.dependant)
        takes_body = self.body_field is not None
        parameters = _query_names(self.dependant)

        async def guarded(request: Request) -> Response:
            if authenticate is not None:
                await authenticate(request)
            unknown = [name for name in request.query_params if name not in parameters]
            if unknown:
                # FastAPI ignores a parameter the route does not declare: a misspelled one read
                # as absent, and `DELETE /api/models?name=m` deleted every model.
                takes = ", ".join(sorted(parameters)) or "none"
                raise RequestValidationError(
                    [
                        {
                            "loc": ("query", name),
                            "msg": f"{request.method} {request.url.path} has no such "
                            f"parameter (it takes: {takes})",
                            "type": "extra_forbidden",
                        }
                        for name in unknown
                    ]
                )
            if takes_body:
                await _parse_json_body(request)
            elif await request.body():
                # FastAPI ignores a body the route does not declare: `DELETE /api/models` with
                # `{"model": "m"}` deleted every model, a drain with `{"timeout_s": 5}` waited
                # its default 600 s.
                raise RequestValidationError(
                    [
                        {
                            "loc": ("body",),
                            "msg": f"{request.method} {request.url.path} takes no body; send "
                            "its parameters in the query string (see GET /openapi.json)",
                            "type": "extra_forbidden",
                        }
                    ]
                )
            return await handler(request)

        return guarded


def _authenticator_of(dependant: Dependant) -> Callable[[Request], Awaitable[Any]] | None:
    """The route's auth rule: its `require_admin` or `require_attempt` dependency."""
    stack = [dependant]
    calls = set()
    while stack:
        current = stack.pop()
        calls.add(current.call)
        stack.extend(current.dependencies)
    if require_admin in calls:
        return require_admin
    if require_attempt in calls:
        return attempt_caller
    return None


def _query_names(dependant: Dependant) -> frozenset[str]:
    """The query parameters a route declares, its dependencies' included."""
    names: set[str] = set()
    stack = [dependant]
    while stack:
        current = stack.pop()
        names.update(field.alias for field in current.query_params)
        stack.extend(current.dependencies)
    return frozenset(names)


async def attempt_caller(request: Request) -> Principal:
    """`require_attempt` before FastAPI has validated the path: an attempt id that is not one can
    belong to no token, so only the admin key may go on (to FastAPI's 422)."""
    auth: Authenticator = request.app.state.auth
    raw = str(request.path_params.get("attempt_id", ""))
    attempt_id = int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 8 else 0
    if not 1 <= attempt_id <= MAX_ATTEMPT_ID:
        return auth.admin(request)
    return auth.attempt(request, str(request.path_params.get("rollout_id", "")), attempt_id)


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI would read a body of this content type as JSON (it then calls
    `request.json()`, which this module answers)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


def refuse_unless_json(content_type: str | None, body: bytes) -> None:
    """415 for a body sent as anything but JSON.

    FastAPI would validate the raw bytes against the route's model and answer, for a JSON list
    sent as text (curl's `-d` sends a form type), "body: Input should be a valid list": true of
    no body the client sent, and silent on the fix."""
    if body and not _is_json(content_type):
        sent = f"as {content_type}" if content_type else "without a Content-Type"
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
            f"the request body was sent {sent}; send it as JSON with "
            "`Content-Type: application/json`",
        )


async def _parse_json_body(request: Request) -> None:
    content_type = request.headers.get("content-type")
    refuse_unless_json(content_type, await request.body())
    if not _is_json(content_type):
        return
    body = await request.body()
    if not body:
        return
    try:
        value = jsonrule.parse(body)
    except jsonrule.JsonRuleError as error:
        raise RequestValidationError([error.error()]) from None
    # Starlette's `Request.json()` returns this cached value, so FastAPI never parses the body
    # with Python's lenient `json` (which reads NaN and recurses without bound).
    request._json = value


RECORDED_UNDER = 1
"""A proxied request sits one level down in its call's record (`data.request`): its own
nesting may use one level less, or the call would run and its record be refused."""


async def json_body(request: Request) -> Any:
    """A request body under the JSON rule, for endpoints that read their body themselves (the
    proxy); raises `jsonrule.JsonRuleError` (its `str()` names the field)."""
    return jsonrule.parse(await request.body(), under=RECORDED_UNDER)


async def proxy_refusal(store: Store, rollout_id: str, attempt_id: int) -> tuple[int, str] | None:
    """(status, message) when the proxy must not serve a call for this attempt: 404 when it does
    not exist, 409 when it is superseded or its rollout is terminal; None when it is open."""
    try:
        await store.check_open(rollout_id, attempt_id)
    except NotFound as error:
        return 404, str(error)
    except Conflict as error:
        return 409, str(error)
    return None
