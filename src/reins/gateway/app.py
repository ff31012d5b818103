"""`create_app(settings)`: wires the store, auth, error handling and routes. Nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import sqlalchemy.exc
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.routing import Match, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import reins
from reins.gateway import fast
from reins.gateway.admission import AdmissionGate
from reins.gateway.auth import Authenticator
from reins.gateway.proxy import LLMProxy
from reins.gateway.replicas import Replicas, ReplicaTimings
from reins.gateway.routes import admission, events, leases, models, proxy, records, rollouts
from reins.gateway.settings import GatewaySettings
from reins.gateway.store import Conflict, Invalid, NotFound, Store, StoreError
from reins.gateway.store.sql import SqlStore
from reins.httpjson import JSONResponse
from reins.monitor import dashboard
from reins.monitor.prometheus import GatewayMetrics


def create_app(settings: GatewaySettings | None = None, store: Store | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    store = store or SqlStore(
        settings.database_url,
        sqlite_synchronous=settings.sqlite_synchronous,
        event_writer=settings.sqlite_event_writer,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await store.init()
        app.state.auth = Authenticator(settings.api_key, await store.token_secret())
        app.state.proxy = LLMProxy(
            store,
            app.state.gate,
            {"train": settings.train_sampling, "val": settings.val_sampling},
            retries=settings.proxy_retries,
            read_timeout_s=settings.proxy_read_timeout_s,
            token_reuse=settings.token_reuse,
        )
        app.state.proxy.on_record = app.state.metrics.observe_call
        app.state.replicas = Replicas(
            store.board,
            app.state.gate,
            app.state.proxy.directory.invalidate,
            ReplicaTimings(replica_timeout_s=settings.replica_timeout_s),
            on_peers=store.set_peers,
            known_before_serving=store.needs_peers_known,
        )
        await app.state.replicas.start()
        try:
            yield
        finally:
            await app.state.replicas.stop()
            await app.state.proxy.close()
            await store.close()

    app = GatewayApp(
        title="reins gateway",
        version=reins.__version__,
        description="Durable rollouts, events and models; the LLM proxy for harnesses.",
        lifespan=lifespan,
        # Off: its per-request check looked up environment variables on every call (~5 % of
        # the CPU of an event post).
        telemetry={"tracing": False, "metrics": False, "logs": False},
        # The schema needs the admin key like every route but /healthz (served below). No
        # /docs or /redoc: FastAPI's pages load their scripts from a CDN, which fails offline.
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.gate = AdmissionGate(settings.admission_max_wait_s)
    app.state.metrics = GatewayMetrics(app.state.gate)
    # Our own limit rather than FastAPI's `max_body_size`: that one answers a plain-text 413
    # that does not say what the limit is.
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    _install_error_handlers(app)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness; needs no key."""
        return {"status": "ok", "version": reins.__version__}

    # HEAD too: uptime monitors and `curl -I` check with it, and FastAPI's GET routes answer
    # it 405. Out of the schema: a second operation of one function has a duplicate id.
    app.add_api_route("/healthz", healthz, methods=["HEAD"], include_in_schema=False)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        """The OpenAPI schema (admin key)."""
        request.app.state.auth.admin(request)
        return JSONResponse(app.openapi())

    # Ahead of their FastAPI twins, which stay for the schema: see reins.gateway.fast.
    app.router.routes.extend(fast.ROUTES)
    app.include_router(rollouts.router)
    app.include_router(events.router)
    app.include_router(records.router)
    app.include_router(models.router)
    app.include_router(proxy.router)
    app.include_router(proxy.anthropic_router)
    app.include_router(admission.router)
    app.include_router(leases.router)
    app.include_router(dashboard.router)
    app.include_router(dashboard.metrics_router)
    return app


def _error(status_code: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, "detail": extra.pop("detail", message)}, status_code)


def _describe(error: dict[str, Any]) -> str:
    location = ".".join(str(part) for part in error.get("loc", ()))
    if error.get("type") == "json_invalid":
        return f"malformed JSON in the request body: {error.get('ctx', {}).get('error', '')}"
    return f"{location}: {error.get('msg', 'invalid')}"


