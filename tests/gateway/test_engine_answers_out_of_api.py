"""An engine answering out of its API (fields of the wrong type), and the gateway's own defects
while reading an answer: every wire API answers in its own error shape and records the call as
failed (502), never a bare 500, a stream cut short, or a call recorded as one the harness left.
STUBBED: the engine (the `engine` fixture: a scripted answer to each chat completion).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from reins.gateway.capture import StreamRecorder
from tests.conftest import Gateway
from tests.gateway.conftest import Engine

ANTHROPIC = {"anthropic-version": "2023-06-01"}
MESSAGE = {"role": "assistant", "content": "hi"}


def proxied(gateway: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {gateway.api_key}", **ANTHROPIC}
    url = f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train{path}"
    return httpx.post(url, json=body, headers=headers, timeout=30)


def calls(gateway: Gateway) -> list[dict[str, Any]]:
    events = gateway.http.get("/api/rollouts/r/events", params={"type": "model_request"})
    return [event["data"] for event in events.json()]


CALLS = {
    "chat": ("/openai/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}]}),
    "responses": ("/openai/v1/responses", {"input": "q"}),
    "messages": (
        "/anthropic/v1/messages",
        {"max_tokens": 50, "messages": [{"role": "user", "content": "q"}]},
    ),
}


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize("api", list(CALLS))
def test_usage_of_the_wrong_type_is_counted_from_the_token_ids(
    gateway: Gateway, engine: Engine, api: str, stream: bool
) -> None:
    """Messages read `usage` without looking at its types: a bare 500 (plain), a stream cut and
    the call recorded as one the harness had left (streamed)."""
    odd_usage = {"prompt_tokens": [1], "completion_tokens": "2"}
    engine.answer = {
        "choices": [{"index": 0, "message": MESSAGE, "finish_reason": "stop", "token_ids": [7]}],
        "prompt_token_ids": [1, 2],
        "usage": odd_usage,
    }
    engine.chunks = [
        {
            "choices": [{"index": 0, "delta": MESSAGE, "token_ids": [7], "finish_reason": "stop"}],
            "prompt_token_ids": [1, 2],
        },
        {"choices": [], "usage": odd_usage},
    ]
    path, body = CALLS[api]
    answer = proxied(gateway, path, {"model": "m", "stream": stream, **body})
    assert answer.status_code == 200, answer.text
    if stream:
        lines = [line for line in answer.text.splitlines() if line]
        if api == "chat":
            assert lines[-1] == "data: [DONE]"
            assert not any(line.startswith('data: {"error"') for line in lines)
        else:
            kinds = [line for line in lines if line.startswith("event:")]
            last = "response.completed" if api == "responses" else "message_stop"
            assert kinds[-1] == f"event: {last}" and "event: error" not in kinds
    if api == "messages" and not stream:
        assert answer.json()["usage"]["input_tokens"] == 2
        assert answer.json()["usage"]["output_tokens"] == 1
    (call,) = calls(gateway)
    assert (call["status"], call["prompt_token_ids"], call["response_token_ids"]) == (
        200,
        [1, 2],
        [7],
    )


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize("api", list(CALLS))
def test_an_answer_the_gateway_fails_to_read_is_a_recorded_502_in_the_apis_shape(
    gateway: Gateway, engine: Engine, api: str, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A defect met while reading the engine's answer (here a recorder that raises, standing in
    for any): the harness gets its API's error, and the call is recorded as failed."""

    def broken(self: StreamRecorder, chunk: dict[str, Any]) -> None:
        raise KeyError("a defect")

    monkeypatch.setattr(StreamRecorder, "feed", broken)
    if not stream:
        monkeypatch.setattr(
            "reins.gateway.proxy.answer_and_records",
            lambda facts, payload: (_ for _ in ()).throw(KeyError("a defect")),
        )
    engine.answer = {
        "choices": [{"index": 0, "message": MESSAGE, "finish_reason": "stop", "token_ids": [7]}],
        "prompt_token_ids": [1, 2],
    }
    engine.chunks = [
        {
            "choices": [{"index": 0, "delta": MESSAGE, "token_ids": [7], "finish_reason": "stop"}],
            "prompt_token_ids": [1, 2],
        }
    ]
    path, body = CALLS[api]
    answer = proxied(gateway, path, {"model": "m", "stream": stream, **body})
    (call,) = calls(gateway)
    assert call["status"] == 502 and call["abandoned"] is False, call
    assert "could not read the engine's answer (KeyError: 'a defect')" in call["error"]
    if not stream:
        assert answer.status_code == 502
        error = answer.json()["error"]
        if api == "messages":
            assert answer.json()["type"] == "error" and error["type"] == "api_error"
        else:
            assert error["type"] == (
                "server_error" if api == "responses" else "bad_upstream_answer"
            )
        assert "could not read the engine's answer" in error["message"]
    else:
        assert answer.status_code == 200  # the stream had begun: its last event says why
        assert "could not read the engine's answer" in answer.text
        last = answer.text.rstrip().splitlines()[-1]
        assert "error" in last, answer.text[-300:]


