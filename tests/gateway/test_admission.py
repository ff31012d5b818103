"""The admission gate: pause holds new calls, drain waits for calls in flight, resume releases.

The engine is the stub (tests/stub_engine.py); the harness is the real `openai` SDK.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest

from reins.client import GatewayClient
from reins.gateway import GatewaySettings
from tests.conftest import ADMIN_KEY, Gateway, serve
from tests.stub_engine import DEFAULT_REPLY, StubEngine

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def base_url(gateway: Gateway, stub: StubEngine) -> str:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    gateway.http.post("/api/rollouts/r/attempts")
    return f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train/openai/v1"


T = TypeVar("T")


def until(
    read: Callable[[], T],
    done: Callable[[T], object],
    what: str = "condition",
    timeout_s: float = 10,
) -> T:
    """Polls `read()` until `done(value)`; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"{what}: still {value!r} after {timeout_s} s"
        time.sleep(0.02)


def stub_calls(gateway: Gateway) -> int:
    """The calls of rollout r the proxy has recorded (each after the engine answered)."""
    events = gateway.http.get("/api/rollouts/r/events", params={"type": "model_request"})
    return len(events.json())


def in_thread(target: object) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = target()  # type: ignore[operator]
        except Exception as error:
            out["error"] = error
        out["done_at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_openai_client_with_default_timeout_rides_through_a_pause(
    gateway: Gateway, base_url: str
) -> None:
    token = gateway.http.get("/api/rollouts/r").json()["attempts"][0]["token"]
    client = openai.OpenAI(base_url=base_url, api_key=token)
    gateway.http.post("/api/admission/pause")
    thread, out = in_thread(
        lambda: client.chat.completions.create(model="policy", messages=MESSAGES)  # type: ignore[arg-type]
    )
    status = until(lambda: gateway.http.get("/api/admission").json(), lambda s: s["held"] == 1)
    assert status["paused"] is True
    assert thread.is_alive(), "a call must wait while the gateway is paused"
    assert "done_at" not in out
    assert stub_calls(gateway) == 0, "a held call must not reach the engine"
    resumed_at = time.monotonic()
    gateway.http.post("/api/admission/resume")
    thread.join(timeout=30)
    assert "error" not in out, out.get("error")
    completion = out["value"]
    assert completion.choices[0].message.content == DEFAULT_REPLY  # type: ignore[attr-defined]
    assert float(out["done_at"]) >= resumed_at  # type: ignore[arg-type]


def test_drain_returns_once_calls_in_flight_finish(gateway: Gateway, base_url: str) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    thread, out = in_thread(
        lambda: httpx.post(
            f"{base_url}/chat/completions",
            json={"messages": MESSAGES, "stub_delay_s": 1.0},
            headers=admin,
            timeout=30,
        )
    )
    until(lambda: gateway.http.get("/api/admission").json()["in_flight"], bool)
    gateway.http.post("/api/admission/pause")
    drained = gateway.http.post("/api/admission/drain", params={"timeout_s": 30}).json()
    assert drained["drained"] is True
    assert drained["in_flight"] == 0
    # The call in flight (held 1 s by the engine) had finished and was recorded when drain
    # answered; a drain that returned early would find it missing.
    assert stub_calls(gateway) == 1
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert out["value"].status_code == 200  # type: ignore[attr-defined]
    gateway.http.post("/api/admission/resume")


def test_drain_reports_a_timeout(gateway: Gateway, base_url: str, stub: StubEngine) -> None:
    thread, out = in_thread(
        lambda: httpx.post(
            f"{base_url}/chat/completions",
            json={"messages": MESSAGES, "stub_hold": "drain"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=30,
        )
    )
    until(lambda: gateway.http.get("/api/admission").json()["in_flight"], bool)
    drained = gateway.http.post("/api/admission/drain", params={"timeout_s": 0.2}).json()
    assert drained["drained"] is False
    assert drained["in_flight"] == 1
    assert stub_calls(gateway) == 0, "drain answered before the call in flight finished"
    stub.release("drain")
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert out["value"].status_code == 200  # type: ignore[attr-defined]


def test_the_clients_drain_waits_past_its_own_timeout(
    gateway: Gateway, base_url: str, stub: StubEngine
) -> None:
    """The trainer drains through `GatewayClient.request` with a `timeout_s` of 300 s, its
    client's timeout 30 s: a drain held by a call longer than that was cut off, retried for
    two minutes, then failed as "cannot reach the gateway" rather than `drained: false`."""
    thread, _ = in_thread(
        lambda: httpx.post(
            f"{base_url}/chat/completions",
            json={"messages": MESSAGES, "stub_hold": "long"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=30,
        )
    )
    until(lambda: gateway.http.get("/api/admission").json()["in_flight"], bool)

    async def drain() -> Any:
        async with GatewayClient(gateway.url, ADMIN_KEY, timeout_s=0.3, retry_for_s=1) as client:
            return await client.request("POST", "/api/admission/drain", params={"timeout_s": 1.5})

    try:
        drained = asyncio.run(drain())
    finally:
        stub.release("long")
        thread.join(timeout=30)
    assert drained["drained"] is False and drained["in_flight"] == 1


def test_a_stream_counts_as_in_flight_until_its_end(gateway: Gateway, base_url: str) -> None:
    with httpx.stream(
        "POST",
        f"{base_url}/chat/completions",
        json={"messages": MESSAGES, "stream": True, "stub_chunk_delay_s": 0.1},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    ) as response:
        lines = response.iter_lines()
        next(lines)
        assert gateway.http.get("/api/admission").json()["in_flight"] == 1
        for _ in lines:
            pass
    until(
        lambda: gateway.http.get("/api/admission").json()["in_flight"],
        lambda n: n == 0,
        "the stream's admission slot was not released",
    )


def test_a_call_held_past_the_bound_gets_503_with_retry_after(
    tmp_path: Path, stub: StubEngine
) -> None:
    settings = GatewaySettings(
        database_url=str(tmp_path / "g.db"), api_key=ADMIN_KEY, admission_max_wait_s=0.5
    )
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with serve(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        httpx.post(
            f"{url}/api/models", json={"model": "p", "endpoint": stub.base_url}, headers=admin
        )
        httpx.post(f"{url}/api/rollouts", json=[{"rollout_id": "r"}], headers=admin)
        httpx.post(f"{url}/api/admission/pause", headers=admin)
        response = httpx.post(
            f"{url}/proxy/rollout/r/attempt/1/mode/train/openai/v1/chat/completions",
            json={"messages": MESSAGES},
            headers=admin,
        )
    assert response.status_code == 503
    assert response.headers["retry-after"] == "30"
    assert "paused" in response.json()["error"]["message"]


def test_admission_controls_need_the_admin_key(gateway: Gateway, base_url: str) -> None:
    token = gateway.http.get("/api/rollouts/r").json()["attempts"][0]["token"]
    response = httpx.post(
        f"{gateway.url}/api/admission/pause", headers={"Authorization": f"Bearer {token}"}
    )
    assert response.status_code == 403
