"""Shared fixtures: the store backends (SQLite file, real PostgreSQL) and a gateway on loopback."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Under pytest-xdist (`make test`: 2 workers on 2 cores) torch's one thread per core in every
# worker oversubscribes the cores while both run models: measured here, two workers each
# decoding with the 135M model took 31 s with the default threads and 23 s with one thread
# each, while one alone took 24 s with two threads and 23 s with one. Set before torch is
# imported; the servers and agents the tests start inherit it (the vLLM server does not:
# tests/vllm_support.py).
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["REINS_TESTS_SET_OMP_THREADS"] = "1"


import httpx
import pytest
import uvicorn

from reins.gateway import GatewaySettings, create_app
from tests.support import PostgresServer, free_port, postgres_bin_dir

ADMIN_KEY = "test-admin-key"


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server from Debian's package, on 127.0.0.1, for the whole session."""
    if postgres_bin_dir() is None:
        message = "PostgreSQL is not installed; `make test` installs Debian's `postgresql`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    server = PostgresServer.start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The same tests run on both stores: a SQLite file, and a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    server: PostgresServer = request.getfixturevalue("postgres")
    return server.create_database(f"t_{uuid.uuid4().hex[:16]}")


@dataclass
class Gateway:
    """A gateway served by uvicorn on a loopback port, in a thread of the test process."""

    url: str
    api_key: str
    settings: GatewaySettings
    http: httpx.Client
    """A client that sends the admin key."""

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def first_attempt(self, rollout_id: str = "r") -> tuple[str, str]:
        """Declares `rollout_id` and opens its first attempt: (the attempt's train-mode proxy
        URL, its scoped token)."""
        self.http.post("/api/rollouts", json=[{"rollout_id": rollout_id}])
        token = str(self.http.post(f"/api/rollouts/{rollout_id}/attempts").json()["token"])
        return f"{self.url}/proxy/rollout/{rollout_id}/attempt/1/mode/train", token


class ThreadedServer:
    def __init__(self, settings: GatewaySettings) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve(settings: GatewaySettings) -> ThreadedServer:
    return ThreadedServer(settings)


@pytest.fixture
def gateway_settings(database_url: str) -> GatewaySettings:
    return GatewaySettings(database_url=database_url, api_key=ADMIN_KEY)


@pytest.fixture
def gateway(gateway_settings: GatewaySettings) -> Iterator[Gateway]:
    with serve(gateway_settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
        ) as http:
            yield Gateway(url=url, api_key=ADMIN_KEY, settings=gateway_settings, http=http)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from tests.scheduling import make_scheduler

    return make_scheduler(config, log)
