"""`GET /api/admission` right after calls end: the engine is the stub (tests/stub_engine.py), the
calls plain HTTP posts from threads."""

from __future__ import annotations

import threading

import httpx

from tests.conftest import ADMIN_KEY, Gateway
from tests.gateway.test_admission import MESSAGES, until
from tests.stub_engine import StubEngine


def test_this_gateways_replica_entry_agrees_with_its_gate_after_calls_end(
    gateway: Gateway, stub: StubEngine
) -> None:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    gateway.http.post("/api/rollouts/r/attempts")
    url = f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train/openai/v1/chat/completions"
    answers: list[int] = []

    def call() -> None:
        body = {"messages": MESSAGES, "stub_hold": "calls"}
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        answers.append(httpx.post(url, json=body, headers=headers, timeout=30).status_code)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    until(lambda: gateway.http.get("/api/admission").json()["in_flight"], lambda n: n == 3)
    # The pause reports this gateway's gate to the database at once: 3 calls in flight.
    gateway.http.post("/api/admission/pause")
    stub.release("calls")
    for thread in threads:
        thread.join(timeout=30)
    assert answers == [200, 200, 200]
    status = gateway.http.get("/api/admission").json()
    (this,) = [entry for entry in status["replicas"] if entry["this"]]
    assert (status["in_flight"], this["in_flight"]) == (0, 0)
    assert (status["paused"], this["paused"]) == (True, True)
    gateway.http.post("/api/admission/resume")
