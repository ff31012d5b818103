"""Where SQLite's event group commits run: a process of their own (`ProcessWriter`, the default
for a database file), or a thread of the gateway's (`ThreadWriter`: an in-memory database, or
when asked).

A group commit packs its `model_request` events (~0.1 ms each, `reins.packed`) and commits. In
the gateway's process that work and the HTTP work shared one interpreter lock, so appends were
bound by one core whatever the machine had (16 clients: 0.14-0.18x the `/healthz` floor on 2
cores, docs/benchmarks.md). In a process of its own it runs beside the HTTP work. The store keeps
everything else: which posts go in which commit, the attempt checks' cache, the call journal,
the answers. The writer holds the connection the commits run on and the packing bases
(`Packer`), which only its commits add to; a restarted writer rebuilds them from the rows.

The store runs one commit at a time (its write lock), so the protocol over the pipe is a
request and its answer: ("commit", `Commit`) -> ("ok", `Written`) or ("error", exception);
("forget", rollout id) has no answer. The writer stops when the pipe closes: the gateway closed
its store, or died (a kill included: its end of the pipe closes with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import pickle
import signal
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from reins.gateway.store.appends import Commit, Written, commit_events
from reins.gateway.store.packing import Packer
from reins.gateway.store.pragmas import sqlite_engine

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0


class ThreadWriter:
    """The commits on a thread of the gateway's process, or on its event loop's thread when
    the store asks (`inline`: a lone small commit, cheaper than the hand-over)."""

    def __init__(self, path: str, synchronous: str) -> None:
        self.engine = sqlite_engine(path, synchronous, for_events=True)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="reins-events")
        self._packer = Packer()

    async def write(self, commit: Commit, *, inline: bool = False) -> Written:
        if inline:
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


class ProcessWriter:
    """The commits in a process of their own, started on the first commit (and again after the
    process ended)."""

    def __init__(self, path: str, synchronous: str) -> None:
        self.path = path
        self._synchronous = synchronous
        self._process: Any = None
        self._channel: Connection | None = None
        self._answer: asyncio.Future[Any] | None = None
        self._starting: ThreadPoolExecutor | None = None

    @property
    def pid(self) -> int | None:
        """The writer process's pid, while it runs."""
        return self._process.pid if self._process is not None else None

    async def write(self, commit: Commit, *, inline: bool = False) -> Written:
        del inline  # the hand-over is to another process either way
        channel = self._channel
        if channel is None:
            channel = await self._start()
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._answer = answer
        loop.add_reader(channel.fileno(), self._on_answer, channel)
        try:
            try:
                channel.send_bytes(pickle.dumps(("commit", commit), pickle.HIGHEST_PROTOCOL))
            except OSError as error:
                self._stopped()
                raise WriterStopped(f"the event writer process stopped: {error!r}") from error
            kind, value = await answer
        finally:
            self._answer = None
            if self._channel is channel:
                loop.remove_reader(channel.fileno())
        if kind == "error":
            raise value
        written: Written = value
        return written

    def _on_answer(self, channel: Connection) -> None:
        answer = self._answer
        try:
            message = pickle.loads(channel.recv_bytes())
        except (EOFError, OSError):
            status = self._stopped()
            if answer is not None and not answer.done():
                answer.set_exception(
                    WriterStopped(
                        f"the event writer process stopped during a commit ({status}); the "
                        "posts in it were not answered"
                    )
                )
            return
        if answer is not None and not answer.done():
            answer.set_result(message)

    def _exit_status(self) -> str:
        process = self._process
        if process is None:
            return "not started"
        process.join(timeout=1.0)
        code = process.exitcode
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def _stopped(self) -> str:
        """The writer is gone (or its pipe broke): the next commit starts another. Returns how
        it ended."""
        channel, self._channel = self._channel, None
        if channel is not None:
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                asyncio.get_running_loop().remove_reader(channel.fileno())
            channel.close()
        status = self._exit_status()
        if self._process is not None:
            logger.warning("the event writer process %s stopped (%s)", self._process.pid, status)
            self._process = None
        return status

    async def _start(self) -> Connection:
        # The first start launches multiprocessing's fork server (a fresh interpreter that
        # imports this module, ~1 s): off the event loop.
        loop = asyncio.get_running_loop()
        if self._starting is None:
            self._starting = ThreadPoolExecutor(1, thread_name_prefix="reins-writer-start")
        process, channel = await asyncio.wait_for(
            loop.run_in_executor(self._starting, _start_process, self.path, self._synchronous),
            _START_TIMEOUT_S,
        )
        self._process, self._channel = process, channel
        return channel

    def forget(self, rollout_id: str) -> None:
        if self._channel is None:
            return  # a new writer knows no bases
        try:
            self._channel.send_bytes(pickle.dumps(("forget", rollout_id)))
        except OSError:
            self._stopped()

    async def close(self) -> None:
        channel, process = self._channel, self._process
        self._channel = self._process = None
        if channel is not None:
            channel.close()  # the writer reads the end of its pipe and exits
        if process is not None:
            await asyncio.get_running_loop().run_in_executor(None, process.join, 10.0)
            if process.exitcode is None:
                logger.warning("the event writer process %s did not stop: killing it", process.pid)
                process.kill()
                process.join()
        if self._starting is not None:
            self._starting.shutdown(wait=True)
            self._starting = None


def _start_process(path: str, synchronous: str) -> tuple[Any, Connection]:
    context = multiprocessing.get_context("forkserver")
    # The fork server imports this module once; each writer forked from it starts in ms.
    context.set_forkserver_preload([__name__])
    ours, theirs = context.Pipe()
    process = context.Process(
        target=_serve, args=(theirs, path, synchronous), name="reins-event-writer", daemon=True
    )
    process.start()
    theirs.close()
    return process, ours


def _serve(channel: Connection, path: str, synchronous: str) -> None:
    """The writer process's loop: one commit at a time, until the pipe closes."""
    # Ctrl-C reaches the whole process group: the gateway stops first, and its last commits
    # still go through this process. A SIGTERM ends it (a commit in it rolls back).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine = sqlite_engine(path, synchronous, for_events=True)
    packer = Packer()
    try:
        while True:
            try:
                kind, payload = pickle.loads(channel.recv_bytes())
            except (EOFError, OSError):
                return  # the gateway closed its store, or died
            if kind == "forget":
                packer.forget(payload)
                continue
            try:
                answer: tuple[str, Any] = ("ok", commit_events(engine, packer, payload))
            except Exception as error:
                answer = ("error", error)
            try:
                message = pickle.dumps(answer, pickle.HIGHEST_PROTOCOL)
            except Exception as error:  # an exception that does not pickle
                message = pickle.dumps(("error", RuntimeError(f"{answer[1]!r} ({error!r})")))
            try:
                channel.send_bytes(message)
            except OSError:
                return  # the gateway died during the commit: its posts were not answered
    finally:
        engine.dispose()
        channel.close()
