"""What a harness is answered through the proxy, and what is recorded of it, against a scripted
engine on loopback (STUBBED: the model; the gateway, its store and the SDKs are real): an
engine's retry headers on its errors, a stream's assembled record (`stop_reason`, reasoning),
token reuse on a failed call, and stream lines that are not UTF-8, not JSON or empty."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from reins.serving import BackgroundServer
from tests.conftest import Gateway

Handler = Callable[[Request, dict[str, Any]], Awaitable[Response]]
MESSAGES = [{"role": "user", "content": "hi"}]


class ScriptedEngine:
    """Answers each chat completion with `handler` (the request and its JSON body); keeps the
    bodies it was sent."""

    def __init__(self) -> None:
        self.handler: Handler | None = None
        self.requests: list[dict[str, Any]] = []

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        assert self.handler is not None
        return await self.handler(request, body)


@pytest.fixture
def engine(gateway: Gateway) -> Iterator[ScriptedEngine]:
    """The scripted engine registered as model `m`, rollout `r` created."""
    script = ScriptedEngine()
    routes = [Route("/v1/chat/completions", script.chat, methods=["POST"])]
    server = BackgroundServer(Starlette(routes=routes)).start()
    try:
        gateway.http.post("/api/models", json={"model": "m", "endpoint": f"{server.url}/v1"})
        gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
        yield script
    finally:
        server.stop()


def base(gateway: Gateway) -> str:
    return f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train"


def calls(gateway: Gateway) -> list[dict[str, Any]]:
    response = gateway.http.get("/api/rollouts/r/events", params={"type": "model_request"})
    assert response.status_code == 200, response.text
    return [event["data"] for event in response.json()]


def openai_client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base(gateway)}/openai/v1", api_key=gateway.api_key, max_retries=0
    )


def answer(content: str = "Hello", stop_reason: str | int | None = None) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": content},
        "token_ids": [72, 73],
        "logprobs": {"content": [{"token": "H", "logprob": -0.5}, {"token": "i", "logprob": -1}]},
        "finish_reason": "stop",
        "stop_reason": stop_reason,
    }
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "prompt_token_ids": [1, 2, 3], "choices": [choice]}  # fmt: skip


def chunks(content: list[str], stop_reason: str | int | None) -> list[dict[str, Any]]:
    """A vLLM-shaped chat stream: one chunk per piece of `content`, `stop_reason` null until the
    last chunk, which carries the finish reason."""
    out = []
    for position, piece in enumerate(content):
        last = position == len(content) - 1
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": piece}
            if position == 0
            else {"content": piece},
            "token_ids": [72 + position],
            "logprobs": {"content": [{"token": piece, "logprob": -0.5}]},
            "finish_reason": "stop" if last else None,
            "stop_reason": stop_reason if last else None,
        }
        chunk: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "created": 0,
                                 "model": "m", "choices": [choice]}  # fmt: skip
        if position == 0:
            chunk["prompt_token_ids"] = [1, 2, 3]
        out.append(chunk)
    return out


def sse(parts: list[bytes]) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        for part in parts:
            yield part
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


# -- an engine's retry headers ---------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize("status", [429, 503])
def test_an_engines_retry_after_on_its_error_reaches_the_harness(
    gateway: Gateway, engine: ScriptedEngine, api: str, status: int
) -> None:
    """vLLM behind a rate limiter (or an overloaded one) answers 429/503 with `Retry-After`: the
    SDKs wait that long before their retry, and without it retry at once into the same limit."""

    async def limited(request: Request, body: dict[str, Any]) -> Response:
        error = {"error": {"message": "too many requests", "type": "rate_limit", "code": status}}
        headers = {"Retry-After": "7", "retry-after-ms": "7000"}
        return JSONResponse(error, status, headers=headers)

    engine.handler = limited
    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as raised:
        if api == "messages":
            client = anthropic.Anthropic(
                base_url=f"{base(gateway)}/anthropic", api_key=gateway.api_key, max_retries=0
            )
            client.messages.create(model="m", max_tokens=16, messages=MESSAGES)  # type: ignore[arg-type]
        elif api == "responses":
            openai_client(gateway).responses.create(model="m", input="hi")
        else:
            openai_client(gateway).chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
    error = raised.value
    assert error.status_code == status
    assert "too many requests" in error.message
    assert error.response.headers.get("retry-after") == "7"
    assert error.response.headers.get("retry-after-ms") == "7000"
    (call,) = calls(gateway)
    assert call["status"] == status


# -- a stream's record -------------------------------------------------------------------------


@pytest.mark.parametrize("stop_reason", ["</tool_call>", 151643, None])
def test_a_streamed_calls_recorded_response_has_the_stop_reason_the_harness_was_sent(
    gateway: Gateway, engine: ScriptedEngine, stop_reason: str | int | None
) -> None:
    """The recorded `response` of a stream is the answer as one non-streamed response would be:
    the engine's `stop_reason` per choice, as the non-streamed record keeps it."""
    parts = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks(["Hel", "lo"], stop_reason)]

    async def either(request: Request, body: dict[str, Any]) -> Response:
        return sse(parts) if body.get("stream") else JSONResponse(answer(stop_reason=stop_reason))

    engine.handler = either
    client = openai_client(gateway)
    streamed = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))  # type: ignore[arg-type]
    sent = streamed[-1].choices[0].model_extra or {}
    assert sent.get("stop_reason") == stop_reason
    client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
    stream_call, plain_call = calls(gateway)
    assert stream_call["stream"] is True and plain_call["stream"] is False
    (stream_choice,) = stream_call["response"]["choices"]
    (plain_choice,) = plain_call["response"]["choices"]
    assert stream_choice["message"]["content"] == "Hello"
    assert stream_choice["stop_reason"] == plain_choice["stop_reason"] == stop_reason
    assert stream_call.get("stop_reason") == plain_call.get("stop_reason") == stop_reason


