"""`langchain-openai`'s `ChatOpenAI`, invoked twice with the history, pointed at the gateway
proxy in front of the embedded engine."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.embedded_support import WEATHER_TOOL
from tests.harness.clients import chat_openai
from tests.harness.conftest import Received, Rollout

pytestmark = pytest.mark.slow


def test_chat_openai_conversation(rollout: Rollout) -> None:
    from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage

    llm = chat_openai(rollout, 24)
    history: list[BaseMessage] = [SystemMessage("You are terse.")]
    received = []
    for question in ["Name an animal.", "Where does it live?"]:
        history.append(HumanMessage(question))
        reply = llm.invoke(history)
        assert isinstance(reply.content, str)
        received.append(Received.text(reply.content))
        history.append(reply)
    rollout.assert_recorded_as_received(received)


def _two_calls(first: str, second: str, turn: int) -> dict[str, Any]:
    """An assistant turn that asked for the weather in two cities at once."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": f"call_{turn}_{city}",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
            }
            for city in (first, second)
        ],
    }


PARALLEL_FEW_SHOT = [
    {"role": "user", "content": "Weather in Rome and Oslo?"},
    _two_calls("Rome", "Oslo", 1),
    {"role": "user", "content": "Weather in Lima and Kyiv?"},
    _two_calls("Lima", "Kyiv", 2),
    {"role": "user", "content": "Weather in Paris and Berlin?"},
]
"""A history in which the assistant always made two calls in one turn: greedy decoding makes the
default model answer the last question with two calls (Paris, Berlin) when it may."""


def test_parallel_tool_calls_false_gets_one_call(val_rollout: Rollout) -> None:
    """`bind_tools(..., parallel_tool_calls=False)` (as `with_structured_output` sends it): one
    call at most, as OpenAI and vLLM answer, plain and streamed; the record is that one call."""
    from langchain_core.messages import AIMessageChunk

    rollout = val_rollout
    llm = chat_openai(rollout, 80, temperature=0)
    free = llm.bind_tools([WEATHER_TOOL]).invoke(PARALLEL_FEW_SHOT)
    assert [call["args"] for call in free.tool_calls] == [{"city": "Paris"}, {"city": "Berlin"}]

    single = llm.bind_tools([WEATHER_TOOL], parallel_tool_calls=False)
    plain = single.invoke(PARALLEL_FEW_SHOT)
    streamed: AIMessageChunk | None = None
    for chunk in single.stream(PARALLEL_FEW_SHOT):
        assert isinstance(chunk, AIMessageChunk)
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None
    received = [Received.calls(None, [("get_weather", '{"city": "Paris"}')])]
    assert [call["args"] for call in plain.tool_calls] == [{"city": "Paris"}]
    assert [call["args"] for call in streamed.tool_calls] == [{"city": "Paris"}]
    both = Received.calls(
        None, [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Berlin"}')]
    )
    rollout.assert_recorded_as_received([both, *received, *received])
