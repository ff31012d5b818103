"""`GET /metrics` on a real gateway: proxy calls through the stub engine (the model is stubbed),
latency, the admission gate's held calls, rollouts by status."""

from __future__ import annotations

import re
import threading
import time

import httpx

from tests.conftest import Gateway
from tests.monitor.factory import many_rollouts, proxy_url
from tests.stub_engine import StubEngine


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent); label order does not matter."""
    for line in text.splitlines():
        found = re.fullmatch(r"([a-z_]+)(?:\{(.*)\})? (\S+)", line)
        if found is None or found.group(1) != name:
            continue
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', found.group(2) or ""))
        if pairs == labels:
            return float(found.group(3))
    return 0.0


def scrape(gateway: Gateway) -> str:
    response = gateway.http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def test_calls_tokens_and_latency_are_counted(gateway: Gateway, stub: StubEngine) -> None:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    gateway.http.post("/api/rollouts/r/attempts")
    url = proxy_url(gateway, "r") + "/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    for body in ({"messages": messages}, {"messages": messages, "stream": True}):
        assert gateway.http.post(url, json=body).status_code == 200
    assert (
        gateway.http.post(url, json={"messages": messages, "stub_status": 400}).status_code == 400
    )
    text = scrape(gateway)
    assert sample(text, "reins_proxy_calls_total", kind="chat", mode="train", status="200") == 2
    assert sample(text, "reins_proxy_calls_total", kind="chat", mode="train", status="400") == 1
    assert sample(text, "reins_proxy_call_latency_seconds_count", kind="chat", mode="train") == 3
    assert sample(text, "reins_proxy_call_latency_seconds_sum", kind="chat", mode="train") > 0
    assert sample(text, "reins_proxy_response_tokens_total", mode="train") == 2 * 20
    assert sample(text, "reins_proxy_prompt_tokens_total", mode="train") > 0
    assert sample(text, "reins_proxy_in_flight") == 0


def test_rollouts_are_counted_by_state_and_mode(gateway: Gateway) -> None:
    many_rollouts(gateway, 10, run="m")
    text = scrape(gateway)
    assert sample(text, "reins_rollouts", state="succeeded", mode="train") == 8
    assert sample(text, "reins_rollouts", state="failed", mode="train") == 1
    assert sample(text, "reins_rollouts", state="succeeded", mode="val") == 1
    assert 'reins_rollouts{mode="val",state="queuing"} 0.0' in text  # every pair, 0 too


def test_held_calls_show_while_the_gate_is_paused(gateway: Gateway, stub: StubEngine) -> None:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    gateway.http.post("/api/rollouts/r/attempts")
    gateway.http.post("/api/admission/pause")
    url = proxy_url(gateway, "r") + "/chat/completions"
    headers = {"Authorization": f"Bearer {gateway.api_key}"}
    results: list[int] = []
    call = threading.Thread(
        target=lambda: results.append(
            httpx.post(url, headers=headers, json={"messages": []}, timeout=60).status_code
        )
    )
    call.start()
    deadline = time.monotonic() + 30
    while sample(text := scrape(gateway), "reins_admission_held") != 1:
        assert time.monotonic() < deadline, "the call never showed as held"
        time.sleep(0.05)
    assert sample(text, "reins_admission_paused") == 1
    assert sample(text, "reins_admission_pauses_total") == 1
    gateway.http.post("/api/admission/resume")
    call.join(timeout=30)
    assert results == [200]
    after = scrape(gateway)
    assert sample(after, "reins_admission_held") == 0
    assert sample(after, "reins_admission_paused") == 0
