"""The OpenAI Agents SDK on its chat-completions model (`OpenAIChatCompletionsModel`), pointed at
the gateway proxy in front of the embedded engine. Its default model uses the Responses API,
which the proxy does not serve; tracing is disabled (it would send traces to OpenAI)."""

from __future__ import annotations

import pytest

from tests.harness.conftest import Received, Rollout

pytestmark = pytest.mark.slow


def test_agent_conversation_over_two_runs(rollout: Rollout) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(
        model=rollout.model,
        openai_client=AsyncOpenAI(base_url=rollout.base_url, api_key=rollout.token, timeout=300),
    )
    agent = Agent(
        name="assistant",
        instructions="You answer in one sentence.",
        model=model,
        model_settings=ModelSettings(max_tokens=24),
    )
    first = Runner.run_sync(agent, "Name a planet.")
    second = Runner.run_sync(
        agent, [*first.to_input_list(), {"role": "user", "content": "Is it big?"}]
    )
    rollout.assert_recorded_as_received(
        [Received.text(first.final_output), Received.text(second.final_output)]
    )
