"""How `reins doctor` reads a run's calls back from its private gateway: as stored (packed) and
restored with prompts as arrays, the same calls the JSON read gives."""

from __future__ import annotations

import numpy as np

from reins.doctor.runner import _calls
from tests.conftest import Gateway
from tests.support import growing_calls


def test_the_doctor_reads_packed_calls_across_pages_as_the_json_read_gives_them(
    gateway: Gateway,
) -> None:
    """1,002 calls: the second page's calls are packed against the first page's, so the read
    restores them all together."""
    calls = growing_calls(1002, first=50, response=3, observation=2)
    http = gateway.http
    http.post("/api/rollouts", json=[{"rollout_id": "r"}]).raise_for_status()
    http.post("/api/rollouts/r/attempts").raise_for_status()
    for start in range(0, len(calls), 500):
        posts = [
            {"type": "model_request", "data": data, "idempotency_key": f"call-{start + n}"}
            for n, data in enumerate(calls[start : start + 500])
        ]
        http.post("/api/rollouts/r/attempt/1/events", json=posts).raise_for_status()
    http.post(
        "/api/rollouts/r/attempt/1/events", json={"type": "log", "data": {"line": "x"}}
    ).raise_for_status()

    read = _calls(http, "r")
    assert len(read) == 1002
    assert all(isinstance(call["prompt_token_ids"], np.ndarray) for call in read)
    assert [call["prompt_token_ids"].tolist() for call in read] == [
        call["prompt_token_ids"] for call in calls
    ]
    assert [call["response_token_ids"] for call in read] == [
        call["response_token_ids"] for call in calls
    ]
    assert [call["request"] for call in read] == [call["request"] for call in calls]
