"""A call that did not end in an answer is a failed call in every API: the harness gets an error
in its API's own shape, and the call is recorded as failed (status 502, its error, no tokens),
never as a trainable answer. The engine here is scripted (`Script`): it streams chunks and
then ends, breaks off, stalls or sends an error; or answers a body that breaks off or stalls.
The harnesses are the real openai and anthropic SDKs."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import anthropic
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from reins.gateway import GatewaySettings
from reins.serving import BackgroundServer
from tests.conftest import ADMIN_KEY, Gateway

MESSAGES = [{"role": "user", "content": "hi"}]
Ending = Literal["done", "closed", "cut", "stall"]
READ_TIMEOUT_S = 2.0
"""Long enough that a loaded machine answers in time when the script does not stall (0.5 s failed
a fresh-clone CI once, on PostgreSQL, where no stall was scripted)."""


@dataclass
class Script:
    """What the engine answers next: `chunks` streamed (or `body` sent, for a plain call), then
    `ending`: done (`[DONE]`), closed (the connection closes cleanly, no `[DONE]`), cut (the
    connection breaks), stall (past the read timeout)."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    body: bytes = b""
    ending: Ending = "done"


def first_chunk(content: str = "Hel", index: int = 0) -> dict[str, Any]:
    logprobs = {"content": [{"token": "h", "logprob": -0.5, "top_logprobs": []}]}
    choice = {
        "index": index,
        "delta": {"role": "assistant", "content": content},
        "token_ids": [72],
        "logprobs": logprobs,
        "finish_reason": None,
    }
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "prompt_token_ids": [1, 2, 3],
        "choices": [choice],
    }


ENGINE_ERROR = {"error": {"message": "engine died midway", "type": "InternalServerError"}}


def plain_answer(*finish_reasons: str | None) -> dict[str, Any]:
    """A non-streamed chat answer with one choice per finish reason."""
    choices = [
        {
            "index": index,
            "message": {"role": "assistant", "content": "Hello"},
            "token_ids": [72],
            "finish_reason": finish_reason,
        }
        for index, finish_reason in enumerate(finish_reasons)
    ]
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "prompt_token_ids": [1, 2, 3], "choices": choices}  # fmt: skip


UNFINISHED = plain_answer(None)
"""A truncated answer: the engine's one choice has no finish reason."""


@pytest.fixture
def gateway_settings(database_url: str) -> GatewaySettings:
    return GatewaySettings(
        database_url=database_url,
        api_key=ADMIN_KEY,
        proxy_read_timeout_s=READ_TIMEOUT_S,
        proxy_retries=0,
    )


@pytest.fixture
def script() -> Iterator[Script]:
    yield Script()


@pytest.fixture
def token(gateway: Gateway, script: Script) -> Iterator[str]:
    async def chat(request: Request) -> Response:
        streamed = (await request.json()).get("stream")
        parts = [f"data: {json.dumps(c)}\n\n".encode() for c in script.chunks] if streamed else []

        async def body() -> AsyncIterator[bytes]:
            for part in parts or [script.body]:
                yield part
            if script.ending == "cut":
                raise RuntimeError("the engine's connection breaks")
            if script.ending == "stall":
                await asyncio.sleep(10 * READ_TIMEOUT_S)
            if streamed and script.ending == "done":
                yield b"data: [DONE]\n\n"

        media = "text/event-stream" if streamed else "application/json"
        return StreamingResponse(body(), media_type=media)

    with attempt_on_engine(gateway, chat) as attempt_token:
        yield attempt_token


@contextlib.contextmanager
def attempt_on_engine(
    gateway: Gateway, chat: Callable[[Request], Awaitable[Response]]
) -> Iterator[str]:
    """An engine serving chat completions with `chat`, registered as model `m`; rollout `r`'s
    first attempt open: its token."""
    routes = [Route("/v1/chat/completions", chat, methods=["POST"])]
    engine = BackgroundServer(Starlette(routes=routes)).start()
    try:
        gateway.http.post("/api/models", json={"model": "m", "endpoint": f"{engine.url}/v1"})
        gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
        yield str(gateway.http.post("/api/rollouts/r/attempts").json()["token"])
    finally:
        engine.stop()


def calls(gateway: Gateway) -> list[dict[str, Any]]:
    response = gateway.http.get("/api/rollouts/r/events", params={"type": "model_request"})
    assert response.status_code == 200, response.text
    return [event["data"] for event in response.json()]


