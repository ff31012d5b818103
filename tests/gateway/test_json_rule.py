"""The gateway's JSON rule, on every write path and on both stores: a value that JSON cannot carry
faithfully (NaN, Infinity, a number past a double's range, an unpaired UTF-16 surrogate, nesting
past the limit) is refused with a 422 that names the field, nothing is stored, and everything
that reads the store (the controller's poll, the rollout, its events, the dashboard) still answers.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from reins.gateway import jsonrule
from tests.conftest import Gateway

MAX_DEPTH = 200
"""Levels of arrays and objects a request body may nest (docs/gateway.md)."""

# Raw JSON text of each bad value, as a client would send it (Python's json module emits the
# first four; the surrogate is an escape that decodes to a lone code point).
BAD_VALUES = {
    "nan": "NaN",
    "infinity": "-Infinity",
    "overflow": "1e400",
    "digits": "1" * 5000,
    "surrogate": '"\\ud800"',
    "low_surrogate": '"a\\udc00b"',
    "deep": "[" * 10_000 + "]" * 10_000,
}
TOKEN = "{V}"


def _fill(template: str, value: str) -> bytes:
    return template.replace(TOKEN, value).encode()


def _prepare(gateway: Gateway) -> str:
    """Rollout `r` with a running attempt; its token."""
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r", "input": {"task": "ok"}}])
    return str(gateway.http.post("/api/rollouts/r/attempts").json()["token"])


def _assert_still_readable(gateway: Gateway) -> None:
    for path in (
        "/api/rollouts?status=queuing",
        "/api/rollouts?status=running",
        "/api/rollouts",
        "/api/rollouts/r",
        "/api/rollouts/r/events?all_attempts=true",
        "/api/models",
        "/ui",
        "/ui/rows",
        "/ui/rows?sort=reward",
        "/ui/rollouts/r",
        "/ui/rollouts/r/version",
    ):
        response = gateway.http.get(path)
        assert response.status_code == 200, (path, response.status_code, response.text[:300])


# (method, path, body template, the field the error must name)
WRITES = [
    (
        "POST",
        "/api/rollouts",
        '[{"rollout_id": "x", "input": {"a": [1, {V}]}}]',
        "body.0.input.a.1",
    ),
    ("POST", "/api/rollouts", '[{"rollout_id": "x", "metadata": {"m": {V}}}]', "body.0.metadata.m"),
    ("POST", "/api/rollouts", '[{"rollout_id": "x", "config": {"k": {V}}}]', "body.0.config.k"),
    ("PATCH", "/api/rollouts/r", '{"metadata": {"m": {V}}}', "body.metadata.m"),
    (
        "PATCH",
        "/api/rollouts/r",
        '{"status": {"state": "failed", "reason": {V}}}',
        "body.status.reason",
    ),
    ("POST", "/api/rollouts/r/attempts", '{"reason": {V}}', "body.reason"),
    (
        "POST",
        "/api/models",
        '{"model": "m", "endpoint": "http://h/v1", "engine": {V}}',
        "body.engine",
    ),
    (
        "POST",
        "/api/rollouts/r/attempt/1/events",
        '{"type": "reward", "data": {"value": {V}}}',
        "body.data.value",
    ),
    (
        "POST",
        "/api/rollouts/r/attempt/1/events",
        '[{"type": "x"}, {"type": "model_request", "data": {"response_logprobs": [-0.5, {V}]}}]',
        "body.1.data.response_logprobs.1",
    ),
    (
        "POST",
        "/api/rollouts/r/attempt/1/events",
        '{"type": "x", "idempotency_key": {V}}',
        "body.idempotency_key",
    ),
]


@pytest.mark.parametrize(("method", "path", "template", "field"), WRITES)
def test_a_value_json_cannot_carry_is_422_naming_the_field(
    gateway: Gateway, method: str, path: str, template: str, field: str
) -> None:
    token = _prepare(gateway)
    # Events are posted with the attempt's token, as a harness posts them.
    client = gateway.client(token) if path.endswith("/events") else gateway.http
    before = gateway.http.get("/api/rollouts/r/events?all_attempts=true").json()
    for name, value in BAD_VALUES.items():
        # A string field cannot hold a number or an array: those are plain 422s already.
        if name in ("nan", "infinity", "overflow", "digits", "deep") and template.endswith(
            ('"reason": {V}}}', '"reason": {V}}', '"engine": {V}}', '"idempotency_key": {V}}')
        ):
            continue
        response = client.request(
            method,
            path,
            content=_fill(template, value),
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 422, (name, response.status_code, response.text[:300])
        error = response.json()["error"]
        expected = "body" if name == "deep" else field
        assert error.startswith(expected + ":"), (name, error)
        assert "parsing the body" not in error
    # Nothing was stored.
    assert gateway.http.get("/api/rollouts/x").status_code == 404
    assert gateway.http.get("/api/models").json() == []
    detail = gateway.http.get("/api/rollouts/r").json()
    assert detail["rollout"]["metadata"] == {}
    assert detail["rollout"]["status"]["state"] == "running"
    assert [a["attempt_id"] for a in detail["attempts"]] == [1]
    assert gateway.http.get("/api/rollouts/r/events?all_attempts=true").json() == before
    _assert_still_readable(gateway)


def test_a_key_with_an_unpaired_surrogate_is_named_escaped(gateway: Gateway) -> None:
    body = b'[{"rollout_id": "x", "metadata": {"ok": 1, "\\ud800k": 2}}]'
    response = gateway.http.post(
        "/api/rollouts", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 422, response.text
    assert response.json()["error"].startswith("body.0.metadata.\\ud800k:")
    assert gateway.http.get("/api/rollouts/x").status_code == 404


def test_paired_surrogates_and_extreme_finite_numbers_are_stored_faithfully(
    gateway: Gateway,
) -> None:
    """The rule refuses only what cannot be kept: an escaped astral character, the largest
    double, 64-bit integers and a denormal all come back as they were sent."""
    text = (
        '[{"rollout_id": "r", "input": {"emoji": "\\ud83d\\ude00", "big": 1.7976931348623157e308,'
        ' "u64": 18446744073709551615, "i64": -9223372036854775808, "tiny": 5e-324}}]'
    )
    response = gateway.http.post(
        "/api/rollouts", content=text.encode(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text
    stored = gateway.http.get("/api/rollouts/r").json()["rollout"]["input"]
    assert stored == {
        "emoji": "\U0001f600",
        "big": 1.7976931348623157e308,
        "u64": 18446744073709551615,
        "i64": -9223372036854775808,
        "tiny": 5e-324,
    }
    _assert_still_readable(gateway)


def test_nesting_up_to_the_limit_is_stored_and_past_it_refused(gateway: Gateway) -> None:
    _prepare(gateway)

    def nested(depth: int) -> str:
        # The event body is one object, its `data` a second level: fill the rest with arrays,
        # the innermost holding a number.
        return '{"type": "x", "data": {"a": ' + _arrays(depth - 2) + "}}"

    ok = gateway.http.post(
        "/api/rollouts/r/attempt/1/events",
        content=nested(MAX_DEPTH).encode(),
        headers={"content-type": "application/json"},
    )
    assert ok.status_code == 200, ok.text
    too_deep = gateway.http.post(
        "/api/rollouts/r/attempt/1/events",
        content=nested(MAX_DEPTH + 1).encode(),
        headers={"content-type": "application/json"},
    )
    assert too_deep.status_code == 422
    assert f"more than {MAX_DEPTH} levels" in too_deep.json()["error"]
    events = gateway.http.get("/api/rollouts/r/events").json()
    assert len(events) == 1
    assert events[0]["data"] == json.loads(nested(MAX_DEPTH))["data"]
    _assert_still_readable(gateway)


# -- the rule itself (reins.gateway.jsonrule), without a gateway ------------------------------


def _arrays(levels: int, inner: str = "1") -> str:
    return "[" * levels + inner + "]" * levels


def _objects(levels: int, inner: str = "1") -> str:
    return '{"k": ' * levels + inner + "}" * levels


@pytest.mark.parametrize("nest", [_arrays, _objects])
def test_parse_and_encode_agree_on_the_depth_boundary(nest: Any) -> None:
    """The fast depth check (pydantic-core's reader) and the walk that names the field draw the
    line at the same place, for arrays and objects: content inside MAX_DEPTH levels is kept,
    inside one more it is refused; an empty container may sit at the next level."""
    assert jsonrule.MAX_DEPTH == MAX_DEPTH
    for text in (nest(MAX_DEPTH), nest(MAX_DEPTH, "[]"), nest(MAX_DEPTH, "{}")):
        value = jsonrule.parse(text)
        assert jsonrule.encode(value).value is value
        assert jsonrule.find(value) is None
    for text in (nest(MAX_DEPTH + 1), nest(MAX_DEPTH, "[[]]"), nest(MAX_DEPTH + 50)):
        with pytest.raises(jsonrule.JsonRuleError) as refused:
            jsonrule.parse(text)
        assert refused.value.kind == "too_deep"
        value = json.loads(text)
        with pytest.raises(jsonrule.JsonRuleError) as refused:
            jsonrule.encode(value)
        assert refused.value.kind == "too_deep"


@pytest.mark.parametrize("nest", [_arrays, _objects])
def test_parse_under_a_level_refuses_what_its_record_could_not_hold(nest: Any) -> None:
    """A proxied request is stored one level down in its call's record (`under=1`): the level
    it may not use is counted at the door, by both checks, and the message says why."""
    kept = nest(MAX_DEPTH - 1)
    assert jsonrule.parse(kept, under=1) == json.loads(kept)
    for text in (nest(MAX_DEPTH), nest(MAX_DEPTH - 1, "[[]]")):
        assert jsonrule.parse(text) == json.loads(text)  # at the root it fits
        with pytest.raises(jsonrule.JsonRuleError) as refused:
            jsonrule.parse(text, under=1)
        assert refused.value.kind == "too_deep"
        assert f"more than {MAX_DEPTH - 1} levels" in str(refused.value)
        assert "1 level down in its record" in str(refused.value)
        found = jsonrule.find(json.loads(text), under=1)
        assert found is not None and found.kind == "too_deep"


@pytest.mark.parametrize(
    ("text", "loc", "kind"),
    [
        ('{"a": [1, NaN]}', ("body", "a", 1), "non_finite_number"),
        ('{"a": {"b": Infinity}}', ("body", "a", "b"), "non_finite_number"),
        ('{"a": -Infinity}', ("body", "a"), "non_finite_number"),
        ('{"a": 1e400}', ("body", "a"), "non_finite_number"),
        ('{"a": -2.5e308}', ("body", "a"), "non_finite_number"),
        ('{"a": ' + "9" * 5000 + "}", ("body", "a"), "non_finite_number"),
        ('{"a": ["\\ud800"]}', ("body", "a", 0), "unpaired_surrogate"),
        ('{"a": "x\\udfffy"}', ("body", "a"), "unpaired_surrogate"),
        ('{"\\udc00": 1}', ("body", "\\udc00"), "unpaired_surrogate"),
        ('{"a": "\\ude00\\ud83d"}', ("body", "a"), "unpaired_surrogate"),
        ('{"a": [1, 2}', ("body",), "json_invalid"),
        ("", ("body",), "json_invalid"),
    ],
)
def test_parse_refuses_naming_the_field(text: str, loc: tuple[object, ...], kind: str) -> None:
    with pytest.raises(jsonrule.JsonRuleError) as refused:
        jsonrule.parse(text.encode())
    assert (refused.value.loc, refused.value.kind) == (loc, kind)


def test_parse_refuses_invalid_utf8_and_raw_surrogate_bytes() -> None:
    with pytest.raises(jsonrule.JsonRuleError) as refused:
        jsonrule.parse(b'{"a": "\xff"}')
    assert refused.value.kind == "json_invalid"
    # A surrogate encoded as UTF-8 bytes (CESU style) is not UTF-8 either.
    with pytest.raises(jsonrule.JsonRuleError) as refused:
        jsonrule.parse(b'{"a": "\xed\xa0\x80"}')
    assert refused.value.loc == ("body", "a")


def test_a_body_that_is_not_utf8_is_422_saying_where_and_what_to_send(gateway: Gateway) -> None:
    """orjson said "str is not valid UTF-8: surrogates not allowed: line 1 column 1" for any
    byte anywhere: a Latin-1 body (PowerShell 5's default) read as one with a surrogate."""
    latin1 = '[{"rollout_id": "r", "input": "café"}]'.encode("latin-1")
    response = gateway.http.post(
        "/api/rollouts", content=latin1, headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"] == (
        "malformed JSON in the request body: the document is not UTF-8 text (byte 0xe9 at "
        "offset 34); send JSON encoded as UTF-8"
    )
    assert gateway.http.get("/api/rollouts").json()["items"] == []


def test_parse_keeps_every_other_value_as_sent() -> None:
    text = (
        '{"s": "\\u0000\\ud83d\\ude00 NaN Infinity", "f": 1.5e308, "t": 5e-324, "n": null,'
        ' "u": 18446744073709551615, "i": -9223372036854775808, "b": [true, false], "e": {}}'
    )
    assert jsonrule.parse(text) == json.loads(text)
    # Past 64 bits an integer is read as a double, as JavaScript reads it.
    assert jsonrule.parse("[18446744073709551616]") == [1.8446744073709552e19]


@pytest.mark.parametrize(
    ("value", "loc", "kind"),
    [
        ({"logprobs": [-0.1, float("nan")]}, ("logprobs", 1), "non_finite_number"),
        ({"x": {"y": float("-inf")}}, ("x", "y"), "non_finite_number"),
        ({"x": ("a", "b\ud800")}, ("x", 1), "unpaired_surrogate"),
        ({"k\udbff": 1}, ("k\\udbff",), "unpaired_surrogate"),
    ],
)
def test_encode_refuses_what_a_python_value_may_hold(
    value: object, loc: tuple[object, ...], kind: str
) -> None:
    with pytest.raises(jsonrule.JsonRuleError) as refused:
        jsonrule.encode(value)
    assert (refused.value.loc, refused.value.kind) == (loc, kind)


def test_find_reports_an_integer_past_a_double_as_non_finite() -> None:
    problem = jsonrule.find({"big": [10**400]})
    assert problem is not None
    assert (problem.loc, problem.kind) == (("big", 0), "non_finite_number")


def test_encode_writes_what_json_reads_back() -> None:
    value = {"text": "NaN and Infinity are words here", "x": [1.5, -2, None, "\x00"], "d": {}}
    encoded = jsonrule.encode(value)
    assert json.loads(encoded.text) == value
    assert encoded.value is value
