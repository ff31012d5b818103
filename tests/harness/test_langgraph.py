"""LangGraph's prebuilt ReAct agent (`create_react_agent` on `ChatOpenAI`), pointed at the gateway
proxy in front of the embedded engine: the model calls a tool, LangGraph runs it, the model
answers; both calls are recorded token for token as the graph received them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from reins.engine.chat import prepare_messages
from tests.embedded_support import FEW_SHOT_TOOL_USE
from tests.harness.clients import chat_openai
from tests.harness.conftest import Received, Rollout

pytestmark = pytest.mark.slow


def as_rendered_text(message: dict[str, Any]) -> dict[str, Any]:
    (rendered,) = prepare_messages([message], None, native_tools=False)
    return rendered


def test_react_agent_calls_a_tool_and_answers(val_rollout: Rollout) -> None:
    """`val` mode keeps temperature 0; the few-shot history (tests/embedded_support.py) makes the
    default model's first answer a `get_weather` call for Paris."""
    from langchain_core.messages import AIMessage, convert_to_messages
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    ran: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city"""
        ran.append(city)
        return "Sunny, 21 C"

    llm = chat_openai(val_rollout, 32, temperature=0)
    graph = create_react_agent(llm, tools=[get_weather])
    # The few-shot calls go in as the text the engine renders a call as (chat.py's Hermes
    # convention): the prompt is the same, and LangGraph does not ask for their tool results.
    history = convert_to_messages([as_rendered_text(message) for message in FEW_SHOT_TOOL_USE])
    result = graph.invoke({"messages": history}, {"recursion_limit": 6})
    replies = [m for m in result["messages"][len(history) :] if isinstance(m, AIMessage)]
    assert ran == ["Paris"]
    assert len(replies) == 2
    first, last = replies
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    calls = [(c["name"], json.dumps(c["args"])) for c in first.tool_calls]
    assert isinstance(last.content, str)
    val_rollout.assert_recorded_as_received(
        [Received.calls(first.content or None, calls), Received.text(last.content)], kind="chat"
    )
