"""The `openai` SDK's Responses API, pointed at the gateway proxy in front of the embedded engine:
plain, streamed and tool-calling conversations (the history re-sent whole, `store=False`, as
Codex and the Agents SDK do) are recorded token for token as the SDK received them."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.harness.conftest import Received, Rollout

pytestmark = pytest.mark.slow

QUESTIONS = ["Name a colour.", "And another one?"]
MAX_TOKENS = 24

WEATHER_FUNCTION: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def few_shot_tool_use() -> list[dict[str, Any]]:
    """The engine tests' few-shot history (tests/embedded_support.py) as Responses input items:
    greedy decoding makes the default model answer with a `get_weather` call for Paris."""
    items: list[dict[str, Any]] = []
    for number, city in enumerate(["Rome", "Oslo"], start=1):
        items.append({"role": "user", "content": f"Weather in {city}?"})
        items.append(
            {
                "type": "function_call",
                "call_id": f"call_{number}",
                "name": "get_weather",
                "arguments": json.dumps({"city": city}),
            }
        )
    items.append({"role": "user", "content": "Weather in Paris?"})
    return items


def client(rollout: Rollout) -> openai.OpenAI:
    return openai.OpenAI(base_url=rollout.base_url, api_key=rollout.token, timeout=300)


def received_of(response: Any) -> Received:
    calls = [
        (item.name, item.arguments) for item in response.output if item.type == "function_call"
    ]
    text = response.output_text
    return Received.calls(text, calls) if calls else Received.text(text)


def test_plain_conversation(rollout: Rollout) -> None:
    sdk = client(rollout)
    history: list[Any] = []
    received = []
    for question in QUESTIONS:
        history.append({"role": "user", "content": question})
        response = sdk.responses.create(
            model="gpt-5.5",  # any name: the gateway routes it to the registered engine
            instructions="You answer in one short sentence.",
            input=history,
            max_output_tokens=MAX_TOKENS,
            store=False,
        )
        assert response.status in ("completed", "incomplete")
        received.append(received_of(response))
        history += [item.model_dump(exclude_none=True) for item in response.output]
    rollout.assert_recorded_as_received(received, kind="responses")
    first = rollout.calls()[0]
    assert first["request"]["instructions"] == "You answer in one short sentence."
    assert first["response"]["object"] == "response"


def test_streamed_conversation(rollout: Rollout) -> None:
    sdk = client(rollout)
    history: list[Any] = []
    received = []
    for question in QUESTIONS:
        history.append({"role": "user", "content": question})
        deltas: list[str] = []
        final: Any = None
        with sdk.responses.stream(
            model=rollout.model, input=history, max_output_tokens=MAX_TOKENS, store=False
        ) as stream:
            for event in stream:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                # `incomplete` when the answer reached max_output_tokens, as OpenAI's API says
                elif event.type in ("response.completed", "response.incomplete"):
                    final = event.response
        assert final is not None, "the stream ended without response.completed/incomplete"
        assert "".join(deltas) == final.output_text
        received.append(received_of(final))
        history += [item.model_dump(exclude_none=True) for item in final.output]
    rollout.assert_recorded_as_received(received, kind="responses")
    assert all(call["stream"] for call in rollout.calls())


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_tool_call_then_tool_result(val_rollout: Rollout, stream: bool) -> None:
    """`val` mode keeps the SDK's temperature 0, so the model's own tool call is certain."""
    sdk = client(val_rollout)
    history = few_shot_tool_use()
    first = sdk.responses.create(
        model=val_rollout.model,
        input=history,  # type: ignore[arg-type]
        tools=[WEATHER_FUNCTION],  # type: ignore[list-item]
        temperature=0,
        max_output_tokens=32,
        store=False,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"})
    if stream:
        with sdk.responses.stream(
            model=val_rollout.model,
            input=history,  # type: ignore[arg-type]
            tools=[WEATHER_FUNCTION],  # type: ignore[list-item]
            temperature=0,
            max_output_tokens=MAX_TOKENS,
            store=False,
        ) as events:
            second = events.get_final_response()
    else:
        second = sdk.responses.create(
            model=val_rollout.model,
            input=history,  # type: ignore[arg-type]
            tools=[WEATHER_FUNCTION],  # type: ignore[list-item]
            temperature=0,
            max_output_tokens=MAX_TOKENS,
            store=False,
        )
    val_rollout.assert_recorded_as_received(
        [received_of(first), received_of(second)], kind="responses"
    )
    # The tool result reached the engine as a tool turn of the same call.
    prompt = val_rollout.engine.engine.decode(val_rollout.calls()[1]["prompt_token_ids"])
    assert "<tool_response>\nSunny\n</tool_response>" in prompt


def test_bad_input_is_a_recorded_400_in_openai_shape(rollout: Rollout) -> None:
    sdk = client(rollout)
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.responses.create(
            model=rollout.model,
            input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}],
            store=False,
        )
    assert "nope" in str(raised.value)
    (call,) = rollout.calls()
    assert (call["status"], call["kind"]) == (400, "responses")
    assert "nope" in call["error"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_included_logprobs_are_the_recorded_policys(rollout: Rollout, stream: bool) -> None:
    """`include=["message.output_text.logprobs"]` with `top_logprobs`: the SDK's output text
    carries each answer token's logprob (the one recorded for training) and its alternatives."""
    sdk = client(rollout)
    fields: dict[str, Any] = {
        "model": rollout.model,
        "input": QUESTIONS[0],
        "max_output_tokens": MAX_TOKENS,
        "store": False,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    streamed: list[Any] = []
    if stream:
        final: Any = None
        with sdk.responses.stream(**fields) as events:
            for event in events:
                if event.type == "response.output_text.delta":
                    streamed += event.logprobs
                elif event.type in ("response.completed", "response.incomplete"):
                    final = event.response
        response = final
    else:
        response = sdk.responses.create(**fields)
    (message,) = [item for item in response.output if item.type == "message"]
    entries = message.content[0].logprobs
    (call,) = rollout.calls()
    assert [entry.logprob for entry in entries] == call["response_logprobs"]
    for entry in entries:
        alternatives = [top.logprob for top in entry.top_logprobs]
        assert len(alternatives) == 2 and alternatives == sorted(alternatives, reverse=True)
        assert entry.logprob <= alternatives[0] + 1e-6
    text = b"".join(bytes(entry.bytes) for entry in entries).decode()
    assert text.startswith(response.output_text)
    if stream:  # every entry came with a delta, but those of the tokens after the last text
        shown = [entry.model_dump() for entry in entries]
        assert [entry.model_dump() for entry in streamed] == shown[: len(streamed)]
        assert len(streamed) >= len(entries) - 1
