"""Serve an ASGI app from a background thread on loopback (the engine and gateway in-process) or
in the foreground (`serve`); an inference server's root URL however it was written.

Both servers tell an app that they are shutting down before they wait for its answers to end:
an app whose `state.before_shutdown` is set (the embedded engine's: it aborts its requests) has
it called first. uvicorn alone waits for every response to complete, with no bound: `reins
engine` with a 3,000-token stream in flight took 651 s to stop on Ctrl-C."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

GRACEFUL_SHUTDOWN_S = 30
"""How long a server waits for the answers in flight to end once it shuts down; past that they
are cancelled."""


class _Server(uvicorn.Server):
    """uvicorn's server, calling the app's `state.before_shutdown` (when it has one) as soon as
    it starts to shut down: before it waits for the connections to close."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self._app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        before = getattr(getattr(self._app, "state", None), "before_shutdown", None)
        if callable(before):
            before()
        await super().shutdown(sockets)


def serve(app: Any, *, host: str, port: int, log_level: str = "info", **options: Any) -> None:
    """`uvicorn.run(app, ...)` in this thread until Ctrl-C (or SIGTERM), telling `app` first
    when it starts to shut down (see the module's doc), and waiting at most
    `GRACEFUL_SHUTDOWN_S` for the answers in flight. `options` go to `uvicorn.Config`."""
    options.setdefault("timeout_graceful_shutdown", GRACEFUL_SHUTDOWN_S)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, **options)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled
        _Server(config, app).run()


def engine_root(url: str) -> str:
    """An inference server's root URL, whether it was written with its API's `/v1` or not:
    `reins engine` prints `http://HOST:PORT/v1`, vLLM's docs `http://HOST:PORT`, and users
    copy either (`engine_url`, `reins doctor --engine`)."""
    root = url.rstrip("/")
    return root.removesuffix("/v1") if root.endswith("/v1") else root


def freeze_startup_objects() -> None:
    """For a process about to serve: every object alive now (modules, the app, its routes and
    schemas; ~140k in a gateway) is left out of the garbage collector's full collections, which
    otherwise walk them all, 90-100 ms during which no request moves (a gateway's proxied calls
    at 16 concurrent: p99 ~110 ms against a p50 of ~20). Objects created later are collected as
    before; those left out stay alive."""
    gc.collect()
    gc.freeze()


YOUNG_COLLECTION_THRESHOLD = 10_000
"""Tracked objects a gateway may allocate (net of those freed) before CPython collects its
youngest generation; CPython's default is 700."""


def collect_young_objects_less_often() -> None:
    """For the gateway: with CPython's threshold of 700 a young collection ran every ~9
    proxied calls (110 per 1,000), ~150 us each, ~22 us of every call, walking the objects
    the calls in flight still held (their parsed requests and answers, their records), which a
    call's end frees by their reference counts anyway; with 10,000, none ran in 2,000 calls
    (docs/benchmarks.md, "LLM proxy"). What only a collection frees (cycles) is still
    collected, once this many objects have piled up. A threshold set higher already is kept."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_COLLECTION_THRESHOLD), middle, old)


class BackgroundServer:
    """uvicorn in a daemon thread; `port=0` takes a free port (read it from `.port`), `unix_path`
    serves on a Unix socket instead (created there, owner-only)."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        unix_path: str | Path | None = None,
    ) -> None:
        self.host = host
        if unix_path is None:
            self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host, port))
            self.port: int = self._socket.getsockname()[1]
        else:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._socket.bind(str(unix_path))
            os.chmod(unix_path, 0o600)
            self.port = 0
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False)
        self._server = _Server(config, app)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