def base(gateway: Gateway) -> str:
    return f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train"


def streamed_failure(gateway: Gateway, token: str, api: str) -> str:
    """Streams one call in `api` with its SDK; the error the harness was told."""
    if api == "messages":
        # No retries, as the other clients here: a retry would record a second call.
        client = anthropic.Anthropic(
            base_url=f"{base(gateway)}/anthropic", api_key=token, max_retries=0
        )
        with pytest.raises(anthropic.APIError) as raised:
            for _ in client.messages.create(
                model="m", max_tokens=16, messages=MESSAGES, stream=True
            ):
                pass
        body = raised.value.body  # type: ignore[attr-defined]
        return str(body["error"]["message"])
    client_ = openai.OpenAI(base_url=f"{base(gateway)}/openai/v1", api_key=token, max_retries=0)
    if api == "chat":
        with pytest.raises(openai.APIError) as failed:
            for _ in client_.chat.completions.create(model="m", messages=MESSAGES, stream=True):
                pass
        return str(failed.value)
    events = list(client_.responses.create(model="m", input="hi", stream=True))
    kinds = [event.type for event in events]
    assert kinds[-1] == "response.failed" and "response.completed" not in kinds, kinds
    error = events[-1].response.error  # type: ignore[union-attr]
    assert error is not None
    return error.message


def plain_failure(gateway: Gateway, token: str, api: str) -> tuple[int, str]:
    """One non-streamed call in `api` with its SDK: the error status and message it raised."""
    try:
        if api == "messages":
            client = anthropic.Anthropic(
                base_url=f"{base(gateway)}/anthropic", api_key=token, max_retries=0
            )
            client.messages.create(model="m", max_tokens=16, messages=MESSAGES)
        else:
            client_ = openai.OpenAI(
                base_url=f"{base(gateway)}/openai/v1", api_key=token, max_retries=0
            )
            if api == "chat":
                client_.chat.completions.create(model="m", messages=MESSAGES)
            else:
                client_.responses.create(model="m", input="hi")
    except (anthropic.APIStatusError, openai.APIStatusError) as error:
        return error.status_code, error.message
    raise AssertionError(f"the {api} call did not fail")


def assert_one_failed_call(gateway: Gateway, api: str, says: str) -> None:
    (call,) = calls(gateway)
    assert call["status"] == 502, call
    assert says in call["error"]
    assert call["kind"] == api
    assert call["response_token_ids"] == [] and call["response_logprobs"] is None
    assert call["finish_reason"] is None


APIS = ["chat", "responses", "messages"]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("ending", ["cut", "stall", "error"])
def test_a_stream_that_breaks_off_or_fails_midway_is_a_failed_call(
    gateway: Gateway, token: str, script: Script, api: str, ending: str
) -> None:
    script.chunks = [first_chunk()] + ([ENGINE_ERROR] if ending == "error" else [])
    script.ending = "done" if ending == "error" else ending  # type: ignore[assignment]
    says = "engine died midway" if ending == "error" else "the engine's stream broke off"
    assert says in streamed_failure(gateway, token, api)
    assert_one_failed_call(gateway, api, says)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("ending", ["cut", "stall"])
def test_a_plain_answer_that_breaks_off_after_its_headers_is_a_recorded_502(
    gateway: Gateway, token: str, script: Script, api: str, ending: Ending
) -> None:
    script.body, script.ending = b'{"id": "c", "choices": [', ending
    status, message = plain_failure(gateway, token, api)
    assert status == 502
    assert "broke off its answer" in message
    assert_one_failed_call(gateway, api, "broke off its answer")


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (ENGINE_ERROR, "engine died midway"),
        ({"id": "c", "choices": []}, "no choices"),
        (UNFINISHED, "no finish_reason for choice 0"),
    ],
    ids=["error", "no-choices", "no-finish-reason"],
)
def test_an_answer_that_is_an_error_empty_or_unfinished_is_a_recorded_error_in_each_api(
    gateway: Gateway, token: str, script: Script, api: str, answer: dict[str, Any], says: str
) -> None:
    script.body = json.dumps(answer).encode()
    status, message = plain_failure(gateway, token, api)
    assert status == 502 and says in message
    assert_one_failed_call(gateway, api, says)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(
    ("chunks", "says"), [([ENGINE_ERROR], "engine died midway"), ([], "no choices")],
    ids=["error-first", "no-chunks"],
)  # fmt: skip
def test_a_stream_that_is_an_error_or_empty_is_a_recorded_error_in_each_api(
    gateway: Gateway,
    token: str,
    script: Script,
    api: str,
    chunks: list[dict[str, Any]],
    says: str,
) -> None:
    script.chunks = chunks
    assert says in streamed_failure(gateway, token, api)
    assert_one_failed_call(gateway, api, says)


