"""`langchain-openai`'s `ChatOpenAI`, invoked twice with the history, pointed at the gateway
proxy in front of the embedded engine."""

from __future__ import annotations

import pytest

from tests.harness.conftest import Received, Rollout

pytestmark = pytest.mark.slow


def test_chat_openai_conversation(rollout: Rollout) -> None:
    from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=rollout.model,
        base_url=rollout.base_url,
        api_key=rollout.token,  # type: ignore[arg-type]
        max_tokens=24,  # type: ignore[call-arg]
        timeout=300,
        max_retries=0,
    )
    history: list[BaseMessage] = [SystemMessage("You are terse.")]
    received = []
    for question in ["Name an animal.", "Where does it live?"]:
        history.append(HumanMessage(question))
        reply = llm.invoke(history)
        assert isinstance(reply.content, str)
        received.append(Received.text(reply.content))
        history.append(reply)
    rollout.assert_recorded_as_received(received)
