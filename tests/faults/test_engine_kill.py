"""SIGKILL of the inference engine mid-call: calls in flight fail as recorded errors, and the
harness's own retry succeeds once the engine is back.

Real: the `reins gateway` process (SQLite), the `openai` SDK as the harness (its default retry
policy on 5xx, `max_retries` raised). STUBBED: the engine's model (tests/stub_engine.py, in its
own process so it can be SIGKILLed; each call waits `stub_delay_s` so calls are in flight).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.faults.conftest import (
    StubProcess,
    admin,
    model_requests,
    open_rollouts,
    proxy_url,
    wait_until,
)
from tests.stub_engine import DEFAULT_REPLY
from tests.support import GatewayProcess

pytestmark = pytest.mark.slow

HARNESSES = 4
DELAY_S = 2.0
"""How long each call waits at the engine: ample for the kill to land while all are in flight,
even on a loaded machine."""


@pytest.fixture
def stub_process() -> Iterator[StubProcess]:
    """An engine of this test's own: it is killed."""
    engine = StubProcess()
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def test_calls_in_flight_when_the_engine_dies_are_recorded_and_the_retry_succeeds(
    sqlite_gateway: GatewayProcess, stub_process: StubProcess
) -> None:
    http = admin(sqlite_gateway.url)
    http.post("/api/models", json={"model": "policy", "endpoint": stub_process.base_url})
    ids = [f"engine-kill-{i}" for i in range(HARNESSES)]
    tokens = open_rollouts(http, ids)

    def harness(rollout_id: str) -> str | None:
        client = openai.OpenAI(
            base_url=proxy_url(sqlite_gateway.url, rollout_id),
            api_key=tokens[rollout_id],
            max_retries=8,
            timeout=60,
        )
        answer = client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": f"call of {rollout_id}"}],
            extra_body={"stub_delay_s": DELAY_S},
        )
        return answer.choices[0].message.content

    with ThreadPoolExecutor(HARNESSES) as pool:
        answers = [pool.submit(harness, rid) for rid in ids]
        wait_until(lambda: stub_process.received() >= HARNESSES, "every call reaching the engine")
        stub_process.kill()  # every call is in flight at the engine (each waits DELAY_S there)

        def every_call_failed() -> bool:
            return all(
                any(call["status"] == 502 for call in model_requests(http, rid)) for rid in ids
            )

        wait_until(every_call_failed, "the calls in flight being recorded as failed")
        assert not any(answer.done() for answer in answers), "the harness must be retrying"
        restarted = time.monotonic()
        stub_process.start()
        replies = [answer.result(timeout=90) for answer in answers]
        served_s = time.monotonic() - restarted

    assert replies == [DEFAULT_REPLY] * HARNESSES
    failures = 0
    for rid in ids:
        calls = model_requests(http, rid)
        failed, served = calls[:-1], calls[-1]
        assert failed and all(call["status"] == 502 for call in failed), calls
        assert all("could not be reached" in str(call["error"]) for call in failed), failed
        assert served["status"] == 200 and served["error"] is None, served
        assert served["response_token_ids"] == list(DEFAULT_REPLY.encode())
        failures += len(failed)
    print(
        f"engine SIGKILL: {HARNESSES} calls in flight, {failures} failed calls recorded (502), "
        f"every harness retry answered {served_s:.1f} s after the engine restart began"
    )