# -- token reuse on a call that failed ---------------------------------------------------------


@pytest.mark.parametrize("failure", [500, 429, 400])
def test_a_call_that_asked_for_token_reuse_and_failed_still_says_its_token_reuse(
    gateway: Gateway, engine: ScriptedEngine, failure: int
) -> None:
    """Every call of a gateway with reuse on has `token_reuse` (docs/proxy.md): a call sent the
    earlier call's tokens that the engine then failed had none."""
    statuses = [200, failure]

    async def first_ok(request: Request, body: dict[str, Any]) -> Response:
        status = statuses.pop(0)
        if status == 200:
            return JSONResponse(answer(), headers={"x-reins-token-reuse": "none"})
        return JSONResponse({"error": {"message": "engine says no", "code": status}}, status)

    engine.handler = first_ok
    client = openai_client(gateway)
    client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "more"},
    ]
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model="m", messages=history)  # type: ignore[arg-type]
    assert raised.value.status_code == failure
    assert engine.requests[1]["reins_prefix_token_ids"] == [1, 2, 3, 72, 73]  # it asked
    first, second = calls(gateway)
    assert first["token_reuse"] == "none"
    assert second["status"] == failure
    assert second.get("token_reuse") == "none"


def test_a_wire_call_refused_before_the_engine_says_its_token_reuse(
    gateway: Gateway, engine: ScriptedEngine
) -> None:
    """A Messages call the translation refuses is recorded as a failed call, with `token_reuse`
    as every chat-translated call of a gateway with reuse on."""
    reply = gateway.http.post(
        f"{base(gateway)}/anthropic/v1/messages",
        json={"model": 7, "max_tokens": 16, "messages": MESSAGES},
    )
    assert reply.status_code == 400, reply.text
    (call,) = calls(gateway)
    assert call["status"] == 400
    assert call.get("token_reuse") == "none"


# -- bytes that are not UTF-8 ------------------------------------------------------------------


