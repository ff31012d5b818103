"""The proxy's client for its engines (`reins.gateway.upstream`), against real servers on
127.0.0.1 whose answers each test writes byte by byte: keep-alive, the three ways a body ends,
streams as they come, encodings, TLS, and each way an engine can fail a call."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import shutil
import socket
import ssl
import subprocess
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from reins.gateway import upstream
from reins.gateway.upstream import EngineClient, EngineResponse

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
BODY = b'{"model": "m", "messages": []}'
JSON = {"content-type": "application/json"}


class Engine:
    """A TCP server on 127.0.0.1 running `handler` on each connection it accepts."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.closed_by_client = asyncio.Event()


@contextlib.asynccontextmanager
async def engine(
    handler: Callable[[Engine, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    tls: ssl.SSLContext | None = None,
) -> AsyncIterator[Engine]:
    state = Engine("")

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        try:
            await handler(state, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    state.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/v1/chat/completions"
    try:
        yield state
    finally:
        server.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await server.wait_closed()


async def read_request(state: Engine, reader: asyncio.StreamReader) -> bool:
    """One request off the connection (False: the client closed it)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        state.closed_by_client.set()
        return False
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    state.requests.append((head, await reader.readexactly(length)))
    return True


async def until_client_leaves(state: Engine, reader: asyncio.StreamReader) -> None:
    if await reader.read() == b"":
        state.closed_by_client.set()


def answer(body: bytes, *headers: str, status: str = "200 OK") -> bytes:
    lines = [f"HTTP/1.1 {status}", f"content-length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def post(client: EngineClient, url: str) -> EngineResponse:
    return await client.post(url, BODY, JSON)


@pytest.fixture
async def client() -> AsyncIterator[EngineClient]:
    engines = EngineClient(connect_timeout_s=5, read_timeout_s=5)
    yield engines
    await engines.close()


async def test_calls_share_one_connection_and_send_what_was_given(client: EngineClient) -> None:
    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        while await read_request(state, reader):
            writer.write(answer(b'{"n": %d}' % len(state.requests), "content-type: a/b"))

    async with engine(serve) as state:
        for n in (1, 2, 3):
            response = await post(client, state.url)
            assert response.status == 200
            assert response.headers.get("Content-Type") == "a/b"
            assert await response.read() == b'{"n": %d}' % n
            assert response.content.at_eof()
            response.release()
        assert state.connections == 1
        head, body = state.requests[0]
        port = state.url.split(":")[2].split("/")[0]
        assert body == BODY
        assert head.split(b"\r\n")[0] == b"POST /v1/chat/completions HTTP/1.1"
        assert f"host: 127.0.0.1:{port}".encode() in head.split(b"\r\n")
        assert b"content-type: application/json" in head.split(b"\r\n")
        assert f"content-length: {len(BODY)}".encode() in head.split(b"\r\n")


async def test_credentials_in_the_url_and_odd_paths_are_sent_as_aiohttp_sent_them(
    client: EngineClient,
) -> None:
    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        while await read_request(state, reader):
            writer.write(answer(b"{}"))

    async with engine(serve) as state:
        base = state.url.removesuffix("/v1/chat/completions")
        with_secret = base.replace("http://", "http://us%40er:p%3Ass@")
        for url in (f"{with_secret}/v1/chat/completions", f"{base}/my engine/é?x=1%202"):
            response = await post(client, url)
            assert await response.read() == b"{}"
            response.release()
        first, second = (head.split(b"\r\n") for head, _ in state.requests)
        assert f"authorization: Basic {base64.b64encode(b'us@er:p:ss').decode()}".encode() in first
        assert f"host: {base.removeprefix('http://')}".encode() in first
        assert second[0] == b"POST /my%20engine/%C3%A9?x=1%202 HTTP/1.1"
        assert not any(line.startswith(b"authorization") for line in second)
    with pytest.raises(aiohttp.InvalidURL):
        await client.post("http://\u6f22\u5b57.example/v1", BODY, JSON)


async def test_an_answer_released_or_closed_twice_leaves_its_connection_to_the_next_call(
    client: EngineClient,
) -> None:
    """The proxy's relay releases a stream when it ends and settles it again after the
    response: the connection, pooled once, must not be handed to two calls at once."""

    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        while await read_request(state, reader):
            writer.write(answer(b"%d" % len(state.requests)))

    async with engine(serve) as state:
        first = await post(client, state.url)
        assert await first.read() == b"1"
        first.release()
        first.release()
        first.close()
        async with asyncio.timeout(10):
            answers = await asyncio.gather(post(client, state.url), post(client, state.url))
            bodies = sorted([await answer.read() for answer in answers])
        assert bodies == [b"2", b"3"]
        assert state.connections == 2  # the pooled one, and one more: not the same one twice


async def test_a_chunked_stream_arrives_as_it_is_sent(client: EngineClient) -> None:
    first_read = asyncio.Event()

    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        while await read_request(state, reader):
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"9\r\ndata: 1\n\n\r\n")
            await writer.drain()
            await first_read.wait()
            writer.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
            first_read.clear()

    async with engine(serve) as state:
        for _ in range(2):
            response = await post(client, state.url)
            chunks = response.content.iter_any()
            assert await anext(chunks) == b"data: 1\n\n"  # the engine waits for this read
            assert not response.content.at_eof()
            first_read.set()
            assert [chunk async for chunk in chunks] == [b"data: 2\n\n"]
            assert response.content.at_eof()
            response.release()
        assert state.connections == 1


@pytest.mark.parametrize("close_header", [False, True])
async def test_an_answer_ending_with_its_connection_or_saying_close_is_not_reused(
    client: EngineClient, close_header: bool
) -> None:
    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await read_request(state, reader)
        if close_header:
            writer.write(answer(b"whole", "connection: close"))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\n\r\nwhole, until the end")

    async with engine(serve) as state:
        for _ in range(2):
            response = await post(client, state.url)
            assert await response.read() == (b"whole" if close_header else b"whole, until the end")
            response.release()
        assert state.connections == 2


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_compressed_answers_are_decoded(client: EngineClient, encoding: str) -> None:
    text = b'{"choices": []}' * 1000
    packed = gzip.compress(text) if encoding == "gzip" else zlib.compress(text)

    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        while await read_request(state, reader):
            writer.write(answer(packed, f"content-encoding: {encoding}"))

    async with engine(serve) as state:
        for _ in range(2):
            response = await post(client, state.url)
            assert await response.read() == text
            response.release()
        assert state.connections == 1
        assert b"accept-encoding: identity" in state.requests[0][0].split(b"\r\n")


async def test_an_encoding_the_gateway_cannot_decode_fails_the_answer(
    client: EngineClient,
) -> None:
    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await read_request(state, reader)
        writer.write(answer(b"\x0b\x02\x80", "content-encoding: br"))
        await until_client_leaves(state, reader)

    async with engine(serve) as state:
        response = await post(client, state.url)
        with pytest.raises(aiohttp.ClientPayloadError, match="br-encoded"):
            await response.read()
        response.release()
        await asyncio.wait_for(state.closed_by_client.wait(), 5)


async def test_an_engine_closing_before_it_answers_is_a_connection_error(
    client: EngineClient,
) -> None:
    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await read_request(state, reader)

    async with engine(serve) as state:
        with pytest.raises(aiohttp.ServerDisconnectedError, match="before answering") as failed:
            await post(client, state.url)
        # The proxy retries connection errors, never read timeouts.
        assert isinstance(failed.value, aiohttp.ClientConnectionError)
        assert not isinstance(failed.value, TimeoutError)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_an_answer_cut_short_fails_its_read(client: EngineClient, framing: str) -> None:
    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await read_request(state, reader)
        if framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nhello")

    async with engine(serve) as state:
        response = await post(client, state.url)
        with pytest.raises(aiohttp.ClientPayloadError, match="before the end of its answer"):
            await response.read()
        response.release()


async def test_garbage_instead_of_http_is_a_connection_error(client: EngineClient) -> None:
    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await read_request(state, reader)
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await until_client_leaves(state, reader)

    async with engine(serve) as state:
        with pytest.raises(aiohttp.ServerDisconnectedError, match="not valid HTTP"):
            await post(client, state.url)
        await asyncio.wait_for(state.closed_by_client.wait(), 5)


async def test_an_interim_answer_is_skipped(client: EngineClient) -> None:
    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        while await read_request(state, reader):
            writer.write(b"HTTP/1.1 100 Continue\r\nx-interim: yes\r\n\r\n")
            writer.write(answer(b"final", status="201 Created"))

    async with engine(serve) as state:
        for _ in range(2):
            response = await post(client, state.url)
            assert (response.status, await response.read()) == (201, b"final")
            assert response.headers.get("x-interim") is None
            response.release()
        assert state.connections == 1


@pytest.mark.parametrize("stall", ["headers", "body"])
async def test_an_engine_silent_past_the_read_timeout_is_left(stall: str) -> None:
    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await read_request(state, reader)
        if stall == "body":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nhello")
        await until_client_leaves(state, reader)

    client = EngineClient(connect_timeout_s=5, read_timeout_s=0.3)
    try:
        async with engine(serve) as state:
            with pytest.raises(aiohttp.SocketTimeoutError, match=r"nothing for 0\.3 s") as failed:
                async with asyncio.timeout(10):  # not the client's: it would never end
                    response = await post(client, state.url)
                    await response.read()
            assert isinstance(failed.value, TimeoutError)
            await asyncio.wait_for(state.closed_by_client.wait(), 5)
    finally:
        await client.close()


async def test_a_refused_connection_is_a_connection_error(client: EngineClient) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(aiohttp.ClientOSError, match=f"cannot connect to 127.0.0.1:{port}"):
        await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", BODY, JSON)


async def test_urls_it_cannot_call_are_refused(client: EngineClient) -> None:
    for url in ("ftp://127.0.0.1/v1", "http:///v1", "http://127.0.0.1:99999/v1", "http://[::1/v1"):
        with pytest.raises(aiohttp.InvalidURL):
            await client.post(url, BODY, JSON)


async def test_closing_an_answer_or_leaving_before_it_closes_the_connection(
    client: EngineClient,
) -> None:
    """The engine sees its client leave, which is how vLLM knows to stop generating."""
    received = asyncio.Event()

    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await read_request(state, reader)
        received.set()
        if state.connections == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await until_client_leaves(state, reader)

    async with engine(serve) as state:
        response = await post(client, state.url)  # a stream, closed after its first chunk
        assert await anext(response.content.iter_any()) == b"hi"
        response.close()
        await asyncio.wait_for(state.closed_by_client.wait(), 5)

        state.closed_by_client.clear()
        received.clear()
        waiting = asyncio.create_task(post(client, state.url))  # no answer: the caller leaves
        await asyncio.wait_for(received.wait(), 5)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(state.closed_by_client.wait(), 5)
        assert state.connections == 2


async def test_a_stream_nobody_reads_stops_being_read(
    client: EngineClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow harness holds its engine back rather than filling the gateway's memory."""
    paused = asyncio.Event()
    pause = upstream._Connection.pause

    def pause_and_tell(connection: upstream._Connection) -> None:
        pause(connection)
        paused.set()

    monkeypatch.setattr(upstream._Connection, "pause", pause_and_tell)
    block = bytes(range(256)) * 256  # 64 KiB
    blocks = 256  # 16 MiB

    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await read_request(state, reader)
        writer.write(f"HTTP/1.1 200 OK\r\ncontent-length: {len(block) * blocks}\r\n\r\n".encode())
        for _ in range(blocks):
            writer.write(block)
            await writer.drain()

    async with engine(serve) as state:
        response = await post(client, state.url)
        await asyncio.wait_for(paused.wait(), 10)
        assert response._connection.paused
        assert 1 << 20 <= response._buffered < 2 << 20
        assert await response.read() == block * blocks
        response.release()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl (Debian's `openssl` package) makes the test's certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_an_https_engine_is_called_over_tls_and_its_certificate_checked(
    certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = certificate
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)

    async def serve(state: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        while await read_request(state, reader):
            writer.write(answer(b"over tls"))

    async with engine(serve, tls) as state:
        untrusting = EngineClient(connect_timeout_s=5, read_timeout_s=5)
        with pytest.raises(aiohttp.ClientOSError, match="CERTIFICATE_VERIFY_FAILED"):
            await post(untrusting, state.url)
        await untrusting.close()

        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        trusting = EngineClient(connect_timeout_s=5, read_timeout_s=5)
        for _ in range(2):
            response = await post(trusting, state.url)
            assert await response.read() == b"over tls"
            response.release()
        await trusting.close()
        assert len(state.requests) == 2
