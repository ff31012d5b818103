"""The proxy checks an engine's token IDs once, when it records the call, and the token reuse
memory and the store's packing take the int32 arrays made then (`CheckedTokenIds`): for a long
prompt each of them made the same array again from the list, holding the interpreter lock."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from reins.gateway import jsonrule
from reins.gateway.capture import CallFacts, answer_and_records
from reins.gateway.proxy import _record_data
from reins.gateway.reuse import ReuseMemory, Ticket
from reins.packed import pack, unpack
from reins.samples.records import CheckedTokenIds, checked, token_ids

PROMPT = list(range(100, 400))
RESPONSE = [7, 8, 9]


def _facts() -> CallFacts:
    request = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    return CallFacts(
        kind="chat",
        mode="train",
        request=request,
        model="policy",
        endpoint="http://127.0.0.1:1/v1",
        model_version=3,
        latency_s=0.25,
        stream=False,
    )


def _answer(prompt: list[Any], response: list[Any]) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "policy",
        "prompt_token_ids": prompt,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "abc"},
                "finish_reason": "stop",
                "token_ids": response,
                "logprobs": {
                    "content": [
                        {"token": c, "logprob": -0.5, "bytes": [ord(c)], "top_logprobs": []}
                        for c in "abc"
                    ]
                },
            }
        ],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(response)},
    }


def test_a_recorded_calls_token_ids_carry_the_array_made_when_they_were_checked() -> None:
    _, (record,) = answer_and_records(_facts(), _answer(list(PROMPT), list(RESPONSE)))
    prompt, response = record.prompt_token_ids, record.response_token_ids
    assert type(prompt) is CheckedTokenIds and type(response) is CheckedTokenIds
    assert prompt == PROMPT and response == RESPONSE  # the plain list to every reader
    assert prompt.array.dtype == np.int32 and prompt.array.tolist() == PROMPT
    # Taken as made, not made again:
    assert token_ids(prompt) is prompt.array
    assert token_ids(response) is response.array


def test_the_events_data_keeps_them_in_model_dumps_order_and_values() -> None:
    _, (record,) = answer_and_records(_facts(), _answer(list(PROMPT), list(RESPONSE)))
    data = _record_data(record)
    dumped = record.model_dump()
    assert list(data) == list(dumped)
    assert data == dumped
    assert data["prompt_token_ids"] is record.prompt_token_ids  # not a copy without its array
    # The store packs it as it would the plain lists, and restores the plain lists exactly.
    packed = pack(data)
    assert packed is not None
    restored = unpack(1, packed.skeleton, packed.blob, None).data
    assert restored == dumped and list(restored) == list(dumped)
    assert type(restored["prompt_token_ids"]) is list


def test_the_reuse_memory_remembers_the_same_tokens_from_the_array() -> None:
    _, (record,) = answer_and_records(_facts(), _answer(list(PROMPT), list(RESPONSE)))
    memory, plain = ReuseMemory(), ReuseMemory()
    ticket = Ticket(("r", 1), [b"m"], b"s")
    memory.remember(ticket, record.prompt_token_ids, record.response_token_ids)
    plain.remember(ticket, list(PROMPT), list(RESPONSE))
    (ours,) = memory._calls[("r", 1)]
    (theirs,) = plain._calls[("r", 1)]
    assert ours.tokens == theirs.tokens
    assert ours.tokens.tolist() == PROMPT + RESPONSE
    assert memory.tokens == plain.tokens == len(PROMPT) + len(RESPONSE)


def test_ids_that_are_not_all_ints_are_not_checked_and_the_call_says_so() -> None:
    # `True` is 1 to numpy: an array made of it would restore 1 where the engine sent `true`.
    _, (record,) = answer_and_records(_facts(), _answer([1, True, 3], list(RESPONSE)))
    assert type(record.prompt_token_ids) is list and record.prompt_token_ids == []
    assert record.error is not None and "not ints" in record.error


def test_a_checked_list_whose_length_changed_is_read_again() -> None:
    ids = checked([1, 2, 3], np.array([1, 2, 3], dtype=np.int32))
    ids.append(4)
    again = token_ids(ids)
    assert again is not None and again.tolist() == [1, 2, 3, 4]


def test_the_store_writes_the_same_text_from_the_arrays_and_still_applies_the_rule() -> None:
    _, (record,) = answer_and_records(_facts(), _answer(list(PROMPT), list(RESPONSE)))
    data = _record_data(record)
    plain = {key: list(value) if isinstance(value, list) else value for key, value in data.items()}
    assert (
        jsonrule.encode(data).text
        == jsonrule.encode(plain).text
        == json.dumps(plain, separators=(",", ":"), ensure_ascii=False)
    )
    # The values after the token IDs still go through the rule, named where they sit.
    with pytest.raises(jsonrule.JsonRuleError) as refused:
        jsonrule.encode({**data, "latency_s": math.nan}, ("data",))
    assert refused.value.loc == ("data", "latency_s")
    assert refused.value.kind == "non_finite_number"
    # Token IDs that are not the object's first values are written as any list.
    moved = {"model": "policy", **data}
    assert jsonrule.encode(moved).text == jsonrule.encode({"model": "policy", **plain}).text
