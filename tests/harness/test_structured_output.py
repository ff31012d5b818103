"""Structured output through the gateway proxy in front of the embedded engine, as harnesses ask
for it: the Agents SDK's `output_type` (the Responses API's `text.format`), LangChain's
`with_structured_output` (chat `response_format`), the Anthropic SDK's forced tool (Messages'
`tool_choice`). The engine enforces each (`reins.engine.constraint`); the record is what the
harness received."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.harness.clients import agents_sdk_on, chat_openai
from tests.harness.conftest import Received, Rollout
from tests.harness.test_anthropic_sdk import WEATHER_TOOL, client, received_of

pytestmark = pytest.mark.slow


class Trip(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)


def test_the_agents_sdk_gets_its_output_type(val_rollout: Rollout) -> None:
    from agents import Agent, ModelSettings, Runner

    rollout = val_rollout
    agents_sdk_on(rollout)
    agent = Agent(
        name="planner",
        instructions="You plan trips.",
        model="gpt-5.5",
        model_settings=ModelSettings(max_tokens=80, temperature=0),
        output_type=Trip,
    )
    result = Runner.run_sync(agent, "Plan a trip.")
    trip = result.final_output
    assert isinstance(trip, Trip) and 1 <= trip.days <= 7
    text = result.raw_responses[0].output[0].content[0].text  # type: ignore[union-attr]
    assert Trip.model_validate_json(text) == trip
    rollout.assert_recorded_as_received([Received.text(text)], kind="responses")


def test_langchain_with_structured_output_gets_its_schema(val_rollout: Rollout) -> None:
    rollout = val_rollout
    llm = chat_openai(rollout, 80, temperature=0)
    structured = llm.with_structured_output(Trip, method="json_schema", include_raw=True)
    answer = structured.invoke("Plan a trip.")
    assert answer["parsing_error"] is None  # type: ignore[index]
    trip = answer["parsed"]  # type: ignore[index]
    assert isinstance(trip, Trip) and 1 <= trip.days <= 7
    text = answer["raw"].content  # type: ignore[index]
    rollout.assert_recorded_as_received([Received.text(text)])


def test_an_anthropic_forced_tool_is_a_tool_use(val_rollout: Rollout) -> None:
    """`tool_choice: {"type": "tool"}` on a question the model would answer in text."""
    rollout = val_rollout
    message = client(rollout).messages.create(
        model=rollout.model,
        max_tokens=80,
        extra_body={"temperature": 0},  # the SDK no longer takes it as an argument
        messages=[{"role": "user", "content": "Name a colour."}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and [use.name for use in uses] == ["get_weather"]
    assert isinstance(uses[0].input["city"], str)
    rollout.assert_recorded_as_received([received_of(message)], kind="messages")


def test_the_anthropic_sdk_parses_its_output_format(val_rollout: Rollout) -> None:
    """`messages.parse(output_format=...)` sends `output_config.format` (a JSON schema)."""
    rollout = val_rollout
    message = client(rollout).messages.parse(
        model=rollout.model,
        max_tokens=80,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Plan a trip."}],
        output_format=Trip,
    )
    trip = message.parsed_output
    assert message.stop_reason == "end_turn"
    assert isinstance(trip, Trip) and 1 <= trip.days <= 7
    rollout.assert_recorded_as_received([received_of(message)], kind="messages")


def test_vllms_structured_outputs_pass_the_proxy(rollout: Rollout) -> None:
    """A client written for vLLM (its `structured_outputs` field), in train mode."""
    from openai import OpenAI

    sdk = OpenAI(base_url=rollout.base_url, api_key=rollout.token, timeout=300, max_retries=0)
    answer = sdk.chat.completions.create(
        model=rollout.model,
        messages=[{"role": "user", "content": "Is the sea blue?"}],
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    text = answer.choices[0].message.content
    assert text in {"yes", "no"} and answer.choices[0].finish_reason == "stop"
    rollout.assert_recorded_as_received([Received.text(text)])


def test_the_agents_sdk_forced_tool_gets_arguments_of_its_schema(val_rollout: Rollout) -> None:
    """`ModelSettings(tool_choice=NAME)` on a strict function tool (the SDK's default), through
    the Responses API: one call, its arguments valid for the tool's signature."""
    from agents import Agent, ModelSettings, Runner, function_tool

    rollout = val_rollout
    agents_sdk_on(rollout)
    seen: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str, unit: Literal["C", "F"]) -> str:
        """The current weather in a city."""
        seen.append((city, unit))
        return "Sunny"

    agent = Agent(
        name="forecaster",
        instructions="You answer questions about the weather.",
        model="gpt-5.5",
        model_settings=ModelSettings(max_tokens=80, temperature=0, tool_choice="get_weather"),
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, "Weather in Paris?")
    assert len(seen) == 1 and isinstance(seen[0][0], str) and seen[0][1] in {"C", "F"}
    assert result.final_output == "Sunny"
