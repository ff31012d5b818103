"""The packed form of `model_request` events (`reins.packed`): exact round trips, what each blob
holds, and the documents left whole."""

from __future__ import annotations

import base64
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reins.packed import (
    Base,
    Unpacked,
    base_after,
    base_of,
    decode_stream,
    decode_stream_into,
    pack,
    read_arrays,
    read_prefix,
    unpack,
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


def _chain(datas: list[dict[str, Any]]) -> list[Unpacked]:
    """Pack each call against the earlier ones (as the store does), restore it, check it."""
    restored: list[Unpacked] = []
    for seq, data in enumerate(datas, start=1):
        packed = pack(data, [u.base for u in restored[-4:]])
        assert packed is not None
        base_seq = base_of(packed.blob)
        base = None if base_seq is None else next(u for u in restored if u.base.seq == base_seq)
        # What the store writes goes through JSON: the skeleton as its column reads back.
        skeleton = orjson.loads(orjson.dumps(packed.skeleton))
        out = unpack(seq, skeleton, packed.blob, base)
        assert orjson.dumps(out.data) == orjson.dumps(data)
        # The store rebuilds its candidates without restoring requests: the same base.
        arrays = read_arrays(packed.blob, None if base is None else base.base.text)
        again = base_after(seq, arrays, None if base is None else base.base)
        assert np.array_equal(again.tokens, out.base.tokens)
        assert again.request == out.base.request
        assert again.text == out.base.text
        restored.append(out)
    return restored


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Calls of one attempt: most extend the previous context, some rewrite it or start over;
    requests and answers of any JSON, logprobs exact in float32 or not, fields absent."""
    calls = draw(st.integers(1, 6))
    context = draw(st.lists(st.integers(0, 2**31 - 1), max_size=20))
    messages: list[Any] = draw(st.lists(json_values, max_size=3))
    out = []
    for _ in range(calls):
        response = draw(st.lists(st.integers(0, 200_000), max_size=6))
        wide = draw(st.booleans())
        logprobs = [
            draw(st.floats(-50, 0)) if wide else float(np.float32(draw(st.floats(-50, 0))))
            for _ in response
        ]
        data: dict[str, Any] = {"model": "policy", "prompt_token_ids": list(context)}
        if draw(st.booleans()):
            data["response_token_ids"] = response
        else:
            response = []
        lp = draw(st.sampled_from(["list", "null", "absent"]))
        if lp == "list" and "response_token_ids" in data:
            data["response_logprobs"] = logprobs
        elif lp == "null":
            data["response_logprobs"] = None
        extra = draw(st.dictionaries(st.sampled_from(["tools", "n", "system"]), json_values))
        if draw(st.booleans()):
            data["request"] = {"messages": list(messages), **extra}
        elif draw(st.booleans()):
            data["request"] = draw(json_values)
        if draw(st.booleans()):
            data["response"] = draw(json_values)
        data["status"] = draw(st.sampled_from([200, 500]))
        fields = ["latency_s", "endpoint", "model_version", "abandoned", "error"]
        data.update(draw(st.dictionaries(st.sampled_from(fields), json_values)))
        out.append(data)
        move = draw(st.sampled_from(["extend", "extend", "rewrite", "restart"]))
        if move == "extend":
            context = context + response + draw(st.lists(st.integers(0, 99), max_size=5))
            messages = [*messages, draw(json_values)]
        elif move == "rewrite":
            cut = draw(st.integers(0, len(context)))
            context = context[:cut] + draw(st.lists(st.integers(0, 99), max_size=5))
            messages = messages[: draw(st.integers(0, len(messages)))]
        else:
            context = draw(st.lists(st.integers(0, 99), max_size=5))
            messages = []
    return out


@given(conversations())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_call_is_restored_exactly(datas: list[dict[str, Any]]) -> None:
    _chain(datas)


def _turns(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 150_000, 300).tolist()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "fix the bug " * 20}]
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"x": 1}}}]
    out = []
    for turn in range(count):
        response = rng.integers(0, 150_000, 40).tolist()
        answer = f"step {turn}: " + "ls -la; " * 30
        out.append(
            {
                "prompt_token_ids": prompt,
                "response_token_ids": response,
                "response_logprobs": [float(np.float32(-0.25 * i)) for i in range(40)],
                "request": {"model": "policy", "messages": messages, "tools": tools},
                "response": {"choices": [{"message": {"role": "assistant", "content": answer}}]},
                "model_version": 2,
                "status": 200,
            }
        )
        observation = rng.integers(0, 150_000, 60).tolist()
        prompt = prompt + response + observation
        messages = [
            *messages,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"output {turn}"},
        ]
    return out


def test_a_call_stores_only_what_is_new_against_the_previous_one() -> None:
    datas = _turns(30)
    restored = _chain(datas)
    blobs = []
    for seq, data in enumerate(datas, start=1):
        bases = [u.base for u in restored[: seq - 1][-4:]]
        packed = pack(data, bases)
        assert packed is not None
        blobs.append(packed.blob)
        base = restored[seq - 2] if seq > 1 else None
        arrays = read_arrays(packed.blob, None if base is None else base.base.text)
        if seq == 1:
            assert arrays.base_seq is None and arrays.tail.size == 300
            continue
        # The whole previous prompt + response is named, only the observation is stored.
        assert arrays.base_seq == seq - 1
        assert arrays.keep == len(datas[seq - 2]["prompt_token_ids"]) + 40
        assert arrays.tail.tolist() == data["prompt_token_ids"][arrays.keep :]
        delta = arrays.header["req"]
        assert delta["same"] == ["model", "tools"]
        assert delta["prefix"] == {"messages": 2 * seq - 3}
        assert len(delta["own"]["messages"]) == 2
    # Linear: the 30th call's blob is about the size of the 2nd's, while its prompt is 12x.
    assert len(blobs[29]) < 1.3 * len(blobs[1])
    assert len(datas[29]["prompt_token_ids"]) > 10 * len(datas[1]["prompt_token_ids"]) / 2


def test_the_answer_the_next_request_repeats_is_not_stored_twice() -> None:
    """zlib's preset dictionary is the base's text, its answer last: the assistant message that
    repeats it in the next request costs a few bytes, not its length."""
    datas = _turns(3)
    restored = _chain(datas)
    letters = np.random.default_rng(1).integers(97, 123, 2000, dtype=np.uint8)
    long_answer = letters.tobytes().decode()  # random: zlib cannot shorten it on its own
    datas[1]["response"]["choices"][0]["message"]["content"] = long_answer
    with_dict = pack(datas[1], [restored[0].base])
    assert with_dict is not None
    follow = dict(datas[2])
    follow["request"] = {
        **datas[2]["request"],
        "messages": [
            *datas[1]["request"]["messages"],
            {"role": "assistant", "content": long_answer},
            {"role": "user", "content": "ok"},
        ],
    }
    base = unpack(2, with_dict.skeleton, with_dict.blob, restored[0]).base
    plain = Base(base.seq, base.tokens, base.request, b"")
    helped, alone = pack(follow, [base]), pack(follow, [plain])
    assert helped is not None and alone is not None
    assert len(alone.blob) - len(helped.blob) > 1000


def test_a_side_call_between_two_turns_does_not_break_the_chain() -> None:
    datas = _turns(3)
    side = {"prompt_token_ids": [7, 8, 9], "response_token_ids": [1], "request": {"x": 1}}
    restored = _chain([datas[0], datas[1], side])
    packed = pack(datas[2], [u.base for u in restored])
    assert packed is not None
    assert base_of(packed.blob) == 2  # the main conversation's last call, not the side call
    arrays = read_arrays(packed.blob, restored[1].base.text)
    assert arrays.keep == len(datas[1]["prompt_token_ids"]) + 40


@pytest.mark.parametrize(
    "change",
    [
        {"prompt_token_ids": [1, True, 3]},
        {"prompt_token_ids": [1, -2]},
        {"prompt_token_ids": [1, 2**31]},
        {"prompt_token_ids": [1.0, 2]},
        {"prompt_token_ids": "1 2 3"},
        {"response_token_ids": [None]},
        {"response_logprobs": [-0.5]},  # one logprob for two tokens
        {"response_logprobs": [-1, -0.5]},  # an int: float64 would read back -1.0
        {"request": {"seed": 2**64}},  # beyond 64 bits
    ],
)
def test_a_document_the_packed_form_cannot_carry_exactly_is_left_whole(
    change: dict[str, Any],
) -> None:
    data = {"prompt_token_ids": [1, 2], "response_token_ids": [3, 4], "request": {}, **change}
    assert pack(data) is None


def test_logprobs_that_float32_cannot_hold_are_kept_in_float64() -> None:
    data = {
        "prompt_token_ids": [1],
        "response_token_ids": [2, 3],
        "response_logprobs": [-0.1, -0.0],
    }
    packed = pack(data)
    assert packed is not None
    arrays = read_arrays(packed.blob, None)
    assert arrays.header["lp"] == "f8"
    restored = unpack(1, packed.skeleton, packed.blob, None).data
    assert orjson.dumps(restored) == orjson.dumps(data)
    exact = {**data, "response_logprobs": [float(np.float32(-0.1)), -0.0]}
    packed = pack(exact)
    assert packed is not None and read_arrays(packed.blob, None).header["lp"] == "f4"
    assert orjson.dumps(unpack(1, packed.skeleton, packed.blob, None).data) == orjson.dumps(exact)


def test_unpack_refuses_the_wrong_base() -> None:
    restored = _chain(_turns(2))
    packed = pack(_turns(3)[2], [restored[1].base])
    assert packed is not None
    with pytest.raises(ValueError, match="packed against event 2"):
        unpack(3, packed.skeleton, packed.blob, restored[0])


def test_only_the_queried_fields_stay_in_the_column() -> None:
    """The JSON column keeps what queries read without opening the blob; every other field
    travels in the blob's text and comes back in place."""
    data = {
        **_turns(1)[0],
        "latency_s": 1.25,
        "endpoint": "http://127.0.0.1:8001/v1",
        "abandoned": False,
        "error": None,
    }
    packed = pack(data)
    assert packed is not None
    assert packed.skeleton == {"model_version": 2, "status": 200, "abandoned": False}
    assert list(unpack(1, packed.skeleton, packed.blob, None).data.items()) == list(data.items())


def _format_1_rows() -> list[dict[str, Any]]:
    path = Path(__file__).parent / "fixtures" / "packed_format1.json"
    rows: list[dict[str, Any]] = orjson.loads(path.read_bytes())["rows"]
    for row in rows:
        row["packed"] = base64.b64decode(row["packed"])
    return rows


def test_blobs_of_format_1_are_still_read_and_packed_against() -> None:
    """Rows written before format 2 (fixture written by reins at b1cd759): restored exactly,
    rebuilt as bases the way the store does after a restart, and a new call packed against
    one of them restores exactly too."""
    rows = _format_1_rows()
    assert {row["packed"][0] for row in rows} == {1}  # the prefix's first byte: the format
    restored: dict[int, Unpacked] = {}
    rebuilt: dict[int, Base] = {}
    for row in rows:
        named = base_of(row["packed"])
        base = None if named is None else restored[named]
        out = unpack(row["seq"], row["skeleton"], row["packed"], base)
        assert orjson.dumps(out.data) == orjson.dumps(row["data"])
        restored[row["seq"]] = out
        arrays = read_arrays(row["packed"], None if named is None else rebuilt[named].text)
        rebuilt[row["seq"]] = base_after(
            row["seq"], arrays, None if named is None else rebuilt[named]
        )
        assert np.array_equal(rebuilt[row["seq"]].tokens, out.base.tokens)
    following = _turns(5)[4]
    packed = pack(following, list(rebuilt.values()))
    assert packed is not None and packed.blob[0] == 2 and base_of(packed.blob) == 4
    skeleton = orjson.loads(orjson.dumps(packed.skeleton))
    out = unpack(5, skeleton, packed.blob, restored[4])
    assert orjson.dumps(out.data) == orjson.dumps(following)


def test_a_blob_of_an_unknown_format_is_refused_with_the_fix() -> None:
    packed = pack(_turns(1)[0])
    assert packed is not None
    newer = bytes([9]) + packed.blob[1:]
    with pytest.raises(ValueError, match=r"format 9 is newer than this reins reads.*upgrade reins"):
        base_of(newer)


def test_a_long_call_gets_a_block_per_byte_plane() -> None:
    """Each byte plane of a long call's tokens and logprobs gets its own Huffman table: the
    stream is smaller than the same bytes as one block (6 % on random token IDs), and exact."""
    rng = np.random.default_rng(3)
    response = rng.integers(0, 151_000, 500).tolist()
    data = {
        "prompt_token_ids": rng.integers(0, 151_000, 3000).tolist(),
        "response_token_ids": response,
        "response_logprobs": [float(x) for x in (-rng.exponential(0.3, 500)).astype(np.float32)],
    }
    packed = pack(data)
    assert packed is not None
    assert orjson.dumps(unpack(1, packed.skeleton, packed.blob, None).data) == orjson.dumps(data)
    stream = packed.blob[read_prefix(packed.blob).stream]
    one_block = zlib.compress(zlib.decompress(stream), 6)
    assert len(stream) < 0.97 * len(one_block)


@pytest.mark.parametrize("tokens", [40, 3000])  # one deflate block; a block per byte plane
@pytest.mark.parametrize("logprobs", ["f4", "f8", "null"])
def test_a_stream_decoded_into_arrays_equals_the_stream_decoded(tokens: int, logprobs: str) -> None:
    """The trainer's read writes each call's byte planes straight into its rollout's arrays
    (`decode_stream_into`): the same numbers as `decode_stream`, at a slice of larger arrays."""
    rng = np.random.default_rng(tokens)
    response = rng.integers(0, 151_000, tokens // 4)
    values = -rng.exponential(0.3, response.size)
    data: dict[str, Any] = {
        "prompt_token_ids": rng.integers(0, 151_000, tokens).tolist(),
        "response_token_ids": response.tolist(),
        "response_logprobs": None,
    }
    if logprobs == "f4":
        data["response_logprobs"] = [float(x) for x in values.astype(np.float32)]
    elif logprobs == "f8":
        data["response_logprobs"] = [float(x) for x in values]
    packed = pack(data)
    assert packed is not None
    prefix = read_prefix(packed.blob)
    assert prefix.logprob_kind == logprobs
    stream = packed.blob[prefix.stream]
    tail, answer, expected = decode_stream(stream, prefix.tail, prefix.response, logprobs)
    into = np.full(prefix.tail + prefix.response + 7, -1, dtype=np.int32)
    lp = np.full(prefix.response + 3, 9.0, dtype=np.float32)
    got = lp[2 : 2 + prefix.response] if logprobs != "null" else None
    decode_stream_into(stream, into[5 : 5 + prefix.tail + prefix.response], got, logprobs)
    assert (
        into[5:-2].tolist()
        == [*tail.tolist(), *answer.tolist()]
        == data["prompt_token_ids"] + data["response_token_ids"]
    )
    assert into[:5].tolist() == [-1] * 5 and into[-2:].tolist() == [-1, -1]
    if expected is None:
        assert lp.tolist() == [9.0] * lp.size
    else:
        assert got is not None
        assert got.tolist() == expected.astype(np.float32).tolist()
        assert got.tolist() == np.asarray(data["response_logprobs"], np.float32).tolist()
        assert lp[:2].tolist() == [9.0, 9.0] and lp[-1] == 9.0
    with pytest.raises(ValueError, match="contiguous 4-byte values"):
        decode_stream_into(stream, into[5 : 5 + prefix.tail + prefix.response : 2], None, "none")