def last_chunk(index: int = 0) -> dict[str, Any]:
    choice = {"index": index, "delta": {}, "token_ids": [], "finish_reason": "stop"}
    return {"id": "c", "object": "chat.completion.chunk", "choices": [choice]}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("ending", ["done", "closed"])
def test_a_stream_that_ends_cleanly_without_a_finish_reason_is_a_failed_call(
    gateway: Gateway, token: str, script: Script, api: str, ending: Ending
) -> None:
    """A truncated answer: the engine stopped sending before its choice ended."""
    script.chunks, script.ending = [first_chunk()], ending
    says = "no finish_reason for choice 0"
    assert says in streamed_failure(gateway, token, api)
    assert_one_failed_call(gateway, api, says)


def test_a_chat_stream_with_one_of_its_n_choices_unfinished_is_a_failed_call(
    gateway: Gateway, token: str, script: Script
) -> None:
    script.chunks = [first_chunk(), last_chunk(), first_chunk(index=2), last_chunk(index=2)]
    client = openai.OpenAI(base_url=f"{base(gateway)}/openai/v1", api_key=token, max_retries=0)
    with pytest.raises(openai.APIError) as failed:
        for _ in client.chat.completions.create(model="m", messages=MESSAGES, stream=True, n=3):
            pass
    assert "no finish_reason for choice 1" in str(failed.value)
    assert_one_failed_call(gateway, "chat", "no finish_reason for choice 1")


@pytest.mark.parametrize(
    ("finish_reasons", "unfinished"), [(("stop", None), "1"), (("stop",), "1, 2")]
)
def test_a_plain_chat_answer_with_one_of_its_n_choices_unfinished_or_missing_is_a_failed_call(
    gateway: Gateway, token: str, script: Script, finish_reasons: tuple[str | None, ...],
    unfinished: str,
) -> None:  # fmt: skip
    script.body = json.dumps(plain_answer(*finish_reasons)).encode()
    client = openai.OpenAI(base_url=f"{base(gateway)}/openai/v1", api_key=token, max_retries=0)
    with pytest.raises(openai.APIError) as failed:
        client.chat.completions.create(model="m", messages=MESSAGES, n=3)
    says = f"no finish_reason for choice {unfinished}"
    assert says in str(failed.value)
    assert_one_failed_call(gateway, "chat", says)


def test_a_plain_chat_answer_whose_choices_all_finish_is_recorded_per_choice(
    gateway: Gateway, token: str, script: Script
) -> None:
    script.body = json.dumps(plain_answer("stop", "length")).encode()
    client = openai.OpenAI(base_url=f"{base(gateway)}/openai/v1", api_key=token, max_retries=0)
    answer = client.chat.completions.create(model="m", messages=MESSAGES, n=2)
    assert [choice.finish_reason for choice in answer.choices] == ["stop", "length"]
    recorded = sorted(calls(gateway), key=lambda call: call["choice_index"])
    assert [(c["status"], c["finish_reason"]) for c in recorded] == [(200, "stop"), (200, "length")]


def test_a_chat_stream_whose_n_choices_all_finish_is_recorded_per_choice(
    gateway: Gateway, token: str, script: Script
) -> None:
    script.chunks = [first_chunk(), first_chunk(index=1), last_chunk(1), last_chunk()]
    client = openai.OpenAI(base_url=f"{base(gateway)}/openai/v1", api_key=token, max_retries=0)
    streamed = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True, n=2))
    assert streamed[-1].choices[0].finish_reason == "stop"
    recorded = sorted(calls(gateway), key=lambda call: call["choice_index"])
    assert [(c["status"], c["finish_reason"], c["choice_index"]) for c in recorded] == [
        (200, "stop", 0),
        (200, "stop", 1),
    ]
    assert [c["response_token_ids"] for c in recorded] == [[72], [72]]
