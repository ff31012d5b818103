"""The proxy under the gateway's rules (issue #19): a closed attempt makes no more calls (409), a
request body or an engine answer that JSON cannot carry never reaches the store (a clean 4xx,
or a 502 recorded as a failed call), and an engine that answers a stream with something that is
not a stream is a recorded failure, not a silent pass-through."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import sqlalchemy as sa

from reins.gateway import GatewaySettings
from reins.gateway.admission import AdmissionGate
from reins.gateway.capture import SamplingPolicy
from reins.gateway.proxy import LLMProxy, UnrecordableAnswer
from reins.gateway.store import Conflict
from reins.gateway.store.sql import SqlStore
from reins.gateway.wire import messages as messages_api
from reins.schemas import AttemptCreate, ModelRequest, RolloutSpec, RolloutUpdate
from tests.conftest import ADMIN_KEY, Gateway, serve
from tests.stub_engine import StubEngine, encode

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def token(gateway: Gateway, stub: StubEngine) -> str:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    return str(gateway.http.post("/api/rollouts/r/attempts").json()["token"])


def chat_url(gateway: Gateway, attempt: int = 1) -> str:
    return f"{gateway.url}/proxy/rollout/r/attempt/{attempt}/mode/train/openai/v1/chat/completions"


def calls(gateway: Gateway, attempt: int = 1) -> list[dict[str, Any]]:
    response = gateway.http.get(
        "/api/rollouts/r/events", params={"attempt_id": attempt, "type": "model_request"}
    )
    assert response.status_code == 200, response.text
    return [event["data"] for event in response.json()]


def assert_still_readable(gateway: Gateway) -> None:
    for path in ("/api/rollouts?status=running", "/api/rollouts/r", "/ui", "/ui/rows"):
        response = gateway.http.get(path)
        assert response.status_code == 200, (path, response.text[:300])
    assert gateway.http.get("/ui/rollouts/r").status_code == 200


def post(gateway: Gateway, key: str, body: bytes | dict[str, Any], attempt: int = 1) -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        chat_url(gateway, attempt),
        content=content,
        headers={"Authorization": f"Bearer {key}", "content-type": "application/json"},
        timeout=30,
    )


# -- closed attempts --------------------------------------------------------------------------


def call_first(gateway: Gateway, token: str, earlier_calls: int) -> None:
    """Calls made while the attempt is open (a gateway on SQLite then knows it open and checks
    the next calls without a query, until something closes it)."""
    for _ in range(earlier_calls):
        assert post(gateway, token, {"messages": MESSAGES}).status_code == 200


@pytest.mark.parametrize("earlier_calls", [0, 2])
@pytest.mark.parametrize("state", ["succeeded", "failed"])
@pytest.mark.parametrize("caller", ["token", "admin"])
def test_a_call_for_a_terminal_rollout_is_409(
    gateway: Gateway, token: str, state: str, caller: str, earlier_calls: int
) -> None:
    call_first(gateway, token, earlier_calls)
    gateway.http.patch("/api/rollouts/r", json={"status": {"state": state}})
    response = post(
        gateway, token if caller == "token" else gateway.api_key, {"messages": MESSAGES}
    )
    assert response.status_code == 409, response.text
    assert f"rollout r is {state}" in response.json()["error"]["message"]
    assert len(calls(gateway)) == earlier_calls


@pytest.mark.parametrize("earlier_calls", [0, 2])
def test_a_call_on_a_superseded_attempt_is_409(
    gateway: Gateway, token: str, earlier_calls: int
) -> None:
    call_first(gateway, token, earlier_calls)
    gateway.http.post("/api/rollouts/r/attempts", json={"reason": "agent crashed"})
    response = post(gateway, token, {"messages": MESSAGES})
    assert response.status_code == 409, response.text
    message = response.json()["error"]["message"]
    assert "attempt 1 of rollout r was superseded by attempt 2" in message
    assert len(calls(gateway, 1)) == earlier_calls and calls(gateway, 2) == []


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_the_sdks_do_not_retry_a_call_on_a_closed_attempt(
    gateway: Gateway, token: str, api: str
) -> None:
    """The SDKs retry a 409 (twice by default, with back-off) unless told it cannot succeed."""
    gateway.http.patch("/api/rollouts/r", json={"status": {"state": "succeeded"}})
    sent: list[str] = []
    hooks: Any = {"request": [lambda request: sent.append(request.url.path)]}
    base = f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train"
    with pytest.raises((openai.ConflictError, anthropic.ConflictError)):
        if api == "messages":  # its own HTTP client class (the SDK refuses httpx's)
            http = anthropic.DefaultHttpxClient(event_hooks=hooks)
            sdk = anthropic.Anthropic(base_url=f"{base}/anthropic", api_key=token, http_client=http)
            sdk.messages.create(model="m", messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
        else:
            http = openai.DefaultHttpxClient(event_hooks=hooks)
            chat = openai.OpenAI(base_url=f"{base}/openai/v1", api_key=token, http_client=http)
            if api == "chat":
                chat.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
            else:
                chat.responses.create(model="m", input="hi", store=False)
    assert len(sent) == 1, sent


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_the_sdks_do_not_retry_a_call_whose_attempt_closed_while_it_ran(
    gateway: Gateway, token: str, stub: StubEngine, api: str
) -> None:
    """The 409 of a call whose attempt was superseded while the engine answered it says so as
    the door's 409 does (`x-should-retry: false`): the SDKs sent it again, to meet that 409."""
    stub.app.state.hold = "engine"
    sent: list[str] = []
    hooks: Any = {"request": [lambda request: sent.append(request.url.path)]}
    base = f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train"
    failures: list[Exception] = []

    def call() -> None:
        try:
            if api == "messages":
                http = anthropic.DefaultHttpxClient(event_hooks=hooks)
                sdk = anthropic.Anthropic(
                    base_url=f"{base}/anthropic", api_key=token, http_client=http
                )
                sdk.messages.create(model="m", messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
            else:
                http = openai.DefaultHttpxClient(event_hooks=hooks)
                chat = openai.OpenAI(base_url=f"{base}/openai/v1", api_key=token, http_client=http)
                if api == "chat":
                    chat.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
                else:
                    chat.responses.create(model="m", input="hi", store=False)
        except Exception as error:
            failures.append(error)

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 30
    while not stub.requests:
        assert time.monotonic() < deadline, "the call never reached the engine"
        time.sleep(0.01)
    gateway.http.post("/api/rollouts/r/attempts", json={"reason": "agent timed out"})
    stub.release("engine")
    caller.join(timeout=60)
    assert not caller.is_alive()
    (failure,) = failures
    assert isinstance(failure, (openai.ConflictError, anthropic.ConflictError)), failure
    assert "was superseded" in str(failure)
    assert len(sent) == 1, sent
    assert calls(gateway, 1) == []


def failed_response_stream(client: openai.OpenAI, on_event: Callable[[str], object]) -> Any:
    """A streamed Responses call that must end in `response.failed` (never `completed`): the
    failed response; `on_event` sees each event's type."""
    failed = []
    with (
        pytest.raises(RuntimeError, match=r"response\.completed"),
        client.responses.stream(model="policy", input="hi") as events,
    ):
        for event in events:
            on_event(event.type)
            if event.type == "response.failed":
                failed.append(event.response)
        events.get_final_response()
    assert len(failed) == 1
    return failed[0]


@pytest.mark.parametrize("earlier_calls", [0, 1])
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_a_stream_whose_attempt_closes_before_its_end_ends_in_an_error_in_each_api(
    gateway: Gateway, token: str, stub: StubEngine, api: str, earlier_calls: int
) -> None:
    """The attempt is superseded once the harness has its first streamed event; the answer
    is then not recorded, and every wire API's stream must say so at its end (not close as a
    complete answer the harness would go on with)."""
    call_first(gateway, token, earlier_calls)
    stub.app.state.chunk_delay_s = 0.3  # five chunks: the close lands before the last
    base = chat_url(gateway).removesuffix("/openai/v1/chat/completions")
    seen: list[str] = []

    def close_after_first_event(kind: str) -> None:
        seen.append(kind)
        if len(seen) == 1:
            gateway.http.post("/api/rollouts/r/attempts", json={"reason": "agent timed out"})

    if api == "chat":
        client = openai.OpenAI(base_url=f"{base}/openai/v1", api_key=token, max_retries=0)
        with pytest.raises(openai.APIError, match="this answer was not recorded"):
            stream = client.chat.completions.create(model="policy", messages=MESSAGES, stream=True)
            for chunk in stream:
                close_after_first_event(chunk.object)
    elif api == "messages":
        messages = anthropic.Anthropic(base_url=f"{base}/anthropic", api_key=token, max_retries=0)
        with (
            pytest.raises(anthropic.APIError, match="this answer was not recorded"),
            messages.messages.stream(model="policy", max_tokens=64, messages=MESSAGES) as events,
        ):
            for event in events:
                close_after_first_event(event.type)
    else:
        client = openai.OpenAI(base_url=f"{base}/openai/v1", api_key=token, max_retries=0)
        failed = failed_response_stream(client, close_after_first_event)
        assert seen[-1] == "response.failed" and "response.completed" not in seen
        assert failed.status == "failed" and failed.error is not None
        assert "this answer was not recorded" in failed.error.message
    assert len(seen) > 1
    assert len(calls(gateway, 1)) == earlier_calls and calls(gateway, 2) == []


def test_an_open_attempt_still_calls(gateway: Gateway, token: str) -> None:
    assert post(gateway, token, {"messages": MESSAGES}).status_code == 200
    assert len(calls(gateway)) == 1


# -- request bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1e400}', "top_p"),
        (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "x": '
            + b"[" * 10_000
            + b"]" * 10_000
            + b"}",
            "body",
        ),
    ],
    ids=["nan", "overflow", "surrogate", "deep"],
)
def test_a_body_json_cannot_carry_is_a_clean_400_naming_the_field(
    gateway: Gateway, token: str, raw: bytes, field: str
) -> None:
    response = post(gateway, token, raw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"]
    assert error["type"] in ("invalid_request_error", "invalid_json")
    assert_still_readable(gateway)


# -- engine answers ---------------------------------------------------------------------------


def _completion(logprob: str, content: str = '"hi"') -> str:
    """A chat completion as an engine would send it, with one raw logprob and content text."""
    tokens = encode("hi")
    return (
        '{"id": "c", "object": "chat.completion", "created": 0, "model": "policy",'
        ' "prompt_token_ids": [1, 2, 3],'
        ' "choices": [{"index": 0, "finish_reason": "stop", "token_ids": ' + json.dumps(tokens)
        + ', "message": {"role": "assistant", "content": ' + content + "},"
        ' "logprobs": {"content": [{"token": "h", "logprob": -0.5}, {"token": "i", "logprob": '
        + logprob + "}]}}],"
        ' "usage": {"prompt_tokens": 3, "completion_tokens": 2}}'
    )  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (_completion("NaN"), "choices.0.logprobs.content.1.logprob"),
        (_completion("-Infinity"), "choices.0.logprobs.content.1.logprob"),
        (_completion("-1e400"), "choices.0.logprobs.content.1.logprob"),
        (_completion("-0.1", '"h\\udc00"'), "choices.0.message.content"),
    ],
    ids=["nan", "infinity", "overflow", "surrogate"],
)
def test_an_engine_answer_json_cannot_carry_is_a_recorded_502(
    gateway: Gateway, token: str, raw: str, field: str
) -> None:
    assert json.loads(_completion("-0.1"))  # the same answer with a finite logprob is JSON
    response = post(gateway, token, {"messages": MESSAGES, "stub_raw": raw})
    assert response.status_code == 502, response.text
    assert field in response.json()["error"]["message"]
    (call,) = calls(gateway)
    assert call["status"] == 502
    assert field in call["error"]
    assert not call["response_token_ids"] and call["response_logprobs"] in (None, [])
    assert_still_readable(gateway)