def test_a_stream_line_with_a_byte_that_is_not_utf8_does_not_cut_the_answer(
    gateway: Gateway, engine: ScriptedEngine
) -> None:
    """An engine chunk with an invalid UTF-8 byte in its text (a character cut by a faulty
    detokenizer) reads as U+FFFD: the stream goes on to its end and is recorded whole."""
    first, second = chunks(["Hel", "lo"], None)
    broken = f"data: {json.dumps(first, ensure_ascii=False)}\n\n".encode()
    broken = broken.replace(b'"Hel"', b'"Hel\xff"')
    parts = [broken, f"data: {json.dumps(second)}\n\n".encode()]

    async def stream(request: Request, body: dict[str, Any]) -> Response:
        return sse(parts)

    engine.handler = stream
    client = openai_client(gateway)
    streamed = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))  # type: ignore[arg-type]
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == "Hel\ufffdlo"
    assert streamed[-1].choices[0].finish_reason == "stop"
    (call,) = calls(gateway)
    assert call["status"] == 200, call
    assert call["response_token_ids"] == [72, 73]
    assert call["response"]["choices"][0]["message"]["content"] == "Hel\ufffdlo"


# -- stream lines that are not chunks ----------------------------------------------------------


def test_a_stream_line_that_is_not_json_is_a_failed_call_not_a_recorded_answer(
    gateway: Gateway, engine: ScriptedEngine
) -> None:
    """The openai SDK raises on a `data:` line that is not JSON: the harness's call failed, so
    the record says so (502), as the Responses and Messages relays record it; it was passed on
    and the call recorded as a trainable answer."""
    first, second = chunks(["Hel", "lo"], None)
    parts = [
        f"data: {json.dumps(first)}\n\n".encode(),
        b'data: {"id": "c", "choi\n\n',
        f"data: {json.dumps(second)}\n\n".encode(),
    ]

    async def stream(request: Request, body: dict[str, Any]) -> Response:
        return sse(parts)

    engine.handler = stream
    client = openai_client(gateway)
    with pytest.raises(openai.APIError) as raised:
        list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))  # type: ignore[arg-type]
    assert "not a JSON object" in str(raised.value)
    (call,) = calls(gateway)
    assert call["status"] == 502, call
    assert "not a JSON object" in call["error"]
    assert call["response_token_ids"] == []


def test_an_empty_data_line_in_a_stream_is_skipped(
    gateway: Gateway, engine: ScriptedEngine
) -> None:
    """An empty `data:` line carries no chunk: dropped, the answer reaches the harness whole (the
    openai SDK raised on it when it was passed on)."""
    first, second = chunks(["Hel", "lo"], None)
    parts = [
        f"data: {json.dumps(first)}\n\n".encode(),
        b"data:\n\n",
        f"data: {json.dumps(second)}\n\n".encode(),
    ]

    async def stream(request: Request, body: dict[str, Any]) -> Response:
        return sse(parts)

    engine.handler = stream
    client = openai_client(gateway)
    streamed = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "Hello"
    (call,) = calls(gateway)
    assert call["status"] == 200, call
    assert call["response_token_ids"] == [72, 73]


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_a_streamed_answers_reasoning_is_recorded_under_the_name_the_harness_was_sent(
    gateway: Gateway, engine: ScriptedEngine, key: str
) -> None:
    """Newer vLLM streams and answers reasoning as `reasoning` (older as `reasoning_content`):
    the stream's record names it as the harness got it, as a plain answer's record does."""
    stream = chunks(["Hel", "lo"], None)
    stream[0]["choices"][0]["delta"] = {"role": "assistant", key: "think"}
    stream[0]["choices"][0]["token_ids"] = [80]
    stream[1]["choices"][0]["token_ids"] = [72, 73]
    stream[1]["choices"][0]["logprobs"]["content"] *= 2
    stream[1]["choices"][0]["delta"] = {"content": "Hello"}
    parts = [f"data: {json.dumps(c)}\n\n".encode() for c in stream]

    async def streamed(request: Request, body: dict[str, Any]) -> Response:
        return sse(parts)

    engine.handler = streamed
    client = openai_client(gateway)
    got = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))  # type: ignore[arg-type]
    assert (got[0].choices[0].delta.model_extra or {}).get(key) == "think"
    (call,) = calls(gateway)
    assert call["status"] == 200, call
    message = call["response"]["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Hello", key: "think"}
