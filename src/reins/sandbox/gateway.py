"""The one network door of a sandbox whose harness runs inside it (Claude Code, Codex): a Unix
socket on the host that forwards HTTP requests for one attempt's proxy to the gateway and refuses
everything else.

A coding-agent CLI runs its own tools, so the whole CLI runs in the sandbox, and it must reach the
model. The sandbox relays a port of its loopback to this socket (`Sandbox(relays=door.relays)`);
here each request is checked before it is sent on: only paths under the attempt's proxy
(`.../mode/{mode}/openai/...` and `.../anthropic/...`) pass, so the scoped token the harness holds
cannot post events (a reward among them) or reach any other gateway route, and nothing but the
gateway is reachable at all. The inside port is the gateway's own, so a loopback gateway URL is
the same string inside and out (`inside_url` maps any other); a port under 1024 (a gateway
behind http://host or https://host), which the sandbox cannot listen on without a capability,
is 8000 + it inside (8080, 8443).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount
from starlette.types import Receive, Scope, Send

from reins.serving import BackgroundServer

_OPENAI_SUFFIX = "/openai/v1"
# Per connection, not end to end (RFC 9110 7.6.1). A request's body is passed on as it comes,
# with its own length when it has one (else chunked); a response's passes as it is, its raw
# bytes being passed on.
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer"}
    | {"upgrade"}
)
_NOT_SENT_ON = _HOP_BY_HOP | {"host"}


class GatewayDoor:
    """Serves on `socket_path` (a private temporary folder) until `close`; a context manager.

    `openai_base_url` is the attempt's proxy URL as the controller sets it (`OPENAI_BASE_URL`,
    ending in `/openai/v1`)."""

    def __init__(self, openai_base_url: str) -> None:
        url = urlsplit(openai_base_url.rstrip("/"))
        if not url.path.endswith(_OPENAI_SUFFIX) or url.scheme not in ("http", "https"):
            raise ValueError(
                f"{openai_base_url!r} is not a reins proxy URL (http(s)://.../openai/v1, the "
                "OPENAI_BASE_URL that `reins controller` sets)"
            )
        self.origin = f"{url.scheme}://{url.netloc}"
        port = url.port or (443 if url.scheme == "https" else 80)
        # Without capabilities the relay cannot listen under 1024: every command failed.
        self.port = port if port >= 1024 else 8000 + port
        attempt = url.path[: -len(_OPENAI_SUFFIX)]
        self.allowed = (f"{attempt}/openai/", f"{attempt}/anthropic/")
        self.refused: list[str] = []
        """`METHOD path` of the first `REFUSALS_KEPT` requests refused, in order (for the
        rollout's record), each cut to 300 characters; `refused_count` counts them all."""
        self.refused_count = 0
        self._folder = Path(tempfile.mkdtemp(prefix="reins-gateway-door-"))
        self.socket_path = self._folder / "gateway.sock"
        self._client: httpx.AsyncClient | None = None
        # Every method reaches `_forward` (a Route answered 405 to TRACE or PROPFIND, unrecorded).
        app = Starlette(routes=[Mount("/", app=self._asgi)], lifespan=self._lifespan)
        self._server = BackgroundServer(app, unix_path=self.socket_path).start()

    @property
    def relays(self) -> dict[int, Path]:
        """`Sandbox(relays=...)`: the gateway's port inside, relayed here."""
        return {self.port: self.socket_path}

    def inside_url(self, url: str) -> str:
        """`url` of the gateway as a command in the sandbox reaches it (through the relay)."""
        parts = urlsplit(url)
        if f"{parts.scheme}://{parts.netloc}" != self.origin:
            raise ValueError(f"{url!r} is not on the gateway {self.origin}")
        return parts._replace(scheme="http", netloc=f"127.0.0.1:{self.port}").geturl()

    def passes(self, raw_path: str) -> bool:
        """Whether a request for `raw_path` (as sent) may go to the gateway: under the allowed
        prefixes, with no dot segment or escape that a server could normalise out of them."""
        odd = "%" in raw_path or "\\" in raw_path
        dots = any(segment in (".", "..") for segment in raw_path.split("/"))
        under = raw_path.startswith(self.allowed) or f"{raw_path}/" in self.allowed
        return under and not odd and not dots  # (Claude Code first sends `HEAD` to its base)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: Starlette) -> AsyncIterator[None]:
        # Made on the server's own event loop, and closed there.
        async with httpx.AsyncClient(base_url=self.origin, timeout=None) as client:
            self._client = client
            yield

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self._forward(Request(scope, receive))
        await response(scope, receive, send)

    async def _forward(self, request: Request) -> Response:
        assert self._client is not None
        raw_path = request.scope.get("raw_path", b"").decode("latin-1") or request.url.path
        if not self.passes(raw_path):
            self.refused_count += 1
            if len(self.refused) < REFUSALS_KEPT:  # a command can send refused paths forever
                self.refused.append(f"{request.method} {raw_path}"[:300])
            return PlainTextResponse(
                "refused by the sandbox's gateway door: only this attempt's model proxy "
                f"({' or '.join(p + '...' for p in self.allowed)}) is reachable from here\n",
                status_code=403,
            )
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _NOT_SENT_ON]
        query = request.url.query
        upstream = self._client.build_request(
            request.method,
            raw_path + (f"?{query}" if query else ""),
            headers=headers,
            # Passed on as it comes: read whole here, a 400 MB body took the host's memory
            # past any limit of the sandbox's. The gateway applies its own limit.
            content=request.stream(),
        )
        try:
            answer = await self._client.send(upstream, stream=True)
        except httpx.HTTPError as error:
            return PlainTextResponse(f"the gateway is unreachable: {error}\n", status_code=502)
        back = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
        return StreamingResponse(
            answer.aiter_raw(),
            status_code=answer.status_code,
            headers=back,
            background=BackgroundTask(answer.aclose),
        )

    def close(self) -> None:
        self._server.stop()
        shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> GatewayDoor:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


REFUSALS_KEPT = 100