def test_a_responses_error_is_the_responses_apis_error_object(
    gateway: Gateway, engine: Engine
) -> None:
    """The gateway's own refusals on the Responses route (an attempt superseded, a bad key)
    came in chat's shape, whose integer `code` the SDK's `ErrorObject` refuses."""
    gateway.http.post("/api/rollouts/r/attempts")
    gateway.http.post("/api/rollouts/r/attempts")  # attempt 1 is superseded
    path, body = CALLS["responses"]
    refused = proxied(gateway, path, {"model": "m", **body})
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] is None
    url = f"{gateway.url}/proxy/rollout/r/attempt/2/mode/train{path}"
    unknown = httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"})
    assert unknown.status_code == 401
    assert set(unknown.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no-usage"])
def test_a_messages_length_stop_short_of_max_tokens_does_not_depend_on_usage(
    gateway: Gateway, engine: Engine, usage: bool
) -> None:
    engine.answer = {
        "choices": [
            {"index": 0, "message": MESSAGE, "finish_reason": "length", "token_ids": [1, 2]}
        ],
        "prompt_token_ids": [9],
    }
    if usage:
        engine.answer["usage"] = {"prompt_tokens": 1, "completion_tokens": 2}
    path, body = CALLS["messages"]
    answer = proxied(gateway, path, {"model": "m", **body}).json()
    assert (answer["stop_reason"], answer["usage"]["output_tokens"]) == (
        "model_context_window_exceeded",
        2,
    )


def test_a_stream_the_relay_fails_after_its_start_is_recorded_failed_not_abandoned(
    gateway: Gateway, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the guarded reads (here: assembling the answer at the stream's end), a defect cuts
    the stream; the call used to be recorded as one the harness had left (499)."""

    def broken(self: object) -> dict[str, Any]:
        raise KeyError("a defect")

    monkeypatch.setattr("reins.gateway.wire.messages.Translation.assembled", broken)
    engine.chunks = [
        {
            "choices": [{"index": 0, "delta": MESSAGE, "token_ids": [7], "finish_reason": "stop"}],
            "prompt_token_ids": [1, 2],
        }
    ]
    path, body = CALLS["messages"]
    with pytest.raises(httpx.HTTPError):  # cut mid-stream: nothing else can be said
        proxied(gateway, path, {"model": "m", "stream": True, **body})
    (call,) = calls(gateway)
    assert (call["status"], call["abandoned"]) == (502, False), call
    assert "failed while relaying the engine's stream (KeyError: 'a defect')" in call["error"]


@pytest.mark.parametrize("api", list(CALLS))
def test_a_defect_anywhere_in_a_proxied_call_answers_in_the_apis_error_shape(
    gateway: Gateway, engine: Engine, api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was a bare `text/plain` "Internal Server Error", which no harness's SDK can show."""

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a defect")

    monkeypatch.setattr("reins.gateway.proxy.LLMProxy._open", broken)
    path, body = CALLS[api]
    answer = proxied(gateway, path, {"model": "m", **body})
    assert answer.status_code == 500
    assert "the gateway failed on this request (RuntimeError); its log says why" in answer.text
    assert "a defect" not in answer.text  # its text may hold a statement, a path, a value
    error = answer.json()["error"]
    if api == "messages":
        assert answer.json()["type"] == "error" and error["type"] == "api_error"
    elif api == "responses":
        assert set(error) == {"message", "type", "param", "code"}
