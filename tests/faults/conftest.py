"""Fixtures of the fault suite: real processes (gateway, stub engine) on loopback, stopped by PID.

Every test here is slow-tier. What each one stubs is said in its module docstring; the gateway is
always the real `reins gateway` process (tests/support.py `GatewayProcess`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.support import GatewayProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "fault-admin-key"


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """Polls `condition` until it is true; fails naming `what` after `timeout_s` (no sleeps as
    synchronisation: the short pause only paces the polling)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.02)


@dataclass
class StubProcess:
    """The stub engine (tests/stub_engine.py: the model is stubbed) in its own process."""

    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.stub_process", str(self.port)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_until(self._ready, "the stub engine starting")

    def _ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"the stub engine exited with {self.process.returncode}")
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(f"{self.base_url}/models", timeout=1).status_code == 200
        return False

    def received(self) -> int:
        """Completion requests received since this process started."""
        answer = httpx.get(f"http://127.0.0.1:{self.port}/stub/received", timeout=5)
        return int(answer.json()["received"])

    def kill(self) -> None:
        """SIGKILL, as in a crash: connections in flight are reset."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def stub_process() -> Iterator[StubProcess]:
    """One stub engine process per module (a test that kills it starts its own)."""
    engine = StubProcess()
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def sqlite_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """`reins gateway` on a SQLite file, in its own process, shared by the suite (starting one
    takes seconds on 2 cores; each test uses its own rollout ids and none kills this one)."""
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('gateway') / 'gateway.db'}"
    gateway = GatewayProcess(database_url=url, api_key=ADMIN_KEY, port=free_port())
    gateway.start()
    try:
        yield gateway
    finally:
        gateway.stop()


@pytest.fixture
def fresh_gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    """`reins gateway` on a SQLite file of this test alone (a controller drives every rollout
    it finds, so it must not see other tests' rollouts)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    gateway = GatewayProcess(database_url=url, api_key=ADMIN_KEY, port=free_port())
    gateway.start()
    try:
        yield gateway
    finally:
        gateway.stop()


def admin(gateway_url: str) -> httpx.Client:
    return httpx.Client(
        base_url=gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
    )


def open_rollouts(http: httpx.Client, ids: list[str]) -> dict[str, str]:
    """Declares `ids` and opens attempt 1 of each; returns each one's scoped token."""
    answer = http.post("/api/rollouts", json=[{"rollout_id": rid} for rid in ids])
    assert answer.status_code == 200, answer.text
    tokens = {}
    for rid in ids:
        opened = http.post(f"/api/rollouts/{rid}/attempts", json={"attempt_id": 1})
        assert opened.status_code == 200, opened.text
        tokens[rid] = str(opened.json()["token"])
    return tokens


def proxy_url(gateway_url: str, rollout_id: str) -> str:
    """The OpenAI base URL of attempt 1 of `rollout_id` (what the controller gives a harness)."""
    return f"{gateway_url}/proxy/rollout/{rollout_id}/attempt/1/mode/train/openai/v1"


def model_requests(http: httpx.Client, rollout_id: str) -> list[dict[str, object]]:
    answer = http.get(f"/api/rollouts/{rollout_id}/events", params={"type": "model_request"})
    assert answer.status_code == 200, answer.text
    return [event["data"] for event in answer.json()]
