"""pydantic-ai agents on each of the three APIs the gateway serves (OpenAI chat completions,
the Responses API, Anthropic Messages), pointed at the proxy in front of the embedded engine:
each run's calls are recorded token for token as the agent received them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.conftest import Received, Rollout

pytestmark = pytest.mark.slow


def model_for(api: str, rollout: Rollout) -> Any:
    if api == "messages":
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider

        return AnthropicModel(
            "claude-opus-4-8",
            provider=AnthropicProvider(base_url=rollout.anthropic_base_url, api_key=rollout.token),
        )
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=rollout.base_url, api_key=rollout.token)
    if api == "responses":
        return OpenAIResponsesModel(rollout.model, provider=provider)
    return OpenAIChatModel(rollout.model, provider=provider)


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_two_turn_conversation(rollout: Rollout, api: str) -> None:
    from pydantic_ai import Agent

    agent = Agent(
        model_for(api, rollout),
        instructions="You answer in one short sentence.",
        model_settings={"max_tokens": 24},
    )
    first = agent.run_sync("Name a planet.")
    second = agent.run_sync("Is it big?", message_history=first.all_messages())
    rollout.assert_recorded_as_received(
        [Received.text(first.output), Received.text(second.output)], kind=api
    )
    # The second call re-sent the first exchange: its prompt extends the first call's.
    calls = rollout.calls()
    assert len(calls[1]["prompt_token_ids"]) > len(calls[0]["prompt_token_ids"])
