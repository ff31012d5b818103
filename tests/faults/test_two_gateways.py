"""Two `reins gateway` processes on one SQLite file under load (a tested configuration,
docs/gateway.md): harness threads call through either gateway at random, streamed and not; a
trainer thread completes or retries rollouts through either one and reads each closed attempt's
calls right after the close. Every call answered 200 is stored once, in its attempt, and nothing
is stored into an attempt after that read. Stubbed: the engine (tests/stub_engine.py, its own
process). On session 42's tree 27 answered calls were not stored here (answered from one
gateway's journal, then refused at their commit after the other's close); its 40 s probe also
stored one call after a close.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.faults.conftest import ADMIN_KEY, StubProcess, admin
from tests.support import GatewayProcess, free_port

pytestmark = pytest.mark.slow

HARNESSES = 4
DURATION_S = 12.0


@pytest.fixture
def two_gateways(tmp_path: Path) -> Iterator[list[GatewayProcess]]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    gateways: list[GatewayProcess] = []
    try:
        for _ in range(2):
            gateway = GatewayProcess(database_url=url, api_key=ADMIN_KEY, port=free_port())
            gateway.start()
            gateways.append(gateway)
        yield gateways
    finally:
        for gateway in gateways:
            gateway.stop()


def _tag_of(event: dict[str, object]) -> str:
    data = event["data"]
    assert isinstance(data, dict)
    return str(data["request"]["messages"][0]["content"])


def _calls(http: httpx.Client, rollout_id: str, attempt_id: int | None = None) -> list[str]:
    params: dict[str, object] = {"type": "model_request", "limit": 10_000}
    params.update({"attempt_id": attempt_id} if attempt_id else {"all_attempts": "true"})
    answer = http.get(f"/api/rollouts/{rollout_id}/events", params=params)
    assert answer.status_code == 200, answer.text
    return [f"{event['attempt_id']}:{_tag_of(event)}" for event in answer.json()]


def test_two_gateways_on_one_sqlite_file_store_every_answered_call_and_none_after_a_close(
    two_gateways: list[GatewayProcess], stub_process: StubProcess
) -> None:
    urls = [gateway.url for gateway in two_gateways]
    lock = threading.Lock()
    current: dict[int, tuple[str, int, str]] = {}  # harness -> (rollout, attempt, token)
    answered: dict[str, tuple[str, int]] = {}  # the call's text -> (rollout, attempt)
    failures: list[str] = []
    read_after_close: dict[tuple[str, int], list[str]] = {}
    with admin(urls[0]) as http:
        http.post("/api/models", json={"model": "policy", "endpoint": stub_process.base_url})
        for n in range(HARNESSES):
            http.post("/api/rollouts", json=[{"rollout_id": f"h{n}-0"}]).raise_for_status()
            opened = http.post(f"/api/rollouts/h{n}-0/attempts").json()
            current[n] = (f"h{n}-0", 1, opened["token"])
    stop_at = time.monotonic() + DURATION_S

    def harness(n: int) -> None:
        draw = random.Random(n)
        with httpx.Client(timeout=60) as client:
            for count in range(10**9):
                if time.monotonic() > stop_at:
                    return
                with lock:
                    rollout_id, attempt_id, token = current[n]
                text = f"{rollout_id}/{attempt_id}/{count}"
                url = (
                    f"{draw.choice(urls)}/proxy/rollout/{rollout_id}/attempt/{attempt_id}"
                    "/mode/train/openai/v1/chat/completions"
                )
                body = {"messages": [{"role": "user", "content": text}], "stub_reply": text}
                headers = {"Authorization": f"Bearer {token}"}
                if draw.random() < 0.4:
                    with client.stream(
                        "POST", url, json={**body, "stream": True}, headers=headers
                    ) as answer:
                        lines = list(answer.iter_lines())
                    whole = answer.status_code == 200 and "data: [DONE]" in lines
                    errors = [line for line in lines if line.startswith('data: {"error"')]
                    status = 200 if whole and not errors else answer.status_code
                    if errors:  # the call's attempt closed as it ran (409), or worse
                        status = 409 if all('"code": 409' in line for line in errors) else 500
                else:
                    status = client.post(url, json=body, headers=headers).status_code
                with lock:
                    if status == 200:
                        answered[text] = (rollout_id, attempt_id)
                    elif status != 409:
                        failures.append(f"{text}: {status}")

    def trainer() -> None:
        draw = random.Random(99)
        generation: Counter[int] = Counter()
        clients = [admin(url) for url in urls]
        try:
            while time.monotonic() < stop_at:
                time.sleep(draw.uniform(0.2, 0.6))  # pacing only: nothing waits on it
                n = draw.randrange(HARNESSES)
                http = draw.choice(clients)
                with lock:
                    rollout_id, attempt_id, _ = current[n]
                if draw.random() < 0.5:
                    opened = http.post(f"/api/rollouts/{rollout_id}/attempts")
                    assert opened.status_code == 200, opened.text
                    read = _calls(http, rollout_id, attempt_id)
                    new = (rollout_id, opened.json()["attempt_id"], opened.json()["token"])
                else:
                    done = http.patch(
                        f"/api/rollouts/{rollout_id}", json={"status": {"state": "succeeded"}}
                    )
                    assert done.status_code == 200, done.text
                    read = _calls(http, rollout_id, attempt_id)
                    generation[n] += 1
                    fresh = f"h{n}-{generation[n]}"
                    http.post("/api/rollouts", json=[{"rollout_id": fresh}]).raise_for_status()
                    new = (fresh, 1, http.post(f"/api/rollouts/{fresh}/attempts").json()["token"])
                with lock:
                    read_after_close[(rollout_id, attempt_id)] = read
                    current[n] = new
        finally:
            for client in clients:
                client.close()

    threads = [threading.Thread(target=harness, args=(n,)) for n in range(HARNESSES)]
    threads.append(threading.Thread(target=trainer))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=DURATION_S + 120)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []
    assert len(answered) > 100 and len(read_after_close) > 5
    with admin(urls[1]) as http:
        stored: Counter[str] = Counter()
        rollouts = {rollout_id for rollout_id, _ in answered.values()}
        rollouts |= {rollout_id for rollout_id, _ in read_after_close}
        for rollout_id in rollouts:
            stored.update(_calls(http, rollout_id))
        closed_now = {key: _calls(http, key[0], key[1]) for key in read_after_close}
    expected = Counter(f"{attempt}:{text}" for text, (_, attempt) in answered.items())
    assert [call for call in expected if stored[call] != 1] == [], "answered, not stored once"
    late = {key: sorted(set(now) - set(read_after_close[key])) for key, now in closed_now.items()}
    assert {key: calls for key, calls in late.items() if calls} == {}, "stored after the close"
