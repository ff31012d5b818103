"""The OpenAI Agents SDK through the gateway, with the stub engine (STUBBED: the model, see
tests/stub_engine.py): what its two model classes' requests carry to the engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from agents import (
    Agent,
    Model,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from tests.conftest import Gateway
from tests.stub_engine import DEFAULT_REPLY, StubEngine


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return "Sunny"


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_a_function_tools_strict_schema_reaches_the_engine(
    gateway: Gateway, stub: StubEngine, api: str
) -> None:
    """The SDK sends `strict: true` on every function tool (its arguments must follow the
    schema); an engine that enforces it (vLLM constrains the calls of `strict` tools) must get
    it whichever API the SDK speaks, as the harness's constraint, not silently dropped."""
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
    base = f"{gateway.url}/proxy/rollout/r/attempt/1/mode/val/openai/v1"
    client = AsyncOpenAI(base_url=base, api_key=gateway.api_key, max_retries=0)
    model: Model = (
        OpenAIResponsesModel("policy", client)
        if api == "responses"
        else OpenAIChatCompletionsModel("policy", client)
    )
    set_tracing_disabled(True)
    agent = Agent(name="assistant", model=model, tools=[get_weather])
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])

    result = asyncio.run(Runner.run(agent, "Weather in Paris?"))

    assert result.final_output == DEFAULT_REPLY
    (tool,) = stub.requests[-1]["tools"]
    function: dict[str, Any] = tool["function"]
    assert (function["name"], function["strict"]) == ("get_weather", True)
    assert function["parameters"]["additionalProperties"] is False
