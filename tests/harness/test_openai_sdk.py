"""The `openai` SDK, pointed at the gateway proxy in front of the embedded engine: plain,
streamed and tool-calling conversations are recorded token for token as the SDK received them."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.embedded_support import FEW_SHOT_TOOL_USE, WEATHER_TOOL
from tests.harness.conftest import Received, Rollout

pytestmark = pytest.mark.slow

QUESTIONS = ["Name a colour.", "And another one?", "Which of the two do you like best?"]
MAX_TOKENS = 24


def client(rollout: Rollout) -> openai.OpenAI:
    return openai.OpenAI(base_url=rollout.base_url, api_key=rollout.token, timeout=300)


def received_of(message: Any) -> Received:
    if message.tool_calls:
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        return Received.calls(message.content, calls)
    return Received.text(message.content)


def test_plain_conversation(rollout: Rollout) -> None:
    sdk = client(rollout)
    messages: list[Any] = []
    received = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        completion = sdk.chat.completions.create(
            model=rollout.model, messages=messages, max_tokens=MAX_TOKENS
        )
        message = completion.choices[0].message
        received.append(received_of(message))
        messages.append({"role": "assistant", "content": message.content})
    rollout.assert_recorded_as_received(received)


def test_streamed_conversation(rollout: Rollout) -> None:
    sdk = client(rollout)
    messages: list[Any] = []
    received = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        pieces = []
        for chunk in sdk.chat.completions.create(
            model=rollout.model, messages=messages, max_tokens=MAX_TOKENS, stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        text = "".join(pieces)
        received.append(Received.text(text))
        messages.append({"role": "assistant", "content": text})
    rollout.assert_recorded_as_received(received)
    assert all(call["stream"] for call in rollout.calls())


def test_tool_calling_conversation(val_rollout: Rollout) -> None:
    """`val` mode keeps the SDK's temperature 0, so the model's own tool call is certain."""
    sdk = client(val_rollout)
    messages: list[Any] = list(FEW_SHOT_TOOL_USE)
    first = sdk.chat.completions.create(
        model=val_rollout.model,
        messages=messages,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        temperature=0,
        max_tokens=32,
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls is not None
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    received = [received_of(message)]

    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"})
    pieces: list[str] = []
    streamed_calls: dict[int, list[str]] = {}
    for chunk in sdk.chat.completions.create(
        model=val_rollout.model,
        messages=messages,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
    ):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        pieces.append(delta.content or "")
        for piece in delta.tool_calls or ():
            name, arguments = streamed_calls.setdefault(piece.index, ["", ""])
            function = piece.function
            streamed_calls[piece.index] = [
                name + (function.name or "" if function else ""),
                arguments + (function.arguments or "" if function else ""),
            ]
    text = "".join(pieces)
    if streamed_calls:
        pairs = [(name, arguments) for name, arguments in streamed_calls.values()]
        received.append(Received.calls(text, pairs))
    else:
        received.append(Received.text(text))
    val_rollout.assert_recorded_as_received(received)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_asked_logprobs_carry_alternatives_and_are_recorded_as_received(
    rollout: Rollout, stream: bool
) -> None:
    """`logprobs=True, top_logprobs=3` through the proxy: the SDK gets each token's logprob (the
    one recorded for training) with three alternatives, and the record holds what it got."""
    fields: dict[str, Any] = {
        "model": rollout.model,
        "messages": [{"role": "user", "content": QUESTIONS[0]}],
        "max_tokens": MAX_TOKENS,
        "logprobs": True,
        "top_logprobs": 3,
    }
    if stream:
        entries: list[Any] = []
        for chunk in client(rollout).chat.completions.create(**fields, stream=True):
            if chunk.choices and chunk.choices[0].logprobs:
                entries += chunk.choices[0].logprobs.content or []
    else:
        completion = client(rollout).chat.completions.create(**fields)
        entries = list(completion.choices[0].logprobs.content or [])
    (call,) = rollout.calls()
    assert [entry.logprob for entry in entries] == call["response_logprobs"]
    for entry in entries:
        alternatives = [top.logprob for top in entry.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
    recorded = call["response"]["choices"][0]["logprobs"]["content"]
    assert recorded == [entry.model_dump() for entry in entries]