@pytest.mark.parametrize(
    "ids", ['["a", 104]', "[1.5, 104]", "[null, 104]", "[-1, 104]", "[1099511627776, 104]",
            "[true, 104]", '{"x": 1}', "[1180591620717411303424, 104]"],
)  # fmt: skip
def test_engine_token_ids_that_are_not_token_ids_are_recorded_untrainable(
    gateway: Gateway, token: str, ids: str
) -> None:
    """The harness gets its answer (as from an engine that returned no token IDs); the record
    says why it cannot be trained on and holds no such IDs; the next call is served and
    reused as usual."""
    raw = _completion("-0.1").replace('"prompt_token_ids": [1, 2, 3]', f'"prompt_token_ids": {ids}')
    logprob_is_text = _completion("-0.1").replace('"logprob": -0.1', '"logprob": "low"')
    response = post(gateway, token, {"messages": MESSAGES, "stub_raw": raw})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "hi"
    (call,) = calls(gateway)
    assert (call["prompt_token_ids"], call["response_token_ids"]) == ([], [])
    assert "not ints from 0 to 2**31 - 1" in call["error"]
    # A logprob that is not a number: the tokens are kept, the logprobs are unknown.
    assert (
        post(gateway, token, {"messages": MESSAGES, "stub_raw": logprob_is_text}).status_code == 200
    )
    assert calls(gateway)[1]["response_logprobs"] is None
    assert post(gateway, token, {"messages": MESSAGES}).status_code == 200
    assert calls(gateway)[2]["prompt_token_ids"] and not calls(gateway)[2]["error"]
    assert_still_readable(gateway)


