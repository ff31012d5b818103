"""The compact reads against a real gateway on loopback (SQLite and PostgreSQL): the trainer's
binary read (`POST /api/records`, `reins.recordbatch`), whose records equal
`rollout_from_events`' on the same events whatever the calls were (packed chains, side calls,
failed, abandoned, stored whole), and the events as stored (`GET .../events/packed`)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from reins import recordbatch
from reins.client import GatewayClient, GatewayError
from reins.gateway.routes import records as records_route
from reins.packed import unpack_events
from reins.recordbatch import DecodedRollout, record_of
from reins.samples import dedup_calls
from reins.samples.records import MissingRewardError, RolloutRecord, call_state, rollout_from_events
from reins.schemas import EventIn, RolloutSpec
from tests.conftest import Gateway
from tests.gateway.test_packing import conversation


def _calls() -> dict[str, list[dict[str, Any]]]:
    main = conversation(8, seed=3)
    side = {**main[0], "prompt_token_ids": [5, 6, 7], "response_token_ids": [8, 9]}
    side["response_logprobs"] = [-0.5, -1.5]
    failed = {**main[2], "status": 500, "response_token_ids": [], "response_logprobs": None}
    gave_up = {**main[3], "abandoned": True}
    whole = {**main[4], "response_logprobs": [-1] * 30}  # ints: not packable, stored whole
    no_lp = {**main[5], "response_logprobs": None, "model_version": 4}
    answer = len(main[1]["response_token_ids"])
    lp5, lp6 = main[5]["response_logprobs"], main[6]["response_logprobs"]
    # Fields a harness may post loosely typed: both readers take them by one rule
    # (`reins.samples.records.call_of`), as `ModelRequest` reads them.
    loose = [
        main[0],
        {**main[1], "abandoned": 1},  # abandoned
        {**main[2], "model_version": 3.0},  # version 3
        {**main[3], "status": "200"},  # 200
        {**main[4], "status": "oops"},  # no valid status: skipped
        {**side, "prompt_token_ids": [-1, 5]},  # not token IDs: skipped
        {**side, "prompt_token_ids": [True, 5]},
        {**main[5], "response_logprobs": lp5[:-1]},  # one short: kept, logprobs unknown
        {**main[6], "response_logprobs": [None, *lp6[1:]]},
        {**main[7], "request": ["not", "a", "dict"]},  # kept
    ]
    return {
        "chain": main,
        "mixed": [main[0], main[1], side, main[2], failed, main[3], gave_up, whole, no_lp],
        "first-only": main[:1],
        # Logprobs float32 cannot hold are stored as float64: read back as float32 all the same.
        "f8-logprobs": [main[0], {**main[1], "response_logprobs": [-1e-300] * answer}],
        "loose": loose,
        # `n: 2` at the last call: a record per choice, the same prompt.
        "choices": [
            main[0],
            {**main[1], "choice_index": 0},
            {**main[1], "response_token_ids": main[2]["response_token_ids"], "choice_index": 1},
        ],
    }


def _same_record(a: RolloutRecord, b: RolloutRecord) -> None:
    assert (a.rollout_id, a.reward, a.attempt_id) == (b.rollout_id, b.reward, b.attempt_id)
    assert (a.skipped_calls, a.abandoned_calls, a.other_model_calls, a.metrics) == (
        b.skipped_calls,
        b.abandoned_calls,
        b.other_model_calls,
        b.metrics,
    )
    assert [c.seq for c in a.calls] == [c.seq for c in b.calls]
    for x, y in zip(a.calls, b.calls, strict=True):
        assert np.array_equal(x.prompt, y.prompt) and np.array_equal(x.response, y.response)
        assert (x.model_version, x.choice) == (y.model_version, y.choice)
        if x.logprobs is None or y.logprobs is None:
            assert x.logprobs is None and y.logprobs is None
        else:
            assert np.array_equal(x.logprobs, y.logprobs)


async def test_records_equal_the_events_reading(gateway: Gateway) -> None:
    calls = _calls()
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        await client.create_rollouts([RolloutSpec(rollout_id=name) for name in calls])
        for name, datas in calls.items():
            await client.open_attempt(name, attempt_id=1)
            for n, data in enumerate(datas):
                event = EventIn(type="model_request", data=data, idempotency_key=f"c{n}")
                await client.post_events(name, 1, [event])
            if name != "first-only":
                reward = {"value": 0.5, "metrics": {"turns": len(datas), "note": "x"}}
                await client.post_events(name, 1, [EventIn(type="reward", data=reward)])
        read = await client.get_records(list(calls), chunk=2)  # two requests
        assert [r.rollout_id for r in read] == list(calls)
        for decoded in read:
            events = await client.get_events(decoded.rollout_id)
            if decoded.rollout_id == "first-only":
                with pytest.raises(MissingRewardError):
                    record_of(decoded)
                expected = rollout_from_events(events, missing_reward=0.0)
                _same_record(record_of(decoded, missing_reward=0.0), expected)
                continue
            _same_record(record_of(decoded), rollout_from_events(events))
        chain = record_of(read[0]).calls
        assert len(chain) == 8
        # One buffer per rollout: each turn's prompt is a view of the same memory as the last.
        assert all(np.shares_memory(chain[-1].prompt, call.prompt) for call in chain)
        mixed = record_of(read[1])
        assert (mixed.skipped_calls, mixed.abandoned_calls) == (2, 1)
        assert [c.model_version for c in mixed.calls][-1] == 4
        loose = record_of(read[4])
        assert (loose.skipped_calls, loose.abandoned_calls) == (4, 1)
        assert [c.model_version for c in loose.calls] == [1, 3, 1, 1, 1, 1]
        assert [c.logprobs is None for c in loose.calls] == [False] * 3 + [True] * 2 + [False]
        choices = record_of(read[5])
        assert [c.choice for c in choices.calls] == [0, 0, 1]
        # Nothing continues the last call: the first choice is the one trained.
        kept = dedup_calls(choices.calls)
        assert [c.choice for c in kept] == [0, 0] and kept[-1].seq == choices.calls[1].seq
        # One result per id asked, a repeated one too.
        twice = await client.get_records(["loose", "chain", "loose"])
        assert [r.rollout_id for r in twice] == ["loose", "chain", "loose"]
        _same_record(record_of(twice[2]), loose)
        with pytest.raises(GatewayError) as missing:
            await client.get_records(["chain", "nope"])
        assert missing.value.status_code == 404


async def test_the_records_answer_is_encoded_off_the_event_loop(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_loop: list[bool] = []

    def encode(parts: Any) -> bytes:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop runs in this thread
            on_loop.append(False)
        return recordbatch.encode(parts)

    monkeypatch.setattr(records_route, "encode", encode)
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        await client.create_rollouts([RolloutSpec(rollout_id="r")])
        await client.open_attempt("r", attempt_id=1)
        for n, data in enumerate(conversation(2)):
            event = EventIn(type="model_request", data=data, idempotency_key=f"c{n}")
            await client.post_events("r", 1, [event])
        (read,) = await client.get_records(["r"])
    assert len(read.calls) == 2
    assert on_loop == [False]


async def test_packed_events_are_the_stored_form_and_restore_exactly(gateway: Gateway) -> None:
    calls = _calls()["mixed"]
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        await client.create_rollouts([RolloutSpec(rollout_id="m")])
        await client.open_attempt("m", attempt_id=1)
        for n, data in enumerate(calls):
            event = EventIn(type="model_request", data=data, idempotency_key=f"c{n}")
            await client.post_events("m", 1, [event])
        await client.post_events("m", 1, [EventIn(type="reward", data={"value": 1.0})])
        whole = await client.get_events("m")
        packed = await client.get_packed_events("m")
    assert [e.seq for e in packed] == [e.seq for e in whole]
    # The int logprobs call and the reward are stored whole; every other call is packed.
    assert [e.packed is None for e in packed] == [False] * 7 + [True, False, True]
    assert "prompt_token_ids" not in packed[1].data and packed[1].data["status"] == 200
    restored = unpack_events(packed)
    assert [e.model_dump() for e in restored] == [e.model_dump() for e in whole]
    wire = sum(len(e.model_dump_json()) for e in packed)
    assert wire < sum(len(e.model_dump_json()) for e in whole) / 3
    with pytest.raises(ValueError, match="read its attempt from the first call"):
        unpack_events(packed[3:])
    # With `token_arrays` (the rollout page's read) each restored prompt is an int32 array of
    # the same IDs, and the samples read from them equal those read from the lists.
    arrays = unpack_events(packed, token_arrays=True)
    for as_array, as_list, stored in zip(arrays, whole, packed, strict=True):
        prompt = as_array.data.get("prompt_token_ids")
        if stored.packed is None:
            assert as_array.data == as_list.data
            continue
        assert isinstance(prompt, np.ndarray) and prompt.dtype == np.int32
        assert prompt.tolist() == as_list.data["prompt_token_ids"]
        rest = {k: v for k, v in as_array.data.items() if k != "prompt_token_ids"}
        assert rest == {k: v for k, v in as_list.data.items() if k != "prompt_token_ids"}
    _same_record(rollout_from_events(arrays), rollout_from_events(whole))


def test_a_stored_reward_that_does_not_parse_reads_as_missing() -> None:
    decoded = DecodedRollout("r", 2, {"value": "high"}, [], skipped_calls=0, abandoned_calls=0)
    with pytest.raises(MissingRewardError, match=r"rollout r attempt 2 .*value: Input should"):
        record_of(decoded)
    assert record_of(decoded, missing_reward=0.0).reward == 0.0


async def test_rollout_stats_give_the_latest_attempts_serving_versions(gateway: Gateway) -> None:
    """`POST /api/rollouts/stats`: what the trainer asks once per update to find the running
    groups already too stale to train, without reading their events."""
    main = conversation(3, seed=5)
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        await client.create_rollouts([RolloutSpec(rollout_id=r) for r in ("a", "b")])
        await client.open_attempt("a", attempt_id=1)
        for n, version in enumerate((3, 2**53 + 1)):  # past a double's integers
            data = {**main[n], "model_version": version}
            event = EventIn(type="model_request", data=data, idempotency_key=f"c{n}")
            await client.post_events("a", 1, [event])
        await client.post_events("a", 1, [EventIn(type="reward", data={"value": 0.25})])
        first = await client.rollout_stats(["a", "b"])
        # A retry: the latest attempt's calls count, the first one's no longer.
        await client.open_attempt("a", attempt_id=2)
        data = {**main[0], "model_version": 7}
        await client.post_events("a", 2, [EventIn(type="model_request", data=data)])
        retried = await client.rollout_stats(["a"])
        with pytest.raises(GatewayError) as missing:
            await client.rollout_stats(["a", "nope"])
    a, b = first["a"], first["b"]
    assert (a.calls, a.min_version, a.max_version, a.reward) == (2, 3, 2**53 + 1, 0.25)
    assert a.prompt_tokens == len(main[0]["prompt_token_ids"]) + len(main[1]["prompt_token_ids"])
    assert (b.calls, b.min_version, b.max_version, b.reward, b.events) == (0, None, None, None, 0)
    assert (retried["a"].calls, retried["a"].min_version, retried["a"].max_version) == (1, 7, 7)
    assert retried["a"].events == 4
    assert missing.value.status_code == 404
    # Admin only, as every read of rollouts.
    assert (
        gateway.http.post(
            "/api/rollouts/stats",
            json={"rollout_ids": ["a"]},
            headers={"Authorization": "Bearer x"},
        ).status_code
        == 401
    )


async def test_calls_another_model_served_are_left_out_of_the_policys_records_and_stats(
    gateway: Gateway,
) -> None:
    """A harness that calls a judge registered as a second model: the judge's calls were trained
    as the policy's, and its version (0, its own engine's) made every group look stale. A later
    policy call packed against the judge's call still reads back whole; a call recorded without
    a model is the policy's."""
    main = conversation(4, seed=9)
    judge = {**main[1], "model": "judge", "model_version": 0}  # main[2] continues it: its base
    unnamed = {k: v for k, v in main[3].items() if k != "model"}
    datas = [main[0], judge, main[2], unnamed]
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        await client.create_rollouts([RolloutSpec(rollout_id="judged")])
        await client.open_attempt("judged", attempt_id=1)
        for n, data in enumerate(datas):
            event = EventIn(type="model_request", data=data, idempotency_key=f"c{n}")
            await client.post_events("judged", 1, [event])
        await client.post_events("judged", 1, [EventIn(type="reward", data={"value": 1.0})])
        (policy,) = await client.get_records(["judged"], model="policy")
        (every,) = await client.get_records(["judged"])
        events = await client.get_events("judged")
        stats = await client.rollout_stats(["judged"], model="policy")
        unfiltered = await client.rollout_stats(["judged"])
    record = record_of(policy)
    assert [c.seq for c in record.calls] == [events[0].seq, events[2].seq, events[3].seq]
    assert (record.other_model_calls, record.skipped_calls) == (1, 0)
    assert np.array_equal(record.calls[1].prompt, main[2]["prompt_token_ids"])
    _same_record(record, rollout_from_events(events, model="policy"))
    assert rollout_from_events(events, model="policy").other_model_calls == 1
    assert len(record_of(every).calls) == 4 and record_of(every).other_model_calls == 0
    assert (stats["judged"].min_version, stats["judged"].max_version) == (1, 1)
    assert (unfiltered["judged"].min_version, unfiltered["judged"].max_version) == (0, 1)


