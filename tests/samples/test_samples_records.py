"""rollout_from_events: gateway events of one attempt -> RolloutRecord."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest

from reins.samples import Call, MissingRewardError, rollout_from_events
from reins.samples.records import token_ids
from reins.schemas import Event


def _event(
    seq: int, type_: str, data: dict[str, Any], *, attempt: int = 1, rid: str = "r-1"
) -> Event:
    return Event(
        seq=seq,
        rollout_id=rid,
        attempt_id=attempt,
        type=type_,
        data=data,
        idempotency_key=f"k-{seq}",
        created_at=datetime.now(UTC),
    )


def _request(prompt: list[int], response: list[int], **extra: Any) -> dict[str, Any]:
    return {"prompt_token_ids": prompt, "response_token_ids": response, **extra}


def test_calls_keep_tokens_logprobs_seq_and_weight_version() -> None:
    events = [
        _event(
            3,
            "model_request",
            _request([1, 2], [3, 4], response_logprobs=[-0.1, -0.2], model_version=7),
        ),
        _event(5, "reward", {"value": 1.0}),
    ]
    rec = rollout_from_events(events, group_id="g")
    (c,) = rec.calls
    assert c.prompt.tolist() == [1, 2] and c.response.tolist() == [3, 4]
    assert c.prompt.dtype == np.int32
    assert c.logprobs is not None and c.logprobs.tolist() == pytest.approx([-0.1, -0.2])
    assert (c.seq, c.model_version) == (3, 7)
    assert (rec.rollout_id, rec.group_id, rec.attempt_id, rec.reward) == ("r-1", "g", 1, 1.0)


def test_failed_and_empty_calls_are_skipped_and_counted() -> None:
    events = [
        _event(1, "model_request", _request([1], [2], status=500)),
        _event(2, "model_request", _request([1], [])),
        _event(3, "model_request", _request([], [2])),
        _event(4, "model_request", _request([1], [2])),
        _event(5, "reward", {"value": 0.0}),
    ]
    rec = rollout_from_events(events)
    assert [c.seq for c in rec.calls] == [4]
    assert rec.skipped_calls == 3


def test_reward_is_the_last_reward_event() -> None:
    events = [
        _event(9, "reward", {"value": 0.25}),
        _event(2, "reward", {"value": 1.0}),
        _event(4, "model_request", _request([1], [2])),
    ]
    assert rollout_from_events(events).reward == 0.25


def test_the_agents_metrics_come_from_the_last_reward_and_only_numbers_count() -> None:
    events = [
        _event(2, "reward", {"value": 1.0, "metrics": {"searches": 5}}),
        _event(4, "model_request", _request([1], [2])),
        _event(
            9,
            "reward",
            {
                "value": 0.0,
                "metrics": {"searches": 2, "answered": 0, "ok": True, "note": "x", "bad": None},
            },
        ),
    ]
    assert rollout_from_events(events).metrics == {"searches": 2.0, "answered": 0.0}
    odd = [_event(1, "reward", {"value": 1.0, "metrics": "many"})]
    assert rollout_from_events(odd).metrics == {}


def test_missing_reward_is_an_error_by_default() -> None:
    events = [_event(1, "model_request", _request([1], [2]))]
    with pytest.raises(MissingRewardError, match="r-1 attempt 1 has no reward"):
        rollout_from_events(events)


def test_missing_reward_can_be_filled() -> None:
    events = [_event(1, "model_request", _request([1], [2]))]
    assert rollout_from_events(events, missing_reward=0.0).reward == 0.0


def test_only_the_chosen_attempt_is_read_and_the_latest_by_default() -> None:
    events = [
        _event(1, "model_request", _request([1], [2]), attempt=1),
        _event(2, "reward", {"value": 0.0}, attempt=1),
        _event(3, "model_request", _request([5], [6]), attempt=2),
        _event(4, "reward", {"value": 1.0}, attempt=2),
    ]
    latest = rollout_from_events(events)
    assert (latest.attempt_id, latest.reward, [c.seq for c in latest.calls]) == (2, 1.0, [3])
    first = rollout_from_events(events, attempt_id=1)
    assert (first.attempt_id, first.reward, [c.seq for c in first.calls]) == (1, 0.0, [1])


def test_calls_are_ordered_by_event_seq() -> None:
    events = [
        _event(8, "model_request", _request([3], [4])),
        _event(2, "model_request", _request([1], [2])),
        _event(9, "reward", {"value": 0.0}),
    ]
    assert [c.seq for c in rollout_from_events(events).calls] == [2, 8]


def test_missing_logprobs_stay_none() -> None:
    events = [_event(1, "model_request", _request([1], [2])), _event(2, "reward", {"value": 0})]
    assert rollout_from_events(events).calls[0].logprobs is None


def test_logprob_count_must_match_response_tokens() -> None:
    with pytest.raises(ValueError, match="1 logprobs for 2 response tokens"):
        Call(prompt=np.array([1]), response=np.array([2, 3]), logprobs=np.array([-1.0]))


def test_events_of_another_rollout_are_refused() -> None:
    events = [
        _event(1, "reward", {"value": 0}, rid="r-1"),
        _event(2, "reward", {"value": 0}, rid="r-2"),
    ]
    with pytest.raises(ValueError, match="r-2"):
        rollout_from_events(events, rollout_id="r-1")


@pytest.mark.parametrize(
    "data",
    [
        {"value": "high"},
        {"score": 1},
        {"value": None},
        {"value": [1]},
        {"value": float("nan")},
        {"value": -1e13},
    ],
)
def test_a_reward_that_does_not_parse_is_a_missing_reward(data: dict[str, Any]) -> None:
    # Rows stored before the gateway checked rewards: never an error of the whole read.
    events = [_event(1, "model_request", _request([1], [2])), _event(2, "reward", data)]
    with pytest.raises(MissingRewardError, match="r-1 attempt 1 has a reward event that does not"):
        rollout_from_events(events)
    assert rollout_from_events(events, missing_reward=-1.0).reward == -1.0


def test_token_ids_take_an_int32_array_as_it_is_and_refuse_other_arrays() -> None:
    """Prompts restored as arrays (`reins.packed.unpack(token_arrays=True)`, the rollout page)."""
    ids = np.array([0, 7, 2**31 - 1], dtype=np.int32)
    assert token_ids(ids) is ids
    assert token_ids(np.zeros(0, dtype=np.int32)) is not None
    for refused in (
        np.array([3, -1], dtype=np.int32),
        np.array([3, 4], dtype=np.int64),
        np.array([[3, 4]], dtype=np.int32),
        np.array([3.0, 4.0]),
    ):
        assert token_ids(refused) is None, refused


@pytest.mark.parametrize(
    ("ids", "says"),
    [
        (np.array([2**32 + 7]), "must be from 0 to 2\\*\\*31 - 1, got 4294967303"),
        (np.array([1.9, 3.0]), "must be integers, got float64"),
        ([-1, 2], "must be from 0 to 2\\*\\*31 - 1, got -1"),
        ([True, False], "must be integers, got bool"),
        ([2**70], "must be integers, got object"),
    ],
)
def test_a_call_refuses_token_ids_a_cast_would_change(ids: Any, says: str) -> None:
    """A built record (tests, benchmarks, other readers) was cast silently: 2**32 + 7 read as 7,
    1.9 as 1."""
    with pytest.raises(ValueError, match=f"token IDs {says}"):
        Call(ids, [5])
    with pytest.raises(ValueError, match=f"token IDs {says}"):
        Call([5], ids)
    kept = np.array([3, 4], dtype=np.int32)
    assert Call(kept, [5]).prompt is kept  # an int32 array is not copied
    assert Call(np.array([3, 4], dtype=np.uint16), [5]).prompt.tolist() == [3, 4]