def test_a_stream_answered_without_sse_is_a_recorded_failure(gateway: Gateway, token: str) -> None:
    response = post(
        gateway, token, {"messages": MESSAGES, "stream": True, "stub_raw": "not a stream"}
    )
    assert response.status_code == 502, response.text
    assert "not a stream" in response.text or "event-stream" in response.text
    (call,) = calls(gateway)
    assert call["status"] == 502
    assert call["error"]


def _sse_engine(chunks: list[str]) -> Any:
    """An engine whose chat stream is these `data:` payloads, as raw text (NaN included)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from reins.serving import BackgroundServer

    async def chat(_: Request) -> StreamingResponse:
        async def lines() -> Any:
            for chunk in chunks:
                yield f"data: {chunk}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(lines(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    return BackgroundServer(app).start()


def test_a_streamed_chunk_json_cannot_carry_ends_the_stream_as_a_recorded_failure(
    gateway: Gateway,
) -> None:
    logprobs = {"content": [{"token": "h", "logprob": -0.5}]}
    delta = {"role": "assistant", "content": "h"}
    first = {
        "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "delta": delta, "token_ids": [104], "logprobs": logprobs}],
    }  # fmt: skip
    bad = json.dumps(first).replace("-0.5", "NaN").replace('"h"', '"i"')
    engine = _sse_engine([json.dumps(first), bad])
    try:
        gateway.http.post("/api/models", json={"model": "m", "endpoint": f"{engine.url}/v1"})
        gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
        token = gateway.http.post("/api/rollouts/r/attempts").json()["token"]
        response = post(gateway, token, {"messages": MESSAGES, "stream": True})
    finally:
        engine.stop()
    assert response.status_code == 200  # the stream had started
    assert "choices.0.logprobs.content.0.logprob" in response.text
    assert "NaN" not in response.text.replace("NaN, Infinity", "")
    (call,) = calls(gateway)
    assert call["status"] == 502
    assert "choices.0.logprobs.content.0.logprob" in call["error"]
    assert_still_readable(gateway)


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_a_stream_whose_record_the_database_fails_ends_in_an_error_in_each_api(
    gateway: Gateway, token: str, stub: StubEngine, api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database fails the streamed call's record (a lock held elsewhere, a full disk, a
    writer process killed): the stream has begun, so its end says so in the API's shape, where
    the connection was cut mid-stream before (the SDKs then reported a protocol error)."""

    async def refused(*_: Any) -> None:
        raise sa.exc.OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))

    monkeypatch.setattr(SqlStore, "record_calls", refused)
    base = chat_url(gateway).removesuffix("/openai/v1/chat/completions")
    expected = r"could not store this call.s record \(.*database is locked"
    kinds: list[str] = []
    if api == "chat":
        client = openai.OpenAI(base_url=f"{base}/openai/v1", api_key=token, max_retries=0)
        with pytest.raises(openai.APIError, match=expected):
            for chunk in client.chat.completions.create(
                model="policy", messages=MESSAGES, stream=True
            ):
                kinds.append(chunk.object)
    elif api == "messages":
        messages = anthropic.Anthropic(base_url=f"{base}/anthropic", api_key=token, max_retries=0)
        with (
            pytest.raises(anthropic.APIError, match=expected) as raised,
            messages.messages.stream(model="policy", max_tokens=64, messages=MESSAGES) as events,
        ):
            for event in events:
                kinds.append(event.type)
        # 503, as Anthropic types it (not the 409 of a closed attempt).
        assert raised.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    else:
        client = openai.OpenAI(base_url=f"{base}/openai/v1", api_key=token, max_retries=0)
        failed = failed_response_stream(client, kinds.append)
        assert kinds[-1] == "response.failed"
        assert failed.error is not None and "database is locked" in failed.error.message
    assert kinds  # the stream had begun


