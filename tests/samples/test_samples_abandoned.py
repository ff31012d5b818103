"""Abandoned calls (issue #13, 3): a call whose harness hung up or timed out is never trained on,
and its retry, the answer the harness went on with, is kept, whichever of the two finished last.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from reins.gateway.capture import CallFacts, abandoned_records
from reins.samples import build_batch, rollout_from_events
from reins.schemas import Event, ModelRequest

PROMPT = [1, 2, 3]


def _event(seq: int, type_: str, data: dict[str, Any]) -> Event:
    return Event(
        seq=seq,
        rollout_id="r-1",
        attempt_id=1,
        type=type_,
        data=data,
        idempotency_key=f"k-{seq}",
        created_at=datetime.now(UTC),
    )


def _call(response: list[int], **extra: Any) -> dict[str, Any]:
    return {"prompt_token_ids": PROMPT, "response_token_ids": response, **extra}


def test_an_abandoned_call_is_excluded_and_its_retry_kept_even_when_it_finished_last() -> None:
    # The retry (seq 2) finished before the abandoned call (seq 3) was recorded: dedup keeps the
    # last of identical prompts, so without the exclusion the abandoned answer would be trained.
    events = [
        _event(2, "model_request", _call([7, 8])),
        _event(3, "model_request", _call([4, 5, 6], status=200, abandoned=True)),
        _event(4, "reward", {"value": 1.0}),
    ]
    record = rollout_from_events(events)
    assert [c.seq for c in record.calls] == [2]
    assert (record.skipped_calls, record.abandoned_calls) == (1, 1)
    batch = build_batch([record])
    assert [s.call_seqs for s in batch.sequences] == [(2,)]
    assert batch.sequences[0].token_ids.tolist() == [*PROMPT, 7, 8]


def test_an_abandoned_stream_with_partial_tokens_is_excluded() -> None:
    events = [
        _event(1, "model_request", _call([4, 5], status=499, abandoned=True)),
        _event(2, "model_request", _call([7, 8, 9])),
        _event(3, "reward", {"value": 0.5}),
    ]
    record = rollout_from_events(events)
    assert [(c.seq, c.response.tolist()) for c in record.calls] == [(2, [7, 8, 9])]
    assert record.abandoned_calls == 1


def test_a_failed_call_is_skipped_but_not_counted_abandoned() -> None:
    events = [
        _event(1, "model_request", _call([], status=502, error="the engine could not be reached")),
        _event(2, "model_request", _call([7])),
        _event(3, "reward", {"value": 0.0}),
    ]
    record = rollout_from_events(events)
    assert (len(record.calls), record.skipped_calls, record.abandoned_calls) == (1, 1, 0)


def _facts(latency_s: float) -> CallFacts:
    return CallFacts(
        kind="chat",
        mode="train",
        request={"messages": [{"role": "user", "content": "hi"}]},
        model="policy",
        endpoint="http://127.0.0.1:1/v1",
        model_version=3,
        latency_s=latency_s,
        stream=True,
    )


def test_abandoned_records_keep_what_was_streamed_and_say_why() -> None:
    partial = ModelRequest.model_construct(
        prompt_token_ids=PROMPT,
        response_token_ids=[4, 5],
        response_logprobs=[-0.1, -0.2],
        status=200,
        finish_reason=None,
        error=None,
    )
    (record,) = abandoned_records(_facts(3.25), [partial])
    assert (record.status, record.abandoned) == (499, True)
    assert (record.prompt_token_ids, record.response_token_ids) == (PROMPT, [4, 5])
    assert record.error is not None and "hung up after 3.25 s" in record.error
    assert partial.status == 200 and not partial.abandoned  # a copy: the partial is unchanged


def test_a_call_abandoned_before_any_answer_is_one_record_without_tokens() -> None:
    (record,) = abandoned_records(_facts(0.5), [])
    data = record.model_dump()
    assert (data["status"], data["abandoned"], data["response_token_ids"]) == (499, True, [])
    assert (data["model"], data["model_version"], data["stream"]) == ("policy", 3, True)
