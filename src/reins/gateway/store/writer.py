"""Where SQLite's event group commits run: a process of their own (`ProcessWriter`, the default),
or a thread of the gateway's (`ThreadWriter`, when asked: `REINS_SQLITE_EVENT_WRITER=thread`).

A group commit packs its `model_request` events (~0.1 ms each, `reins.packed`) and commits. In
the gateway's process that work and the HTTP work shared one interpreter lock, so appends were
bound by one core whatever the machine had (16 clients: 0.14-0.18x the `/healthz` floor on 2
cores, docs/benchmarks.md). In a process of its own it runs beside the HTTP work. The store keeps
everything else: which posts go in which commit, the attempt checks' cache, the call journal,
the answers. The writer holds the connection the commits run on and the packing bases
(`Packer`), which only its commits add to; a restarted writer rebuilds them from the rows.

The store says where each commit runs (`CommitPlace`): a lone small post's on the event loop's
thread, the proxy's journaled calls' (answered already) on a thread of the gateway's, the rest
in the writer. The store runs one commit at a time (its write lock). Over the socket,
("commit", `Commit`) is answered ("ok", `Written`) or ("error", exception); ("forget",
rollout id) has no answer.
The gateway's side of it is an asyncio stream (a blocking send of a large commit, on a socket
the event loop had made non-blocking, failed with EAGAIN). The writer stops when the socket
closes: the gateway closed its store, or died (a kill included: its end closes with it).

Tried and not kept: sending each batch as soon as it was queued, several commits in flight, the
writer running all that had arrived in one transaction. The writer still ran ~1 message a
transaction and the figures did not move (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from reins.gateway.jsonrule import Encoded
from reins.gateway.store.appends import Commit, Written, commit_events
from reins.gateway.store.packing import Packer
from reins.gateway.store.pragmas import sqlite_engine

logger = logging.getLogger(__name__)

CommitPlace = Literal["loop", "thread", "writer"]
"""Where the store asks a commit to run: the event loop's thread, a thread of the gateway's
process, or the writer (its process, or its thread)."""

_START_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 10.0


class ThreadWriter:
    """The commits on a thread of the gateway's process, or on its event loop's thread when
    the store asks (`loop`: a lone small commit, cheaper than the hand-over)."""

    def __init__(self, path: str, synchronous: str) -> None:
        self.engine = sqlite_engine(path, synchronous, for_events=True)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="reins-events")
        self._packer = Packer()

    async def write(self, commit: Commit, place: CommitPlace = "writer") -> Written:
        if place == "loop":
            return self.write_now(commit)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.write_now, commit)

    def write_now(self, commit: Commit) -> Written:
        return commit_events(self.engine, self._packer, commit)

    def forget(self, rollout_id: str) -> None:
        self._packer.forget(rollout_id)

    async def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.engine.dispose()


class WriterStopped(ConnectionError):
    """The writer process ended while a commit was in it: that commit is either whole in the
    database or not there at all (SQLite's transaction), and its posts were not answered."""


@dataclass
class _Link:
    """A running writer process: its pid, a pidfd of it, the stream to it, the answers' reader."""

    pid: int
    pidfd: int
    out: asyncio.StreamWriter
    reading: asyncio.Task[None] | None = None


class ProcessWriter:
    """The commits in a process of their own, started by the store's `init` (or the first
    commit) and again by the next commit after it ended; but a lone small commit (`loop`:
    nothing queued behind it, one client at a time) on the event loop's thread, and the
    journaled calls' commits (`thread`) on a thread of the gateway's, as `ThreadWriter` runs
    them: the hand-over to the process and back cost more than the commit (c=1 appends:
    900-950/s against 1,330-1,400/s on the loop's thread; proxied calls ~0.15 ms more CPU
    each). Each side packs against the bases it remembers, rebuilt from the rows when it has
    none: a base the other side committed since is missed (a few bytes more), never wrong."""

    def __init__(self, path: str, synchronous: str) -> None:
        self._here = ThreadWriter(path, synchronous)
        self.path = path
        self._synchronous = synchronous
        self._link: _Link | None = None
        self._answers: deque[asyncio.Future[Written]] = deque()
        self._start_task: asyncio.Task[_Link] | None = None

    @property
    def pid(self) -> int | None:
        """The writer process's pid, while it runs."""
        return self._link.pid if self._link is not None else None

    async def write(self, commit: Commit, place: CommitPlace = "writer") -> Written:
        if place != "writer":
            return await self._here.write(commit, place)
        try:
            return await self._write_there(commit)
        except WriterStopped as error:
            # SQLite committed the whole commit or none of it, and its process is gone (its
            # stream ended). Sent once more, to a new writer: each row carries its idempotency
            # key, so a commit that was stored stores nothing again and answers the stored
            # events, as a client's retry would. Answered 503 instead, a stored call was
            # stored twice by the harness's retry (under a new key).
            logger.warning("%s: sending its commit to a new writer", error)
            return await self._write_there(commit)

    async def _write_there(self, commit: Commit) -> Written:
        link = self._link or await self._start()
        if link.out.is_closing():
            self._stopped(link)
            raise WriterStopped(f"the event writer process {link.pid} ended")
        answer: asyncio.Future[Written] = asyncio.get_running_loop().create_future()
        self._answers.append(answer)
        link.out.write(_framed(pickle.dumps(("commit", _as_sent(commit)), pickle.HIGHEST_PROTOCOL)))
        with contextlib.suppress(ConnectionError):
            await link.out.drain()  # a broken link fails the answer (`_read_answers`)
        return await answer

    async def _read_answers(self, link: _Link, answers: asyncio.StreamReader) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                (size,) = _SIZE.unpack(await answers.readexactly(_SIZE.size))
                kind, value = pickle.loads(await answers.readexactly(size))
                answer = self._answers.popleft()
                if kind == "error":
                    answer.set_exception(value)
                else:
                    answer.set_result(value)
        self._stopped(link)

    def _stopped(self, link: _Link) -> None:
        """The writer is gone (or its link broke): the commits sent to it fail, and the next
        commit starts another."""
        if self._link is not link:
            return
        self._link = None
        error = (
            f"the event writer process {link.pid} ended during a commit; the posts in it were "
            "not answered"
        )
        while self._answers:
            self._answers.popleft().set_exception(WriterStopped(error))
        link.out.close()
        os.close(link.pidfd)
        logger.warning("the event writer process %s ended", link.pid)

    def start_soon(self) -> None:
        """Starts the writer in the background (the store's `init`): the first commit then
        finds it running instead of waiting for it."""
        if self._link is None and self._start_task is None:
            self._start_task = asyncio.get_running_loop().create_task(self._start())

    async def _start(self) -> _Link:
        if self._start_task is not None and self._start_task is not asyncio.current_task():
            await asyncio.shield(self._start_task)
        if self._link is not None:
            return self._link
        try:
            # The first start in a process launches the fork server (~1 s): off the loop.
            pid, pidfd, channel = await asyncio.wait_for(
                asyncio.to_thread(_FORK_SERVER.fork_writer, self.path, self._synchronous),
                _START_TIMEOUT_S,
            )
            answers, out = await asyncio.open_connection(sock=channel)
        finally:
            if self._start_task is asyncio.current_task():
                self._start_task = None
        link = _Link(pid, pidfd, out)
        link.reading = asyncio.get_running_loop().create_task(self._read_answers(link, answers))
        self._link = link
        return link

    def forget(self, rollout_id: str) -> None:
        self._here.forget(rollout_id)
        if self._link is not None:  # a new writer knows no bases
            self._link.out.write(_framed(pickle.dumps(("forget", rollout_id))))

    async def close(self) -> None:
        await self._here.close()
        if self._start_task is not None:
            with contextlib.suppress(Exception):
                await self._start_task
        link, self._link = self._link, None
        if link is None:
            return
        link.out.close()  # the writer reads the end of its stream and exits
        try:
            # Readable once the process ended: it no longer holds the database.
            loop = asyncio.get_running_loop()
            ended = loop.create_future()

            def on_end() -> None:
                if not ended.done():
                    ended.set_result(None)

            loop.add_reader(link.pidfd, on_end)
            try:
                await asyncio.wait_for(ended, _STOP_TIMEOUT_S)
            except TimeoutError:
                logger.warning("the event writer process %s did not stop: killing it", link.pid)
                signal.pidfd_send_signal(link.pidfd, signal.SIGKILL)
            finally:
                loop.remove_reader(link.pidfd)
        finally:
            os.close(link.pidfd)
            if link.reading is not None:
                link.reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await link.reading


_SIZE = struct.Struct("<Q")


def _as_sent(commit: Commit) -> Commit:
    """The commit with each row's document as its JSON text alone, which the writer parses
    back (`_as_received`): pickling the parsed document as well cost as much again, in both
    processes."""
    posts = [[{**row, "data": row["data"].text} for row in post] for post in commit.posts]
    return Commit(posts, commit.from_harness, commit.check)


def _as_received(commit: Commit) -> Commit:
    """Each row's document parsed back from its text: the value a reader of the row gets."""
    for row in commit.rows:
        text = row["data"]
        if isinstance(text, str):
            try:
                value = orjson.loads(text)
            except orjson.JSONDecodeError:
                value = json.loads(text)  # an integer beyond 64 bits
            row["data"] = Encoded(value, text)
    return commit


def _framed(message: bytes) -> bytes:
    return _SIZE.pack(len(message)) + message


def _recv_exactly(channel: socket.socket, size: int) -> bytes:
    parts = []
    while size:
        part = channel.recv(min(size, 1 << 20))
        if not part:
            raise EOFError
        parts.append(part)
        size -= len(part)
    return b"".join(parts)


class _ForkServer:
    """Forks the writer processes. Started once per gateway process: `fork_server` in a fresh
    interpreter, which imports this module and nothing of its caller's (multiprocessing's fork
    server imports the caller's main module in each child, which runs an unguarded script a
    second time), and forks from one thread with no database open (forking the gateway itself
    would copy the locks its threads hold, SQLite's included). A writer then starts in
    milliseconds. The server ends when the gateway's end of its socket closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._control: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def fork_writer(self, path: str, synchronous: str) -> tuple[int, int, socket.socket]:
        """A new writer on the database at `path`: its pid, a pidfd of it, its channel."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._launch()
            assert self._control is not None
            ours, theirs = socket.socketpair()
            try:
                request = pickle.dumps((path, synchronous))
                socket.send_fds(self._control, [request], [theirs.fileno()])
                reply = self._control.recv(8)
            except OSError:
                self._process = None
                raise
            finally:
                theirs.close()
            if len(reply) != 4:
                self._process = None
                raise WriterStopped("the event writers' fork server ended")
            (pid,) = struct.unpack("<i", reply)
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            # It ended as it started (a kill): the posts of its commit are not acknowledged
            # (503, as for a writer that dies later), and its channel is not left open.
            ours.close()
            raise WriterStopped(f"the event writer {pid} ended as it started") from None
        return pid, pidfd, ours

    def _launch(self) -> None:
        if self._control is not None:
            self._control.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._process = subprocess.Popen(
            # The signals ignored before the imports (`fork_server` ignores them too): a Ctrl-C
            # to the process group right after the gateway started killed it mid-import.
            [
                sys.executable,
                "-c",
                "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"import {__name__} as w; w.fork_server({theirs.fileno()})",
            ],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._control = ours


_FORK_SERVER = _ForkServer()


def fork_server(control_fd: int) -> None:
    """The fork server's loop: a writer forked per request, until the gateway goes."""
    _outlive_the_gateways_signals()  # see `_serve`
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the writers
    control = socket.socket(fileno=control_fd)
    while True:
        try:
            request, fds, _, _ = socket.recv_fds(control, 65536, 1)
        except OSError:
            return
        if not request or not fds:
            return  # the gateway closed its end, or died
        path, synchronous = pickle.loads(request)
        pid = os.fork()
        if pid == 0:
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 0
            try:
                _serve(socket.socket(fileno=fds[0]), path, synchronous)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(fds[0])
        try:
            control.send(struct.pack("<i", pid))
        except OSError:
            return  # the gateway died while it asked (its writer reads the end and goes)


def _outlive_the_gateways_signals() -> None:
    """Ctrl-C, and the SIGTERM of a service manager stopping the whole process group (systemd,
    a container's init), reach the writer and its fork server too: they outlive them, the
    gateway stops first and its last commits still go through the writer, which ends when the
    gateway closes its stream (or dies: the stream ends). Ended at once, the writer made the
    gateway's shutdown log its end as a failure and start another for those commits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _serve(channel: socket.socket, path: str, synchronous: str) -> None:
    """The writer process's loop: one commit at a time, until the stream closes."""
    _outlive_the_gateways_signals()
    engine = sqlite_engine(path, synchronous, for_events=True)
    packer = Packer()
    try:
        while True:
            try:
                (size,) = _SIZE.unpack(_recv_exactly(channel, _SIZE.size))
                kind, payload = pickle.loads(_recv_exactly(channel, size))
            except (EOFError, OSError):
                return  # the gateway closed its store, or died
            if kind == "forget":
                packer.forget(payload)
                continue
            try:
                answer: tuple[str, Any] = (
                    "ok",
                    commit_events(engine, packer, _as_received(payload)),
                )
            except Exception as error:
                answer = ("error", error)
            try:
                message = pickle.dumps(answer, pickle.HIGHEST_PROTOCOL)
            except Exception as error:  # an exception that does not pickle
                message = pickle.dumps(("error", RuntimeError(f"{answer[1]!r} ({error!r})")))
            try:
                channel.sendall(_framed(message))
            except OSError:
                return  # the gateway died during the commit: its posts were not answered
    finally:
        engine.dispose()
        channel.close()
