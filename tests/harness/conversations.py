"""A multi-turn conversation as an `openai` SDK harness holds it: the whole history sent at every
call, each answer (text or tool calls) appended as the SDK returned it, a tool's result or the
next question after it. Used by tests/harness/test_token_reuse.py and benchmarks/token_reuse.py.
"""

from __future__ import annotations

from typing import Any

import openai

from reins.doctor.harnesses.openai_chat import assemble
from tests.embedded_support import FEW_SHOT_TOOL_USE, WEATHER_TOOL

FOLLOW_UPS = ["Thanks. And tomorrow?", "Should I take an umbrella?", "Say it in one word."]
MAX_TOKENS = 32


def ask(
    sdk: openai.OpenAI, model: str, messages: list[dict[str, Any]], *, stream: bool, **fields: Any
) -> dict[str, Any]:
    """One call; the assistant message as the SDK gives it (streamed: assembled from the deltas,
    as a streaming harness does)."""
    if not stream:
        completion = sdk.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, **fields
        )
        return completion.choices[0].message.model_dump(exclude_none=True)
    return assemble(
        sdk.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, stream=True, **fields
        )
    )


def weather_conversation(
    sdk: openai.OpenAI, model: str, *, stream: bool, turns: int = 4, **fields: Any
) -> list[dict[str, Any]]:
    """`turns` calls with the weather tool offered; a tool call gets `Sunny, 21 C` back, a text
    answer the next follow-up question. Returns the assistant messages received. `fields` go
    into every call (a `seed`, say)."""
    messages: list[dict[str, Any]] = [dict(m) for m in FEW_SHOT_TOOL_USE]
    follow_ups = iter(FOLLOW_UPS * turns)
    received = []
    for _ in range(turns):
        message = ask(sdk, model, messages, stream=stream, tools=[WEATHER_TOOL], **fields)
        received.append(message)
        messages.append(message)
        for call in message.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": next(follow_ups)})
    return received
