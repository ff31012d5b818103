"""The proxy's HTTP client for its engines: keep-alive HTTP/1.1 on asyncio's own transports, the
answers parsed by httptools (uvicorn's parser, llhttp).

Every harness call goes through this twice over (the request out, the answer in), and aiohttp's
session cost more than the proxy's own work on it: ~0.12 ms of CPU and ~0.17 ms of wall time a
small call against ~0.04 and ~0.08 ms for this client (a loop of calls to a loopback server),
and ~0.15 ms of the proxy's added latency (`benchmarks/proxy.py`, docs/benchmarks.md). It does
what the proxy asks of an engine and no more: POST a body, read the answer whole or as it comes
(content-length, chunked, or until the engine closes; gzip and deflate decoded), keep the
connection for the next call, or close it to stop a generation the harness left.

- **Timeouts**: connecting (`connect_timeout_s`), and waiting for the engine's next bytes
  (`read_timeout_s`, the headers included), as aiohttp's `sock_connect` and `sock_read` were.
  Time a body waits for its reader does not count.
- **Failures** are aiohttp's exception classes, which the proxy already tells apart (and the vLLM
  token-reuse path, still on aiohttp, raises): never connected (`ConnectionTimeoutError`,
  `ClientOSError`), closed or garbled before the answer (`ServerDisconnectedError`), the answer
  cut short or undecodable (`ClientPayloadError`), a read timeout (`SocketTimeoutError`, a
  `TimeoutError`).
- **Back-pressure**: a stream's bytes that its reader has not taken stop the reading at 1 MiB,
  so a slow harness slows its engine rather than filling the gateway's memory.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import ssl
import zlib
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import quote, unquote, urlsplit

import aiohttp
import httptools

_PAUSE_AT = 1 << 20
"""Bytes of a body waiting for its reader at which the connection stops reading."""
_IDLE_PER_ENGINE = 64
"""Idle keep-alive connections kept per engine address; more are closed when released."""
_DECODED = ("gzip", "x-gzip", "deflate")
_SAFE = "/?&=%:@!$'()*+,;~-._"
"""What a request target keeps as it is: percent-escapes and URL punctuation; anything else
(a space, a non-ASCII character) is percent-encoded, as aiohttp did."""

_Address = tuple[str, str, int]
"""Scheme, host, port."""


class Headers(dict[str, str]):
    """An answer's headers, names lowercased (the first of a repeated name kept); `get` takes a
    name in any case."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)


