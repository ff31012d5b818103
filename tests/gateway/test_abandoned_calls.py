"""A harness that hangs up or times out before its answer (issue #13, 3): the proxy stops the call
(closing its engine connection, so the engine cancels it) and records it as `abandoned`, with
status 499 and what was streamed so far, instead of a 200 with an answer nobody received.

The engine is the stub here (tests/stub_engine.py); the real engine's cancellation is tested in
tests/harness/test_abandoned_calls.py. A call still in flight when its rollout ends is refused
(409 in the API's shape) and not appended after the trainer may have read the rollout."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import asyncpg
import httpx
import pytest

from tests.conftest import Gateway
from tests.stub_engine import StubEngine, encode

MESSAGES = [{"role": "user", "content": "hi"}]
LONG_REPLY = "abcdefghij" * 40
"""400 stub tokens, sent 4 per chunk: 100 chunks."""


@pytest.fixture
def token(gateway: Gateway, stub: StubEngine) -> str:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    return str(gateway.http.post("/api/rollouts/r/attempts").json()["token"])


def url(gateway: Gateway, path: str = "openai/v1/chat/completions") -> str:
    return f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train/{path}"


def recorded_calls(gateway: Gateway, count: int, within_s: float = 20.0) -> list[dict[str, Any]]:
    """The rollout's `model_request` data once there are `count` of them (polled)."""
    deadline = time.monotonic() + within_s
    while True:
        response = gateway.http.get("/api/rollouts/r/events", params={"type": "model_request"})
        assert response.status_code == 200, response.text
        calls = [event["data"] for event in response.json()]
        if len(calls) >= count or time.monotonic() > deadline:
            return calls
        time.sleep(0.05)


def test_a_non_streamed_call_the_client_timed_out_is_recorded_abandoned(
    gateway: Gateway, token: str
) -> None:
    body = {"messages": MESSAGES, "stub_delay_s": 4}
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url(gateway), json=body, headers={"Authorization": f"Bearer {token}"}, timeout=0.5
        )
    (call,) = recorded_calls(gateway, 1)
    recorded_after = time.monotonic() - started
    assert (call["status"], call["abandoned"]) == (499, True), call
    assert call["response_token_ids"] == [] and call["response"] == {}
    assert "hung up" in call["error"]
    # From when the gateway took the call to the hang-up: under the client's 0.5 s when the
    # gateway started late (a CI run on a loaded machine recorded 0.003 s), never the engine's 4 s.
    assert 0 < call["latency_s"] < min(2.0, recorded_after)
    # Recorded when the client left, not when the engine would have answered (4 s).
    assert recorded_after < 3.0
    assert call["model"] == "policy" and call["stream"] is False


def test_a_stream_the_client_closed_is_recorded_abandoned_with_what_it_was_sent(
    gateway: Gateway, token: str, stub: StubEngine
) -> None:
    body = {
        "messages": MESSAGES,
        "stream": True,
        "stub_reply": LONG_REPLY,
        "stub_chunk_delay_s": 0.2,
    }
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.stream("POST", url(gateway), json=body, headers=headers, timeout=30) as response:
        assert response.status_code == 200
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data:")
            if chunks == 2:
                break  # the client hangs up after two chunks
    (call,) = recorded_calls(gateway, 1)
    assert (call["status"], call["abandoned"], call["stream"]) == (499, True, True), call
    sent = call["response_token_ids"]
    # What the proxy had relayed when the client left: a prefix of the reply, far from all of it.
    assert 4 <= len(sent) < len(encode(LONG_REPLY)) // 2
    assert sent == encode(LONG_REPLY)[: len(sent)]
    assert call["finish_reason"] is None


def test_a_finished_call_is_not_abandoned(gateway: Gateway, token: str) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    response = httpx.post(url(gateway), json={"messages": MESSAGES}, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    (call,) = recorded_calls(gateway, 1)
    assert (call["status"], call["abandoned"]) == (200, False)


@contextlib.contextmanager
def event_writes_held(database_url: str) -> Iterator[None]:
    """The gateway's event inserts wait meanwhile: SQLite's write lock, or PostgreSQL's `events`
    table locked against writes (reads go on), taken from this process."""
    if database_url.startswith("sqlite"):
        db = sqlite3.connect(database_url.split(":///", 1)[1], timeout=30, isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            db.execute("ROLLBACK")
            db.close()
        return
    locked, release = threading.Event(), threading.Event()

    async def hold() -> None:
        conn = await asyncpg.connect(database_url.replace("+asyncpg", ""))
        try:
            async with conn.transaction():
                await conn.execute("LOCK TABLE events IN EXCLUSIVE MODE")
                locked.set()
                await asyncio.to_thread(release.wait)
        finally:
            await conn.close()

    holder = threading.Thread(target=asyncio.run, args=(hold(),))
    holder.start()
    try:
        assert locked.wait(30), "the events table was not locked"
        yield
    finally:
        release.set()
        holder.join()


def test_a_call_whose_client_left_while_its_record_was_written_is_recorded_once(
    gateway: Gateway, token: str, database_url: str
) -> None:
    """A call waits for its record's commit before its answer (on PostgreSQL always; on SQLite
    the attempt's first call, which the call journal cannot take yet). Its client timing out
    meanwhile cancelled the wait, not the write: the call was recorded twice, its answer and
    once more as abandoned. A call whose record is being written is a recorded call, as a
    stream's is."""
    headers = {"Authorization": f"Bearer {token}"}
    with event_writes_held(database_url), pytest.raises(httpx.ReadTimeout):
        httpx.post(url(gateway), json={"messages": MESSAGES}, headers=headers, timeout=1.0)
    calls = recorded_calls(gateway, 2, within_s=3.0)  # the second (the bug's) lands within it
    assert [(call["status"], call["abandoned"]) for call in calls] == [(200, False)]


# -- calls in flight when the rollout ends ------------------------------------------------------


def wait_for_engine_request(stub: StubEngine, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not stub.requests:
        assert time.monotonic() < deadline, "the call never reached the engine"
        time.sleep(0.01)


def test_a_call_in_flight_when_the_rollout_succeeds_is_409_and_not_appended(
    gateway: Gateway, token: str, stub: StubEngine
) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    body = {"messages": MESSAGES, "stub_hold": "close"}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, url(gateway), json=body, headers=headers, timeout=30)
        wait_for_engine_request(stub)
        closed = gateway.http.patch("/api/rollouts/r", json={"status": {"state": "succeeded"}})
        assert closed.status_code == 200, closed.text
        stub.release("close")
        response = answer.result()
    assert response.status_code == 409, response.text
    assert "rollout r is succeeded" in response.json()["error"]["message"]
    assert recorded_calls(gateway, 1, within_s=0.5) == []


def test_a_stream_in_flight_when_the_rollout_succeeds_ends_with_an_error_not_a_record(
    gateway: Gateway, token: str, stub: StubEngine
) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    body = {"messages": MESSAGES, "stream": True, "stub_chunk_delay_s": 0.05}
    with httpx.stream("POST", url(gateway), json=body, headers=headers, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert "choices" in first
        closed = gateway.http.patch("/api/rollouts/r", json={"status": {"state": "succeeded"}})
        assert closed.status_code == 200, closed.text
        rest = [line for line in lines if line.startswith("data:")]
    assert "data: [DONE]" not in rest
    assert "rollout r is succeeded" in rest[-1] and '"code": 409' in rest[-1]
    assert recorded_calls(gateway, 1, within_s=0.5) == []
