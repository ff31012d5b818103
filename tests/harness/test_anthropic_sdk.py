"""The Anthropic SDK (Messages API), pointed at the gateway proxy in front of the embedded engine:
plain, streamed and tool-calling conversations are recorded token for token as the SDK received
them; token counting uses the engine's own tokenizer."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest

from tests.harness.conftest import Received, Rollout

pytestmark = pytest.mark.slow

QUESTIONS = ["Name a colour.", "And another one?"]
MAX_TOKENS = 24

WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def few_shot_tool_use() -> list[dict[str, Any]]:
    """The engine tests' few-shot history (tests/embedded_support.py) as Messages turns: calls
    whose results the model does not see (with them, the model imitates a tool result), and
    greedy decoding makes the default model call `get_weather` for Paris."""
    turns: list[dict[str, Any]] = []
    for number, city in enumerate(["Rome", "Oslo", "Paris"], start=1):
        turns.append({"role": "user", "content": f"Weather in {city}?"})
        if city != "Paris":
            block = {"type": "tool_use", "id": f"toolu_{number}", "name": "get_weather"}
            turns.append({"role": "assistant", "content": [{**block, "input": {"city": city}}]})
    return turns


def client(rollout: Rollout, *, bearer: bool = False) -> anthropic.Anthropic:
    if bearer:  # Claude Code's ANTHROPIC_AUTH_TOKEN: `Authorization: Bearer`
        return anthropic.Anthropic(
            base_url=rollout.anthropic_base_url, auth_token=rollout.token, timeout=300
        )
    return anthropic.Anthropic(
        base_url=rollout.anthropic_base_url, api_key=rollout.token, timeout=300
    )


def received_of(message: Any) -> Received:
    text = "".join(block.text for block in message.content if block.type == "text")
    calls = [
        (block.name, json.dumps(block.input))
        for block in message.content
        if block.type == "tool_use"
    ]
    return Received.calls(text, calls) if calls else Received.text(text)


def as_turn(message: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": [block.model_dump() for block in message.content]}


@pytest.mark.parametrize("bearer", [False, True], ids=["x-api-key", "bearer"])
def test_plain_conversation(rollout: Rollout, bearer: bool) -> None:
    sdk = client(rollout, bearer=bearer)
    history: list[Any] = []
    received = []
    for question in QUESTIONS:
        history.append({"role": "user", "content": question})
        message = sdk.messages.create(
            model="claude-opus-4-8",  # any name: the gateway routes it to the registered engine
            system=[{"type": "text", "text": "You answer in one short sentence."}],
            messages=history,
            max_tokens=MAX_TOKENS,
        )
        assert message.stop_reason in ("end_turn", "max_tokens")
        received.append(received_of(message))
        history.append(as_turn(message))
    rollout.assert_recorded_as_received(received, kind="messages")
    assert rollout.calls()[0]["response"]["type"] == "message"


def test_streamed_conversation(rollout: Rollout) -> None:
    sdk = client(rollout)
    history: list[Any] = []
    received = []
    for question in QUESTIONS:
        history.append({"role": "user", "content": question})
        with sdk.messages.stream(
            model=rollout.model, messages=history, max_tokens=MAX_TOKENS
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == received_of(final).content
        received.append(received_of(final))
        history.append(as_turn(final))
    rollout.assert_recorded_as_received(received, kind="messages")
    assert all(call["stream"] for call in rollout.calls())


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_tool_use_then_tool_result(val_rollout: Rollout, stream: bool) -> None:
    """`val` mode keeps the SDK's temperature 0, so the model's own tool call is certain."""
    sdk = client(val_rollout)
    history = few_shot_tool_use()
    first = sdk.messages.create(
        model=val_rollout.model,
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        extra_body={"temperature": 0},  # the SDK no longer takes it as an argument
        max_tokens=32,
    )
    assert first.stop_reason == "tool_use"
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    history.append(as_turn(first))
    history.append(
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Rain"}],
        }
    )
    arguments: dict[str, Any] = {
        "model": val_rollout.model,
        "messages": history,
        "tools": [WEATHER_TOOL],
        "extra_body": {"temperature": 0},
        "max_tokens": MAX_TOKENS,
    }
    if stream:
        with sdk.messages.stream(**arguments) as events:
            second = events.get_final_message()
    else:
        second = sdk.messages.create(**arguments)
    val_rollout.assert_recorded_as_received(
        [received_of(first), received_of(second)], kind="messages"
    )
    prompt = val_rollout.engine.engine.decode(val_rollout.calls()[1]["prompt_token_ids"])
    assert "<tool_response>\nRain\n</tool_response>" in prompt


def test_count_tokens_is_the_engine_prompt_length(rollout: Rollout) -> None:
    sdk = client(rollout)
    messages = [{"role": "user", "content": "Name a colour."}]
    counted = sdk.messages.count_tokens(model=rollout.model, messages=messages)  # type: ignore[arg-type]
    sdk.messages.create(model=rollout.model, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    (call,) = rollout.calls()
    assert counted.input_tokens == len(call["prompt_token_ids"])


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_count_tokens_with_tools_is_the_prompt_length_of_the_same_call(
    val_rollout: Rollout, choice: str
) -> None:
    """`tool_choice: none` leaves the tools out of the embedded engine's prompt: the count of the
    same request must leave them out too."""
    sdk = client(val_rollout)
    request: dict[str, Any] = {
        "model": val_rollout.model,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": choice},
    }
    counted = sdk.messages.count_tokens(**request)
    answer = sdk.messages.create(**request, max_tokens=2)
    (call,) = val_rollout.calls()
    assert counted.input_tokens == answer.usage.input_tokens == len(call["prompt_token_ids"])


def test_an_empty_last_assistant_message_is_answered_as_a_new_turn(val_rollout: Rollout) -> None:
    """Anthropic accepts an empty last assistant message (no prefill): so does the proxy, with
    the prompt of the same conversation without it."""
    sdk = client(val_rollout)
    question = {"role": "user", "content": "Name a colour."}
    for messages in ([question, {"role": "assistant", "content": ""}], [question]):
        message = sdk.messages.create(
            model=val_rollout.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body={"temperature": 0},
        )
        assert message.stop_reason in ("end_turn", "max_tokens")
    with_empty, without = val_rollout.calls()
    assert with_empty["status"] == without["status"] == 200
    assert with_empty["prompt_token_ids"] == without["prompt_token_ids"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_prefill_is_continued_and_the_answer_is_only_the_continuation(
    val_rollout: Rollout, stream: bool
) -> None:
    """A last assistant message is continued, as Anthropic does (it was a 400): the engine's
    prompt ends with the prefill's text, with no end of turn and no new assistant header after
    it, and the SDK receives only what the model wrote next, as recorded."""
    sdk = client(val_rollout)
    prefill = "The capital of France is"
    request: dict[str, Any] = {
        "model": val_rollout.model,
        "messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": prefill},
        ],
        "max_tokens": 8,
        "extra_body": {"temperature": 0},
    }
    if stream:
        with sdk.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = sdk.messages.create(**request)
    assert message.stop_reason in ("end_turn", "max_tokens")
    val_rollout.assert_recorded_as_received([received_of(message)], kind="messages")
    (call,) = val_rollout.calls()
    decode = val_rollout.engine.engine.tokenizer.decode
    prompt = decode(call["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.endswith(f"<|im_start|>assistant\n{prefill}")
    assert not received_of(message).content.startswith(prefill)


def test_tool_calls_kept_whole_before_a_call_max_tokens_cut_are_max_tokens(
    val_rollout: Rollout,
) -> None:
    """Forced to call a tool, the model (greedy) writes one whole call and starts a second that
    `max_tokens` cuts; the engine keeps the whole call only (35 of the 40 tokens it sampled).
    That is `max_tokens`, not the context's end: the prompt is 146 tokens, far from it (it
    was `model_context_window_exceeded`, on which Claude Code reports a full context)."""
    message = client(val_rollout).messages.create(
        model=val_rollout.model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        max_tokens=40,
        extra_body={"temperature": 0},
    )
    (call,) = val_rollout.calls()
    assert (call["finish_reason"], call["stop_reason"]) == ("length", "</tool_call>")
    assert len(call["response_token_ids"]) < 40
    assert message.stop_reason == "max_tokens"
    assert [block.type for block in message.content] == ["tool_use"]
    val_rollout.assert_recorded_as_received([received_of(message)], kind="messages")


def test_bad_input_is_a_recorded_400_in_anthropic_shape(rollout: Rollout) -> None:
    sdk = client(rollout)
    with pytest.raises(anthropic.BadRequestError) as raised:
        sdk.messages.create(
            model=rollout.model,
            max_tokens=8,
            messages=[
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}
            ],
        )
    assert raised.value.body["type"] == "error"  # type: ignore[index]
    assert "nope" in raised.value.body["error"]["message"]  # type: ignore[index]
    (call,) = rollout.calls()
    assert (call["status"], call["kind"]) == (400, "messages")


def test_a_prompt_beyond_the_context_is_said_as_claude_code_compacts_on_it(
    rollout: Rollout,
) -> None:
    """Claude Code reads `prompt is too long: N tokens > M maximum` (N and M, for its compaction);
    the engine's own count of the prompt is N, its context M."""
    sdk = client(rollout)
    long = [{"role": "user", "content": "word " * (rollout.engine.engine.max_model_len + 100)}]
    counted = sdk.messages.count_tokens(model=rollout.model, messages=long)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as raised:
        sdk.messages.create(model=rollout.model, max_tokens=8, messages=long)  # type: ignore[arg-type]
    message = raised.value.body["error"]["message"]  # type: ignore[index]
    limit = rollout.engine.engine.max_model_len
    assert message.startswith(
        f"prompt is too long: {counted.input_tokens} tokens > {limit} maximum"
    )
    (call,) = rollout.calls()
    assert (call["status"], call["kind"]) == (400, "messages")  # recorded, not trainable


def test_unknown_route_and_bad_token_answer_in_anthropic_shape(rollout: Rollout) -> None:
    import httpx

    missing = httpx.post(
        f"{rollout.anthropic_base_url}/v1/nothing", headers={"x-api-key": rollout.token}
    )
    assert missing.status_code == 404
    assert missing.json()["type"] == "error"
    wrong = httpx.post(
        f"{rollout.anthropic_base_url}/v1/messages",
        headers={"x-api-key": "wrong"},
        json={"model": "m", "max_tokens": 1, "messages": []},
    )
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    head = httpx.head(rollout.anthropic_base_url, headers={"x-api-key": rollout.token})
    assert head.status_code == 200
