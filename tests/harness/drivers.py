"""Multi-turn tool tasks held by real in-process harnesses through the gateway proxy, for
benchmarks/fidelity.py: each driver runs one task on one rollout attempt and returns, call by
call, what the harness received (`reins.doctor.received.Answer`: text and parsed tool calls).

The task is the same for all: the weather tool is offered, the history starts with the few-shot
tool turns of tests/embedded_support.py (a 135M model calls a tool when earlier turns did), a tool
call gets `Sunny, 21 C` back, a text answer gets the next follow-up question; the task ends after
`CALLS` model calls or, for an agent loop, at the first run that reaches it (at most `MAX_CALLS`).
Each harness keeps its history the way it does by itself (the SDK's message dicts, litellm's
`Message` objects, LangGraph's state, the Agents SDK's input list, mini-swe-agent's trajectory).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import yaml

from reins.doctor.received import Answer
from reins.engine.chat import prepare_messages
from tests.embedded_support import FEW_SHOT_TOOL_USE, WEATHER_TOOL
from tests.harness.clients import chat_openai
from tests.harness.conftest import Rollout
from tests.harness.conversations import FOLLOW_UPS, MAX_TOKENS, weather_conversation

CALLS = 4
"""Model calls of a fixed-length task."""
MAX_CALLS = 8
"""Most model calls of an agent-loop task."""
TOOL_RESULT = "Sunny, 21 C"


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _answer(text: str | None, calls: list[tuple[str, Any]]) -> Answer:
    return Answer(text or "", tuple((name, _arguments(args)) for name, args in calls))


def _message_answer(message: dict[str, Any]) -> Answer:
    """An OpenAI chat assistant message (a dict) as an `Answer`."""
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()
    ]
    return _answer(message.get("content"), calls)


def _as_rendered_text(message: dict[str, Any]) -> dict[str, Any]:
    """A few-shot message with its tool calls written as the text the engine renders them as:
    the same prompt, and harnesses that check tool-call/result pairing accept it."""
    (rendered,) = prepare_messages([message], None, native_tools=False)
    return rendered


# --- the openai SDK ---------------------------------------------------------------------------


def sdk_task(rollout: Rollout, workdir: Path, *, stream: bool) -> list[Answer]:
    """The `openai` SDK, `CALLS` calls (tests/harness/conversations.py)."""
    sdk = openai.OpenAI(base_url=rollout.base_url, api_key=rollout.token, timeout=600)
    received = weather_conversation(sdk, rollout.model, stream=stream, turns=CALLS)
    return [_message_answer(message) for message in received]


def sdk_streamed_task(rollout: Rollout, workdir: Path) -> list[Answer]:
    return sdk_task(rollout, workdir, stream=True)


def sdk_plain_task(rollout: Rollout, workdir: Path) -> list[Answer]:
    return sdk_task(rollout, workdir, stream=False)


# --- litellm ----------------------------------------------------------------------------------


def litellm_task(rollout: Rollout, workdir: Path) -> list[Answer]:
    """`litellm.completion` (the `openai/` provider), `CALLS` calls; the answer goes back into
    the history as the `Message` object litellm returned (its documented tool-calling loop)."""
    import litellm

    litellm.suppress_debug_info = True
    messages: list[Any] = [dict(m) for m in FEW_SHOT_TOOL_USE]
    follow_ups = iter(FOLLOW_UPS * CALLS)
    received = []
    for _ in range(CALLS):
        response = litellm.completion(
            model=f"openai/{rollout.model}",
            api_base=rollout.base_url,
            api_key=rollout.token,
            messages=messages,
            tools=[WEATHER_TOOL],
            max_tokens=MAX_TOKENS,
            timeout=600,
        )
        message = response.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        received.append(_answer(message.content, calls))
        messages.append(message)
        for call in message.tool_calls or ():
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "name": "get_weather",
                    "content": TOOL_RESULT,
                }
            )
        if not message.tool_calls:
            messages.append({"role": "user", "content": next(follow_ups)})
    return received


# --- LangGraph --------------------------------------------------------------------------------


def langgraph_task(rollout: Rollout, workdir: Path) -> list[Answer]:
    """LangGraph's prebuilt ReAct agent on `langchain-openai`'s `ChatOpenAI`: the graph runs
    the model until an answer without tool calls; then a follow-up question, and the graph runs
    again on its whole state, until `CALLS` calls (at most `MAX_CALLS`)."""
    from langchain_core.messages import AIMessage, HumanMessage, convert_to_messages
    from langchain_core.tools import tool
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city"""
        return TOOL_RESULT

    llm = chat_openai(rollout, MAX_TOKENS, timeout=600)
    graph = create_react_agent(llm, tools=[get_weather])
    messages = convert_to_messages([_as_rendered_text(m) for m in FEW_SHOT_TOOL_USE])
    follow_ups = iter(FOLLOW_UPS * MAX_CALLS)
    start = len(messages)
    replies: list[AIMessage] = []
    while len(replies) < CALLS:
        left = MAX_CALLS - len(replies)
        try:
            state = graph.invoke({"messages": messages}, {"recursion_limit": 2 * left})
        except GraphRecursionError:
            break  # the model kept calling tools: the task ends (its calls are recorded)
        messages = list(state["messages"])
        replies = [m for m in messages[start:] if isinstance(m, AIMessage)]
        messages.append(HumanMessage(next(follow_ups)))
    return [
        _answer(
            reply.content if isinstance(reply.content, str) else str(reply.content),
            [(c["name"], c["args"]) for c in reply.tool_calls]
            + [(c.get("name") or "", c.get("args") or "") for c in reply.invalid_tool_calls],
        )
        for reply in replies
    ]


