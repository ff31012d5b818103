"""The events read's JSON (`GET .../events`, `.../events/packed`), encoded in slices and sent
as them, so that a long rollout's answer does not hold the interpreter lock in one piece."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from pydantic import TypeAdapter

from reins.gateway.routes import events as events_route
from reins.gateway.routes.events import SLICE_TOKENS, PartsResponse, encode_events, event_parts
from reins.schemas import Event, PackedEvent
from tests.conftest import Gateway
from tests.support import growing_calls

NOW = datetime(2026, 12, 6, tzinfo=UTC)


def event(seq: int, data: dict[str, Any]) -> Event:
    return Event(
        seq=seq, rollout_id="r", attempt_id=1, type="t", data=data, idempotency_key=f"k{seq}",
        created_at=NOW,
    )  # fmt: skip


def test_the_slices_make_the_same_json_as_one_call() -> None:
    adapter = TypeAdapter(list[Event])
    big = list(range(SLICE_TOKENS // 3))  # three of these fill a slice
    cases: list[list[Event]] = [
        [],
        [event(1, {"a": 1})],
        [event(i, {"i": i, "text": "é✓\u2028"}) for i in range(2500)],  # slices by count
        [event(i, {"prompt_token_ids": big, "x": [1.5, None]}) for i in range(8)],  # by tokens
        [event(1, {"prompt_token_ids": big * 4})],  # one event past a slice
    ]
    for events in cases:
        assert encode_events(adapter, events) == adapter.dump_json(events)
    packed = [
        PackedEvent(**event(i, {"status": 200}).model_dump(), packed="QUJD" * SLICE_TOKENS)
        for i in range(3)
    ]
    packed_adapter = TypeAdapter(list[PackedEvent])
    assert encode_events(packed_adapter, packed) == packed_adapter.dump_json(packed)


class Counting:
    """An adapter that counts the encoder's calls."""

    def __init__(self) -> None:
        self.adapter = TypeAdapter(list[Event])
        self.sizes: list[int] = []

    def dump_json(self, events: list[Event], **options: Any) -> bytes:
        self.sizes.append(len(events))
        return self.adapter.dump_json(events, **options)


def test_a_long_read_is_encoded_a_slice_at_a_time() -> None:
    big = list(range(SLICE_TOKENS // 3))
    counting = Counting()
    encode_events(counting, [event(i, {"prompt_token_ids": big}) for i in range(8)])  # type: ignore[arg-type]
    assert counting.sizes == [3, 3, 2]
    counting.sizes.clear()
    # A prompt restored as an array (`token_arrays`) weighs the same.
    array = np.arange(SLICE_TOKENS // 3, dtype=np.int32)
    encode_events(counting, [event(i, {"prompt_token_ids": array}) for i in range(8)])  # type: ignore[arg-type]
    assert counting.sizes == [3, 3, 2]
    counting.sizes.clear()
    encode_events(counting, [event(i, {}) for i in range(2500)])  # type: ignore[arg-type]
    assert counting.sizes == [1000, 1000, 500]


def test_the_answer_is_sent_a_part_at_a_time_with_their_length() -> None:
    adapter = TypeAdapter(list[Event])
    big = list(range(SLICE_TOKENS // 3))
    events = [event(i, {"prompt_token_ids": big}) for i in range(8)]
    parts = event_parts(adapter, events)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        raise AssertionError("the answer reads nothing")

    response = PartsResponse(parts)
    asyncio.run(response({"type": "http", "method": "GET"}, receive, send))  # type: ignore[arg-type]
    start, *bodies = sent
    headers = dict(start["headers"])
    whole = adapter.dump_json(events)
    assert headers[b"content-length"] == str(len(whole)).encode()
    assert headers[b"content-type"] == b"application/json"
    assert b"".join(body["body"] for body in bodies) == whole
    # [, 3 slices, 2 commas, ]: no message carries the whole answer
    assert len(bodies) == 7
    assert [body.get("more_body", False) for body in bodies] == [True] * 6 + [False]


def test_the_json_read_restores_prompts_as_arrays_and_writes_them_as_lists(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long rollout's prompts restored as lists are millions of ints, which the garbage
    collector walked (collections of 20-90 ms with every thread held); the read restores them
    as arrays and writes each as a list only while it is encoded: the same JSON."""
    calls = growing_calls(3, first=300, response=20, observation=40)
    http = gateway.http
    http.post("/api/rollouts", json=[{"rollout_id": "r"}]).raise_for_status()
    http.post("/api/rollouts/r/attempts").raise_for_status()
    for n, data in enumerate(calls):
        post = {"type": "model_request", "data": data, "idempotency_key": f"call-{n}"}
        http.post("/api/rollouts/r/attempt/1/events", json=post).raise_for_status()
    encoded: list[type] = []
    encode = events_route.event_parts

    def spied(adapter: TypeAdapter[Any], events: list[Any]) -> list[bytes]:
        encoded.extend(type(e.data["prompt_token_ids"]) for e in events)
        return encode(adapter, events)

    monkeypatch.setattr(events_route, "event_parts", spied)
    read = http.get("/api/rollouts/r/events")
    assert read.status_code == 200, read.text
    assert [e["data"]["prompt_token_ids"] for e in read.json()] == [
        c["prompt_token_ids"] for c in calls
    ]
    assert [e["data"]["response_logprobs"] for e in read.json()] == [[-0.5] * 20] * 3
    assert encoded == [np.ndarray] * 3