def _sent_branch(errors: list[Any]) -> list[Any]:
    """The errors of a body that may be one object or a list of them (events, models), as if
    its type were the one sent. Pydantic tries both and reports both, each under its branch:
    `body.EventIn.data: Input should be a valid dictionary; body.list[EventIn]: Input should be
    a valid list`, for an event whose `data` was a list. Kept: the branch of what was sent,
    its name dropped from `loc` (`body.data`, `body.1.data`, as the gateway's own checks name
    them). A body that is neither (a string, a number) keeps both."""
    branches: dict[str, list[Any]] = {}
    for error in errors:
        loc = error.get("loc", ())
        if len(loc) < 2 or loc[0] != "body" or not isinstance(loc[1], str):
            return errors
        branches.setdefault(loc[1], []).append(error)
    one = [name for name in branches if f"list[{name}]" in branches]
    if len(branches) != 2 or len(one) != 1:
        return errors
    single, listed = branches[one[0]], branches[f"list[{one[0]}]"]

    def not_a(errs: list[Any], *types: str) -> bool:  # the body is not of this branch's type
        return len(errs) == 1 and len(errs[0]["loc"]) == 2 and errs[0].get("type") in types

    is_object = not_a(listed, "list_type")
    is_list = not_a(single, "model_type", "model_attributes_type", "dict_type")
    if is_object == is_list:
        return errors
    kept = single if is_object else listed
    return [{**error, "loc": ("body", *error["loc"][2:])} for error in kept]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        # Once each: a path parameter a route and its auth dependency both declare fails twice.
        found = list(
            {_describe(error): error for error in _sent_branch(list(exc.errors()))}.values()
        )
        errors = [
            {key: value for key, value in error.items() if key in ("loc", "msg", "type")}
            for error in found
        ]
        message = "; ".join(_describe(error) for error in found[:5])
        shaped = proxy.error_for_path(request.url.path, 422, message)
        return shaped if shaped is not None else _error(422, message, detail=errors)

    @app.exception_handler(StoreError)
    async def on_store_error(request: Request, exc: StoreError) -> Response:
        if isinstance(exc, Invalid) and not request.url.path.startswith("/proxy/"):
            return _error(422, str(exc), detail=exc.errors)
        status_code = (
            404
            if isinstance(exc, NotFound)
            else 409
            if isinstance(exc, Conflict)
            else 422
            if isinstance(exc, Invalid)
            else 400
        )
        shaped = proxy.error_for_path(request.url.path, status_code, str(exc))
        return shaped or _error(status_code, str(exc))

    @app.exception_handler(sqlalchemy.exc.DBAPIError)
    async def on_database_error(request: Request, exc: sqlalchemy.exc.DBAPIError) -> Response:
        # A full disk or a database that went away is an outage to wait out or fix, not a bug:
        # say which (507, 503 with Retry-After) instead of a bare 500. The request was not
        # acknowledged; every write is idempotent, so clients retry 5xx (`GatewayClient`), and
        # the same process serves again once the database does.
        if _disk_full(exc):
            message = (
                "the gateway's database has no space left on its disk "
                f"({str(exc.orig).splitlines()[0]}); this request was not stored. Free space "
                "on the database's disk and retry: acknowledged writes are kept"
            )
            return _outage(request, 507, message)
        if (
            exc.connection_invalidated
            or isinstance(exc, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError)
            # PostgreSQL: connection exception (08), shutting down or starting up (57P0x)
            or _sqlstate(exc).startswith(("08", "57P0"))
        ):
            return _unavailable(request, str(exc.orig).splitlines()[0])
        raise exc

    @app.exception_handler(ConnectionError)
    async def on_connection_error(request: Request, exc: ConnectionError) -> Response:
        # Only the store connects from a route (the proxy handles its engine's errors itself):
        # the database refused a new connection (it is restarting, or down).
        return _unavailable(request, repr(exc))

    @app.exception_handler(Exception)
    async def on_defect(request: Request, exc: Exception) -> Response:
        # A defect of the gateway: answered in the harness's API's shape (or the gateway's),
        # not as a bare text 500; Starlette then logs it with its traceback.
        # The exception's type only: its text may hold a statement, a path, a value.
        message = f"the gateway failed on this request ({type(exc).__name__}); its log says why"
        return proxy.error_for_path(request.url.path, 500, message) or _error(500, message)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = _routing_message(request, exc)
        # Under /proxy/, in the shape of the harness's API (its SDK shows only that).
        shaped = proxy.error_for_path(request.url.path, exc.status_code, message)
        response = shaped or _error(exc.status_code, message)
        if exc.headers:
            response.headers.update(exc.headers)
        if exc.status_code == 405 and exc.detail == "Method Not Allowed":
            response.headers["Allow"] = ", ".join(_allowed_methods(request))
        return response