# --- the OpenAI Agents SDK ---------------------------------------------------------------------


def openai_agents_task(rollout: Rollout, workdir: Path) -> list[Answer]:
    """The Agents SDK's `Runner` with a `function_tool` on its chat-completions model: each run
    goes on until an answer without tool calls; the next run gets the previous run's input list
    (`to_input_list`) and a follow-up question, until `CALLS` calls (at most `MAX_CALLS`)."""
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import ModelResponse

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city"""
        return TOOL_RESULT

    model = OpenAIChatCompletionsModel(
        model=rollout.model,
        openai_client=openai.AsyncOpenAI(
            base_url=rollout.base_url, api_key=rollout.token, timeout=600, max_retries=0
        ),
    )
    agent = Agent(
        name="assistant",
        model=model,
        tools=[get_weather],
        model_settings=ModelSettings(max_tokens=MAX_TOKENS),
    )

    async def runs() -> list[ModelResponse]:
        # One event loop for the whole task: the client's connections belong to it.
        items: list[Any] = [_as_rendered_text(m) for m in FEW_SHOT_TOOL_USE]
        follow_ups = iter(FOLLOW_UPS * MAX_CALLS)
        responses: list[ModelResponse] = []
        while len(responses) < CALLS:
            try:
                result = await Runner.run(agent, items, max_turns=MAX_CALLS - len(responses))
            except MaxTurnsExceeded as error:
                if error.run_data is not None:
                    responses += error.run_data.raw_responses
                break
            responses += result.raw_responses
            items = [*result.to_input_list(), {"role": "user", "content": next(follow_ups)}]
        return responses

    responses = asyncio.run(runs())
    return [_agents_answer(response) for response in responses]


def _agents_answer(response: Any) -> Answer:
    """A `ModelResponse`'s output items as an `Answer`."""
    texts: list[str] = []
    calls: list[tuple[str, Any]] = []
    for item in response.output:
        if item.type == "message":
            texts += [part.text for part in item.content if part.type == "output_text"]
        elif item.type == "function_call":
            calls.append((item.name, item.arguments))
    return _answer("".join(texts), calls)


# --- mini-swe-agent -----------------------------------------------------------------------------

MINI_STEP_LIMIT = 6


def mini_swe_agent_task(rollout: Rollout, workdir: Path) -> list[Answer]:
    """mini-swe-agent's default agent (its `mini.yaml` templates, its litellm tool-calling model
    with the `bash` tool, its `local` environment in `workdir`) on a one-line fix, at most
    `MINI_STEP_LIMIT` steps. An answer without a valid `bash` call is a format error: the agent
    keeps it out of its history (the raw answer stays in the error message's `extra`)."""
    import litellm
    from minisweagent import package_dir
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    litellm.suppress_debug_info = True
    (workdir / "greeting.py").write_text('print("helo world")\n')
    config = yaml.safe_load((Path(package_dir) / "config" / "mini.yaml").read_text())
    agent_config = {
        **config["agent"],
        "step_limit": MINI_STEP_LIMIT,
        "cost_limit": 0,
        # A 135M model rarely makes a valid call: let the task run its steps all the same.
        "max_consecutive_format_errors": MINI_STEP_LIMIT,
    }
    model = LitellmModel(
        model_name=f"openai/{rollout.model}",
        model_kwargs={
            "api_base": rollout.base_url,
            "api_key": rollout.token,
            "max_tokens": 48,
            "timeout": 600,
        },
        cost_tracking="ignore_errors",
    )
    env = LocalEnvironment(cwd=str(workdir), timeout=10)
    agent = DefaultAgent(model, env, **agent_config)
    agent.run("greeting.py prints 'helo world'; make it print 'hello world'.")
    return mini_swe_agent_received(agent.messages)


def mini_swe_agent_received(messages: list[dict[str, Any]]) -> list[Answer]:
    """What each model call returned, in order, from mini-swe-agent's trajectory."""
    received = []
    for message in messages:
        extra = message.get("extra") or {}
        if message.get("role") == "assistant":
            answer = message
        elif extra.get("interrupt_type") == "FormatError" and "response" in extra:
            answer = extra["response"]["choices"][0]["message"]
        else:
            continue
        received.append(_message_answer(answer))
    return received
