"""The Anthropic Messages API through the gateway, as the real `anthropic` SDK sees it: what it
raises and what it assembles, compared with what Anthropic's API answers and with the recorded
call. STUBBED: the engine (the `engine` fixture: a scripted answer to each chat completion)."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
from pydantic import TypeAdapter

from tests.conftest import Gateway
from tests.gateway.conftest import Engine

MESSAGES: Any = [{"role": "user", "content": "hi"}]
ERROR_RESPONSE = TypeAdapter(anthropic.types.ErrorResponse)


def sdk(gateway: Gateway) -> anthropic.Anthropic:
    """The SDK on rollout `r`'s first attempt (opened by the admin key's first call)."""
    base = f"{gateway.url}/proxy/rollout/r/attempt/1/mode/val/anthropic"
    return anthropic.Anthropic(base_url=base, api_key=gateway.api_key, max_retries=0)


def recorded(gateway: Gateway) -> list[dict[str, Any]]:
    response = gateway.http.get("/api/rollouts/r/events", params={"type": "model_request"})
    assert response.status_code == 200, response.text
    return [event["data"] for event in response.json()]


def test_no_registered_model_is_anthropics_not_found_error(gateway: Gateway) -> None:
    """The proxy's own `model_not_found` code is no Anthropic error type: the SDK's
    `ErrorResponse` would not read it, nor would a harness that checks `error.type`."""
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    with pytest.raises(anthropic.NotFoundError) as raised:
        sdk(gateway).messages.create(model="m", max_tokens=8, messages=MESSAGES)
    error = ERROR_RESPONSE.validate_python(raised.value.body)
    assert error.error.type == "not_found_error"
    assert "no model is registered" in error.error.message


def tool_answer(arguments: str) -> dict[str, Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls", "token_ids": [7]}
    return {"id": "c", "object": "chat.completion", "prompt_token_ids": [1], "choices": [choice]}


def tool_chunks(arguments: str) -> list[dict[str, Any]]:
    """The call streamed as vLLM may: its leading whitespace, if any, in a delta of its own."""
    rest = arguments.lstrip()
    pieces = [arguments[: len(arguments) - len(rest)], rest]
    chunks = []
    for number, piece in enumerate(p for p in pieces if p):
        call = {"index": 0, "function": {"arguments": piece}}
        if number == 0:
            call = {**call, "id": "call_1", "function": {"name": "f", "arguments": piece}}
        choice = {"index": 0, "delta": {"tool_calls": [call]}, "token_ids": [7]}
        chunks.append({"id": "c", "object": "chat.completion.chunk", "choices": [choice]})
    chunks[0]["prompt_token_ids"] = [1]
    choice = {"index": 0, "delta": {}, "finish_reason": "tool_calls", "token_ids": []}
    return [*chunks, {"id": "c", "object": "chat.completion.chunk", "choices": [choice]}]


TOOLS: Any = [{"name": "f", "input_schema": {"type": "object"}}]


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize(
    ("arguments", "content"),
    [
        ('{"x": NaN}', [{"type": "text", "text": '{"x": NaN}'}]),
        ('\n {"x": 1}', [{"type": "tool_use", "id": "call_1", "name": "f", "input": {"x": 1}}]),
    ],
    ids=["nan", "leading-space"],
)
def test_tool_arguments_reach_the_sdk_as_recorded(
    gateway: Gateway, engine: Engine, streamed: bool, arguments: str, content: Any
) -> None:
    """Arguments with `NaN` (a model can write it; Python's `json` reads it) are no JSON object:
    shown as text, and recorded (before: a 400 for the plain call, a broken stream, nothing
    recorded). Arguments that start with whitespace reach the stream helper as an input it can
    parse (before: the SDK raised)."""
    engine.answer, engine.chunks = tool_answer(arguments), tool_chunks(arguments)
    client = sdk(gateway)
    if streamed:
        with client.messages.stream(model="m", max_tokens=8, messages=MESSAGES, tools=TOOLS) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(model="m", max_tokens=8, messages=MESSAGES, tools=TOOLS)
    assert [block.model_dump(exclude_none=True) for block in message.content] == content
    (call,) = recorded(gateway)
    assert (call["status"], call["error"]) == (200, None)  # a trainable call
    assert call["response"]["content"] == content


def test_a_strict_tool_reaches_the_engine_as_a_strict_function(
    gateway: Gateway, engine: Engine
) -> None:
    """Strict tool use (`strict: true`: the input must follow the schema) is the harness's
    constraint: the engine gets it as the chat function's `strict`, which vLLM enforces (it was
    dropped)."""
    engine.answer = tool_answer('{"x": 1}')
    tools: Any = [{**TOOLS[0], "strict": True}, {"name": "g", "input_schema": {"type": "object"}}]
    message = sdk(gateway).messages.create(model="m", max_tokens=8, messages=MESSAGES, tools=tools)
    assert message.stop_reason == "tool_use"
    functions = [tool["function"] for tool in engine.requests[-1]["tools"]]
    assert [(f["name"], f.get("strict")) for f in functions] == [("f", True), ("g", None)]