def _routing_message(request: Request, exc: StarletteHTTPException) -> str:
    """The router's own 404 and 405 name the path and the method: Starlette's bare "Not
    Found" and "Method Not Allowed" named neither (a rollout id with a `/`, even escaped as
    %2F, is a path no route has)."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404 and exc.detail == "Not Found":
        return f"{where}: no such route (see GET /openapi.json for the gateway's routes)"
    if exc.status_code == 405 and exc.detail == "Method Not Allowed":
        allowed = ", ".join(_allowed_methods(request))
        return f"{where}: this path does not take {request.method} (it takes {allowed})"
    return str(exc.detail)


def _allowed_methods(request: Request) -> list[str]:
    """The methods some route of the path takes (asked of the router, method by method):
    Starlette's `Allow` named only those of the first route of the path (`PUT /api/rollouts`
    said POST, not GET too; `PUT /healthz` GET, not HEAD)."""
    routes = request.app.router.routes

    def served(method: str) -> bool:
        scope = {**request.scope, "method": method}
        return any(route.matches(scope)[0] is Match.FULL for route in routes)

    return [method for method in _METHODS if served(method)]


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _outage(request: Request, status_code: int, message: str) -> Response:
    response = proxy.error_for_path(request.url.path, status_code, message) or _error(
        status_code, message
    )
    if status_code == 503:
        response.headers["Retry-After"] = "1"
    return response


def _unavailable(request: Request, detail: str) -> Response:
    return _outage(
        request,
        503,
        f"the gateway cannot reach its database ({detail}); this request was not "
        "acknowledged. Retry it (every write is idempotent): the gateway reconnects by itself "
        "once the database is back",
    )


def _sqlstate(error: sqlalchemy.exc.DBAPIError) -> str:
    orig = error.orig
    return str(getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None) or "")


def _disk_full(error: sqlalchemy.exc.DBAPIError) -> bool:
    """SQLite's SQLITE_FULL, or PostgreSQL's disk_full (SQLSTATE 53100)."""
    return "database or disk is full" in str(error.orig) or _sqlstate(error) == "53100"


class GatewayApp(FastAPI):
    """FastAPI, but a proxied call goes through a shorter stack: the error handlers and the
    body limit (the same answers), without FastAPI's exception telemetry, body limit and exit
    stack (which its endpoints, plain Starlette ones, do not use) and its router's other routes.
    ~0.04 ms of each call at one client (docs/benchmarks.md, "LLM proxy"). Anything under
    /proxy/ that none of `fast.PROXY_ROUTES` serves goes on to the whole app."""

    _short_stack: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/proxy/"):
            await super().__call__(scope, receive, send)
            return
        if self._short_stack is None:
            self._short_stack = self._build_short_stack()
        if self.root_path:
            scope["root_path"] = self.root_path
        scope["app"] = self
        await self._short_stack(scope, receive, send)

    def _build_short_stack(self) -> ASGIApp:
        async def whole_app(scope: Scope, receive: Receive, send: Send) -> None:
            await FastAPI.__call__(self, scope, receive, send)

        handlers = {
            kind: handler
            for kind, handler in self.exception_handlers.items()
            if kind not in (500, Exception)
        }
        router = Router(routes=fast.PROXY_ROUTES, default=whole_app)
        limited = BodySizeLimit(
            ExceptionMiddleware(router, handlers=handlers, debug=self.debug),
            max_bytes=self.state.settings.max_body_bytes,
        )
        server_error = self.exception_handlers.get(500) or self.exception_handlers.get(Exception)
        return ServerErrorMiddleware(limited, handler=server_error, debug=self.debug)


class BodySizeLimit:
    """Answers 413 to bodies over the limit, declared or streamed, before they are parsed; and
    415 to compressed ones (a `Content-Encoding` the gateway does not decode: read as JSON, a
    gzip body was "malformed JSON ... not valid UTF-8", which did not say why)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        if encoding not in (b"identity", b"") and has_body:
            message = (
                f"the request body is encoded ({encoding.decode('latin-1')}), which the gateway "
                "does not decode; send it uncompressed, without a Content-Encoding header"
            )
            await _send_error(scope, receive, send, 415, message)
            return
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                message = "the Content-Length header is not a number"
                await _send_error(scope, receive, send, 400, message)
                return
            if int(declared) > self.max_bytes:
                if int(declared) <= DRAINED_BYTES:
                    await _drain(receive, DRAINED_BYTES)
                await _send_error(scope, receive, send, 413, self._too_large())
                return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(self._too_large())
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _drain(receive, DRAINED_BYTES - received)
                await _send_error(scope, receive, send, 413, self._too_large())

    def _too_large(self) -> str:
        return (
            f"the request body is larger than the limit of {self.max_bytes} bytes "
            "(the gateway's REINS_MAX_BODY_BYTES)"
        )


DRAINED_BYTES = 256 * 1024 * 1024
"""A body over the limit is read and dropped up to this size before the 413 is sent: a client
that sends its whole body before it reads an answer (urllib, requests) then reads the 413. A
body left unread is reset under it when the connection closes: the client saw a reset, which
`reins.agent` retried for two minutes as an outage."""


async def _drain(receive: Receive, limit: int) -> None:
    """Reads the rest of the request body and drops it, `limit` bytes at most."""
    read = 0
    while read <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class _BodyTooLarge(HTTPException):
    """An HTTPException, so that FastAPI's body parsing re-raises it instead of answering 400."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)


async def _send_error(
    scope: Scope, receive: Receive, send: Send, status_code: int, message: str
) -> None:
    """An error answered before any route runs: under /proxy/, in the shape of the harness's
    API, as the exception handlers answer (Anthropic's SDK reads `error.type`, e.g.
    `request_too_large` for a 413, from that shape only)."""
    shaped = proxy.error_for_path(scope["path"], status_code, message)
    await (shaped or _error(status_code, message))(scope, receive, send)