class EngineClient:
    """Connections to the engines, kept open between calls (one call at a time on each)."""

    def __init__(self, connect_timeout_s: float | None, read_timeout_s: float | None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: dict[_Address, list[_Connection]] = {}
        self._connections: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> EngineResponse:
        """Sends the request and returns once the answer's headers are in; its body is read
        from the response (`read`, `content.iter_any`), which must then be released or closed."""
        try:
            parts = urlsplit(url)  # ValueError: `http://[::1/v1`, an unclosed IPv6 address
            port = parts.port or (443 if parts.scheme == "https" else 80)  # ValueError: 99999
        except ValueError as error:
            raise aiohttp.InvalidURL(url) from error
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise aiohttp.InvalidURL(url)
        target = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""), _SAFE)
        lines = [
            f"POST {target} HTTP/1.1",
            f"host: {parts.netloc.rpartition('@')[2]}",
            f"content-length: {len(body)}",
            "accept-encoding: identity",
            *(f"{name}: {value}" for name, value in headers.items()),
        ]
        if parts.username is not None:  # http://user:password@host/v1, as aiohttp sent it
            secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            lines.append(f"authorization: Basic {base64.b64encode(secret.encode()).decode()}")
        try:
            head = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
        except UnicodeEncodeError as error:  # a host name that is not ASCII
            raise aiohttp.InvalidURL(url) from error
        address = (parts.scheme, parts.hostname, port)
        connection = self._idle_connection(address) or await self._connect(address)
        return await connection.send(head, body, self.read_timeout_s)

    async def close(self) -> None:
        for connection in list(self._connections):
            connection.close()
        self._idle.clear()

    def _idle_connection(self, address: _Address) -> _Connection | None:
        idle = self._idle.get(address)
        while idle:
            connection = idle.pop()
            if connection.usable():
                return connection
        return None

    async def _connect(self, address: _Address) -> _Connection:
        scheme, host, port = address
        tls = self._tls_context() if scheme == "https" else None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, address),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls is not None else None,
                )
        except TimeoutError:
            waited = f"{self.connect_timeout_s:g}"
            message = f"connecting to {host}:{port} took over {waited} s"
            raise aiohttp.ConnectionTimeoutError(message) from None
        except OSError as error:
            message = f"cannot connect to {host}:{port}: {error.strerror or error}"
            raise aiohttp.ClientOSError(error.errno, message) from error
        self._connections.add(connection)
        return connection

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _release(self, connection: _Connection) -> None:
        idle = self._idle.setdefault(connection.address, [])
        if len(idle) < _IDLE_PER_ENGINE:
            idle.append(connection)
        else:
            connection.close()

    def _forget(self, connection: _Connection) -> None:
        self._connections.discard(connection)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; httptools calls its `on_*` methods as the answer comes in."""

    def __init__(self, client: EngineClient, address: _Address) -> None:
        self.client = client
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: EngineResponse | None = None
        self.lost = False
        self.paused = False

    def usable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    async def send(self, head: bytes, body: bytes, read_timeout_s: float | None) -> EngineResponse:
        assert self.transport is not None
        response = EngineResponse(self, read_timeout_s)
        self.response = response
        self.transport.writelines([head, body])
        try:
            await response.headers_in()
        except BaseException:
            self.close()  # cancelled (the harness left) or failed: the engine sees it go
            raise
        return response

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None or response.ended:
            self.close()  # bytes nobody asked for: the connection cannot be trusted again
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            response.fail(f"the engine's answer is not valid HTTP/1.1: {error}")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.client._forget(self)
        if self.response is not None:
            self.response.connection_ended(exc)

    # -- httptools callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.response is not None
        self.response.headers_done(self.parser.get_status_code(), self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response.feed(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        self.response.message_done()


class EngineResponse:
    """An engine's answer, with the part of `aiohttp.ClientResponse` the proxy uses: `status`,
    `headers`, `read()`, `content.iter_any()`, `content.at_eof()`, `release()`, `close()`."""

    def __init__(self, connection: _Connection, read_timeout_s: float | None) -> None:
        self.status = 0
        self.headers = Headers()
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.content = self
        self._connection = connection
        self._read_timeout_s = read_timeout_s
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: Exception | None = None
        self._has_headers = False
        self._keep_alive = False
        self._until_close = False
        self._decoder: zlib._Decompress | None = None
        self._done = False  # the message is complete
        self.ended = False  # complete or failed: nothing more will come

    # -- what the proxy reads ------------------------------------------------------------

    async def read(self) -> bytes:
        while not self.ended:
            await self._wait()
        if self._error is not None:
            raise self._error
        body = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return body

    async def iter_any(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                yield data
            elif self._error is not None:
                raise self._error
            elif self.ended:
                return
            else:
                await self._wait()

    def at_eof(self) -> bool:
        return self._done and not self._chunks

    def release(self) -> None:
        """Done with the answer: its connection serves the next call if the answer was read to
        its end, else it is closed. Once only: a second `release` or `close` (the proxy's relay
        ends a stream, then settles it) does nothing, since the connection may carry another
        call by then."""
        connection = self._connection
        if connection.response is not self:
            return
        connection.response = None
        if self._done and self._keep_alive and connection.usable():
            connection.resume()
            connection.client._release(connection)
        else:
            connection.close()

    def close(self) -> None:
        """Closes the connection: an engine still generating sees its client leave. Nothing
        once the answer was released or closed."""
        if self._connection.response is not self:
            return
        self._connection.response = None
        self._connection.close()

    # -- fed by the connection -----------------------------------------------------------

    async def headers_in(self) -> None:
        while not self._has_headers:
            if self._error is not None:
                raise self._error
            await self._wait()

    def headers_done(self, status: int, keep_alive: bool) -> None:
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            self.raw_headers.clear()
            return
        self.status = status
        self._keep_alive = keep_alive
        headers = self.headers
        for raw_name, raw_value in self.raw_headers:
            headers.setdefault(raw_name.decode("latin-1").lower(), raw_value.decode("latin-1"))
        self._until_close = (
            "content-length" not in headers
            and "transfer-encoding" not in headers
            and status not in (204, 304)
        )
        self._has_headers = True
        encoding = (headers.get("content-encoding") or "identity").strip().lower()
        if encoding in _DECODED:
            self._decoder = zlib.decompressobj(wbits=47)  # a gzip or zlib header, either
        elif encoding != "identity":
            self.fail(f"the engine's answer is {encoding}-encoded, which the gateway cannot read")
            self._connection.close()
        self._wake()

    def feed(self, data: bytes) -> None:
        if self.ended:
            return
        if self._decoder is not None:
            try:
                data = self._decoder.decompress(data)
            except zlib.error as error:
                self.fail(f"the engine's compressed answer does not decode: {error}")
                self._connection.close()
                return
        if data:
            self._chunks.append(data)
            self._buffered += len(data)
            if self._buffered >= _PAUSE_AT and self._waiter is None:
                self._connection.pause()
            self._wake()

    def message_done(self) -> None:
        if not self._has_headers or self.ended:  # the end of an interim answer
            return
        if self._decoder is not None:
            tail = self._decoder.flush()
            if tail:
                self._chunks.append(tail)
                self._buffered += len(tail)
        self._done = self.ended = True
        self._wake()

    def connection_ended(self, exc: Exception | None) -> None:
        if self.ended:
            return
        if self._has_headers and self._until_close and exc is None:
            self.message_done()  # a body that ends with its connection
        elif self._has_headers:
            self.fail(f"the engine closed the connection before the end of its answer ({exc!r})")
        else:
            self.ended = True
            message = "the engine closed the connection before answering"
            self._error = aiohttp.ServerDisconnectedError(message)
            self._wake()

    def fail(self, message: str) -> None:
        if self.ended:
            return
        self.ended = True
        error: Exception = aiohttp.ClientPayloadError(message)
        if not self._has_headers:
            error = aiohttp.ServerDisconnectedError(message)
        self._error = error
        self._wake()

    # -- waiting -----------------------------------------------------------------------------

    async def _wait(self) -> None:
        """Until the connection brings something (or the read timeout passes: the connection
        is then closed, as the engine's answer can no longer be trusted to follow in order)."""
        self._connection.resume()
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None
        if self._read_timeout_s is not None:
            timer = loop.call_later(self._read_timeout_s, self._timed_out, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _timed_out(self, waiter: asyncio.Future[None]) -> None:
        if waiter.done():
            return
        waited = f"{self._read_timeout_s:g}"
        error = aiohttp.SocketTimeoutError(f"the engine sent nothing for {waited} s")
        self.ended = True
        self._error = error
        self._connection.close()
        waiter.set_exception(error)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