async def test_rollout_stats_read_loosely_typed_calls_as_the_trainers_record_read(
    gateway: Gateway,
) -> None:
    """Calls an admin posted with loosely typed fields: the stats' versions and failed calls are
    those of the calls the binary read trains (`call_state`), on both stores. Stats counted
    `1.5` as version 1 (the read skips the call), left out `"7"`, `true` and a `"200"` status
    (the read trains them), and read integers past int64 as the read does not."""
    main = conversation(2, seed=5)
    loose: dict[str, dict[str, Any]] = {
        "half": {"model_version": 1.5},
        "text": {"model_version": "7"},
        "padded": {"model_version": " 7 "},
        "bool": {"model_version": True},
        "float": {"model_version": 3.0},
        "text-status": {"status": "200", "model_version": 4},
        "text-failed": {"status": "500", "model_version": 4},
        "text-abandoned": {"abandoned": "yes", "model_version": 5},
        "uint64": {"model_version": 2**63},
        "past-64-bits": {"model_version": 2**64 + 1},
        "below-int64": {"model_version": -(2**63) - 1},
        "mixed": {"model_version": "9"},  # after a plain call of version 2
        # JSON null is no status nor abandoned (the read skips the call); a missing one is
        # (200, not abandoned): PostgreSQL's `json_to_record` reads both as SQL NULL.
        "null-status": {"status": None, "model_version": 6},
        "null-abandoned": {"abandoned": None, "model_version": 6},
        "no-status": {"status": ..., "model_version": 6},
        "no-abandoned": {"abandoned": ..., "model_version": 6},
    }
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        await client.create_rollouts([RolloutSpec(rollout_id=r) for r in loose])
        for rollout_id, fields in loose.items():
            await client.open_attempt(rollout_id, attempt_id=1)
            call = {**main[0], **fields}
            calls = [{k: v for k, v in call.items() if v is not ...}]
            if rollout_id == "mixed":
                calls.insert(0, {**main[0], "model_version": 2})
            events = [
                EventIn(type="model_request", data=data, idempotency_key=f"c{n}")
                for n, data in enumerate(calls)
            ]
            events.append(EventIn(type="reward", data={"value": 1.0}))
            await client.post_events(rollout_id, 1, events)
        stats = await client.rollout_stats(list(loose))
        read = await client.get_records(list(loose))
        records = {r: record_of(d) for r, d in zip(loose, read, strict=True)}
        every = {r: await client.get_events(r) for r in loose}
    for rollout_id in loose:
        versions = [c.model_version for c in records[rollout_id].calls]
        trained = [v for v in versions if v is not None]
        expected = (min(trained), max(trained)) if trained else (None, None)
        got = stats[rollout_id]
        assert (got.min_version, got.max_version) == expected, rollout_id
        states = [call_state(e.data) for e in every[rollout_id] if e.type == "model_request"]
        failed = sum(1 for s in states if s is not None and s.status != 200)
        assert got.failed_calls == failed, rollout_id
    assert (stats["text"].min_version, stats["bool"].max_version) == (7, 1)
    assert (stats["half"].min_version, stats["past-64-bits"].max_version) == (None, None)
    assert (stats["mixed"].min_version, stats["mixed"].max_version) == (2, 9)
    assert (stats["uint64"].max_version, stats["text-failed"].failed_calls) == (2**63, 1)
    assert (stats["null-status"].max_version, stats["null-abandoned"].max_version) == (None, None)
    assert (stats["no-status"].max_version, stats["no-abandoned"].max_version) == (6, 6)
