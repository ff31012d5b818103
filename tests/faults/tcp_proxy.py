"""A real TCP proxy on 127.0.0.1 that a fault test puts between two parts to cut the network.

It forwards bytes both ways, one upstream connection per accepted connection, on its own event
loop in a thread, so sync and async tests control it the same way:
- `drop()` aborts every open connection (both sides get a reset, as when a link dies); new
  connections are accepted and forwarded again at once;
- `stall()` stops forwarding (bytes already read are held, new connections are accepted but
  carry nothing), as a link that silently stops; `resume()` forwards what was held and goes on.
  `stall(downstream_only=True)` holds only the answers: requests reach the server, their replies
  do not reach the client (the case that makes a client retry a write that was applied).
Nothing is ever altered or duplicated by the proxy itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tests.support import free_port

T = TypeVar("T")


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.accepted = 0
        """Connections accepted so far."""
        self.dropped = 0
        """Connections aborted by `drop()` so far."""
        self.held = 0
        """Chunks that arrived while their direction was stalled (a test waits on this)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._writers: set[asyncio.StreamWriter] = set()
        self._up: asyncio.Event | None = None
        self._down: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *_: object) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    async def _start(self) -> None:
        self._up, self._down = asyncio.Event(), asyncio.Event()
        self._up.set()
        self._down.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._set(up=True, down=True)  # nothing waits on a stall any more
        self._abort_all()
        await self._server.wait_closed()
        if self._tasks:  # each ends once its aborted connections report it
            await asyncio.wait(self._tasks, timeout=10)

    def drop(self) -> int:
        """Aborts every open connection; returns how many."""
        return self._call(self._drop())

    async def _drop(self) -> int:
        count = len(self._writers) // 2
        self._abort_all()
        self.dropped += count
        return count

    def _abort_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def stall(self, *, downstream_only: bool = False) -> None:
        self._call(self._set(up=downstream_only, down=False))

    def resume(self) -> None:
        self._call(self._set(up=True, down=True))

    async def _set(self, *, up: bool, down: bool) -> None:
        assert self._up is not None and self._down is not None
        for event, flowing in ((self._up, up), (self._down, down)):
            if flowing:
                event.set()
            else:
                event.clear()

    @property
    def open_connections(self) -> int:
        return len(self._writers) // 2

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)  # type: ignore[arg-type]
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()  # the target is down: the client sees a reset
            return
        pair = {writer, up_writer}
        self._writers |= pair
        assert self._up is not None and self._down is not None
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, self._up), self._pump(up_reader, writer, self._down)
            )
        finally:
            self._writers -= pair
            for each in pair:
                each.transport.abort()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flowing: asyncio.Event
    ) -> None:
        """Copies until either side ends; waits while `flowing` is clear."""
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                chunk = await reader.read(65536)
                if not flowing.is_set():
                    self.held += 1
                    await flowing.wait()
                if not chunk:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()
