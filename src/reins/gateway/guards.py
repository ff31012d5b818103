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
import functools
import types
import typing
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response, status
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from reins.gateway import jsonrule
from reins.gateway.auth import Authenticator, Principal
from reins.gateway.deps import attempt_number, require_admin, require_attempt
from reins.gateway.store import Conflict, NotFound, Store

MAX_ATTEMPT_ID = 1_000_000


class AuthFirstRoute(APIRoute):
    """An `APIRoute` that authenticates, with the rule the route declares (its `Admin` or
    `AttemptCaller` dependency), before FastAPI validates the path or reads the body; the
    dependency still runs afterwards for the route's own use. The proxy's routes use it as it
    is: they read their own body and take the query parameters harnesses add (`?beta=true`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        authenticate = _authenticator_of(self.dependant)

        async def guarded(request: Request) -> Response:
            if authenticate is not None:
                await authenticate(request)
            await self.check(request)
            return await handler(request)

        return guarded

    async def check(self, request: Request) -> None:
        """What a subclass checks once the caller is known; raises to refuse."""


class GuardedRoute(AuthFirstRoute):
    """An `AuthFirstRoute` that also refuses what FastAPI would silently ignore (a query
    parameter the route does not take, a single-valued one given twice, a body sent to a route
    that takes none) and parses the body under the JSON rule. Routers of the gateway's API use
    it (`APIRouter(route_class=GuardedRoute)`)."""

    @functools.cached_property
    def _query(self) -> tuple[frozenset[str], frozenset[str]]:
        return _query_names(self.dependant)

    async def check(self, request: Request) -> None:
        parameters, single = self._query
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
        repeated = [name for name in single if len(request.query_params.getlist(name)) > 1]
        if repeated:
            # FastAPI keeps the last one: `?attempt_id=1&attempt_id=2` read attempt 2 alone.
            raise RequestValidationError(
                [
                    {"loc": ("query", name), "msg": "given more than once", "type": "repeated"}
                    for name in sorted(repeated)
                ]
            )
        if self.body_field is not None:
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


def _query_names(dependant: Dependant) -> tuple[frozenset[str], frozenset[str]]:
    """The query parameters a route declares, its dependencies' included, and those of them
    that take one value."""
    names: set[str] = set()
    single: set[str] = set()
    stack = [dependant]
    while stack:
        current = stack.pop()
        for field in current.query_params:
            names.add(field.alias)
            if not _takes_many(field.field_info.annotation):
                single.add(field.alias)
        stack.extend(current.dependencies)
    return frozenset(names), frozenset(single)


def _takes_many(annotation: Any) -> bool:
    """Whether a query parameter's type is a list of values (`list[str] | None`)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_takes_many(arg) for arg in typing.get_args(annotation))
    return typing.get_origin(annotation) in (list, set, tuple, frozenset)


async def attempt_caller(request: Request) -> Principal:
    """`require_attempt` before FastAPI has validated the path: an attempt id that is not one can
    belong to no token, so only the admin key may go on (to FastAPI's 422)."""
    auth: Authenticator = request.app.state.auth
    raw = str(request.path_params.get("attempt_id", ""))
    attempt_id = attempt_number(raw)
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