# -- what the gateway records and answers ------------------------------------------------------


def _wire_post(gateway: Gateway, token: str, api: str, extra: dict[str, Any]) -> httpx.Response:
    paths = {
        "chat": ("openai/v1/chat/completions", {"messages": MESSAGES}),
        "responses": ("openai/v1/responses", {"input": "hi"}),
        "messages": ("anthropic/v1/messages", {"messages": MESSAGES, "max_tokens": 16}),
    }
    path, body = paths[api]
    return httpx.post(
        f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train/{path}",
        json={"model": "policy", **body, **extra},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize(
    "message",
    [
        "bad \ud800 thing",
        "This model's maximum context length is 10 tokens. However, your request has 20 input "
        "tokens \ud800",
    ],
    ids=["error", "overflow"],
)
def test_an_engine_error_quoting_a_lone_surrogate_reaches_the_harness_escaped(
    gateway: Gateway, token: str, stub: StubEngine, api: str, message: str
) -> None:
    """The engine's message escapes a lone surrogate, which has no UTF-8 form: the answer
    carries the escape as the engine wrote it (it was a bare 500 on Responses and Messages, and
    on chat for a prompt too long), and the call is recorded."""
    stub.app.state.error = (400, message)
    for stream in (False, True):
        response = _wire_post(gateway, token, api, {"stream": stream})
        assert response.status_code == 400, response.text
        assert "\\ud800" in response.text
        body = response.json()
        said = body["error"]["message"] if "error" in body else body["message"]  # vLLM's shape
        assert "\ud800" in said
    assert [call["status"] for call in calls(gateway)] == [400, 400]
    assert_still_readable(gateway)


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_body_nested_past_what_its_record_can_hold_is_refused_before_the_engine(
    gateway: Gateway, token: str, stub: StubEngine, api: str
) -> None:
    """A proxied request is stored one level down in its call's record: at 200 levels of its
    own the engine used to run it and the record was then refused (a 400 naming an event post,
    or a stream cut after its answer), nothing recorded."""
    where = {"messages": ("metadata", "x")}.get(api, ("x",))

    def nested(levels: int) -> dict[str, Any]:
        value: Any = json.loads("[" * levels + "]" * levels)
        for key in reversed(where):
            value = {key: value}
        return value

    kept = _wire_post(gateway, token, api, nested(200 - len(where)))
    assert kept.status_code == 200, kept.text
    engine_calls = len(stub.app.state.requests)
    for stream in (False, True):
        refused = _wire_post(gateway, token, api, {**nested(201 - len(where)), "stream": stream})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert f"body.{'.'.join(where)}.0.0" in error["message"]
        assert "more than 199 levels" in error["message"]
    assert len(stub.app.state.requests) == engine_calls
    assert [call["status"] for call in calls(gateway)] == [200]


def _tool_call_answer(arguments: str) -> str:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return json.dumps(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "policy",
            "prompt_token_ids": [1, 2, 3],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "token_ids": [4, 5],
                    "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        }
    )


def test_a_custom_tool_input_json_cannot_carry_is_passed_on_as_the_engine_wrote_it(
    gateway: Gateway, token: str, stub: StubEngine
) -> None:
    """The engine's arguments escape a lone surrogate in `input`: decoded, no answer can carry
    it (the call was answered 400 naming an event post and not recorded); it is answered as the
    arguments' text, as Messages answers such a tool call, and recorded."""
    arguments = '{"input": "\\ud800"}'
    stub.app.state.raw = _tool_call_answer(arguments)
    tools = [{"type": "custom", "name": "f"}]
    response = _wire_post(gateway, token, "responses", {"tools": tools})
    assert response.status_code == 200, response.text
    (item,) = response.json()["output"]
    assert (item["type"], item["input"]) == ("custom_tool_call", arguments)
    (call,) = calls(gateway)
    assert call["status"] == 200
    assert call["response"]["output"][0]["input"] == arguments


async def test_an_answer_its_record_cannot_hold_is_recorded_as_a_failed_call(
    tmp_path: Path,
) -> None:
    """The proxy's net under every wire conversion: an answer that breaks the record's JSON
    rule (none is known now; the custom tool input above was one) is recorded as a failed call
    (502) and the harness told so, not refused as if its request were bad."""
    store = SqlStore(f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}")
    await store.init()
    try:
        await store.create_rollouts([RolloutSpec(rollout_id="r")])
        await store.open_attempt("r", AttemptCreate())
        proxy = LLMProxy(store, AdmissionGate(10.0), {})
        observed: list[int] = []
        proxy.on_record = lambda call: observed.append(call.status)
        record = ModelRequest(
            request={"model": "policy", "input": "hi"},
            response={"output": [{"type": "custom_tool_call", "input": "\ud800"}]},
            prompt_token_ids=[1, 2],
            response_token_ids=[3],
            status=200,
        )
        with pytest.raises(UnrecordableAnswer, match=r"response\.output\.0\.input"):
            await proxy._record("r", 1, [record])
        (event,) = await store.get_events("r")
        assert event.data["status"] == 502
        assert "the engine's answer cannot be recorded" in event.data["error"]
        assert event.data["request"] == record.request
        assert (event.data["response"], event.data["response_token_ids"]) == ({}, [])
        assert observed == [502]  # the metrics count it as recorded, not as the engine's 200
        await store.update_rollout(
            "r", RolloutUpdate.model_validate({"status": {"state": "succeeded"}})
        )
        with pytest.raises(Conflict):
            await proxy._record("r", 1, [record.model_copy(update={"response": {}})])
        assert observed == [502]  # nor a call its closed attempt refused
    finally:
        await store.close()


@pytest.mark.parametrize("api", ["chat", "messages"])
async def test_a_call_cancelled_while_its_model_is_looked_up_leaves_the_admission_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, api: str
) -> None:
    """A harness that hangs up while its admitted call reads the model registry (a store read,
    slow while the database is busy) cancels the call there: its admission slot must be given
    back, or every later drain of the gate (the trainer's, before each weight update) waits for
    a call that no longer exists."""
    store = SqlStore(f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}")
    await store.init()
    gate = AdmissionGate(10.0)
    proxy = LLMProxy(store, gate, {"train": SamplingPolicy()})
    looking, never = asyncio.Event(), asyncio.Event()

    async def slow_models() -> list[Any]:
        looking.set()
        await never.wait()
        return []

    monkeypatch.setattr(store, "list_models", slow_models)
    try:
        if api == "chat":
            work = proxy.forward("chat", "r", 1, "train", {"messages": MESSAGES})
        else:
            body = {"model": "m", "max_tokens": 8, "messages": MESSAGES}
            work = proxy.forward_wire(messages_api, "r", 1, "train", body)
        call = asyncio.ensure_future(work)
        await asyncio.wait_for(looking.wait(), 10)
        assert gate.status().in_flight == 1
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        assert gate.status().in_flight == 0
        assert await gate.drain(timeout_s=1)
    finally:
        await proxy.close()
        await store.close()


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_stream_left_while_the_database_is_down_still_frees_its_slot(
    gateway_settings: GatewaySettings,
    stub: StubEngine,
    monkeypatch: pytest.MonkeyPatch,
    api: str,
) -> None:
    """The record of a stream whose harness left cannot be written while the database is down:
    that failure must not keep the stream's admission slot (every later drain would wait for
    it) nor its engine connection."""
    # 250 chunks, 25 s: the harness leaves long before the stream's end.
    stub.app.state.reply, stub.app.state.chunk_delay_s = "word " * 200, 0.1
    with serve(gateway_settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        admin.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
        admin.post("/api/rollouts", json=[{"rollout_id": "r"}])
        token = admin.post("/api/rollouts/r/attempts").json()["token"]
        store = server.server.config.app.state.proxy.store

        async def database_down(*_: Any, **__: Any) -> None:
            raise ConnectionError("the database is down")

        base = f"{url}/proxy/rollout/r/attempt/1/mode/train"
        if api == "chat":
            path, body = "/openai/v1/chat/completions", {"messages": MESSAGES, "stream": True}
        else:
            path = "/anthropic/v1/messages"
            body = {"model": "policy", "max_tokens": 64, "messages": MESSAGES, "stream": True}
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.stream("POST", base + path, json=body, headers=headers, timeout=30) as response:
            assert response.status_code == 200
            next(response.iter_lines())
            monkeypatch.setattr(store, "record_calls", database_down)
        deadline = time.monotonic() + 10
        while admin.get("/api/admission").json()["in_flight"] != 0:
            assert time.monotonic() < deadline, "the stream kept its admission slot"
            time.sleep(0.05)
        admin.close()
