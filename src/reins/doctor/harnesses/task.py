"""The named harnesses' one task, in each wire API's shape, and what every driver shares.

The task: "Weather in Paris?" with a `get_weather` tool offered, after a few-shot history in which
the assistant answered two such questions with a call (a 135M model rarely calls a tool on its
own; with this history, greedy decoding makes the default model call `get_weather` for Paris).
The few-shot calls carry no results: with them the model imitates a tool result instead of
calling. Each tool call gets `TOOL_RESULT` back, each text answer the next of `FOLLOW_UPS`, for
`turns()` calls in all.

The data is the same few-shot history the harness tests use (tests/embedded_support.py), kept
here once so that the package does not depend on the tests.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from types import ModuleType
from typing import Any, NoReturn

MODEL = "policy"
"""The model name the drivers ask for; the proxy serves any name."""
MAX_TOKENS = 32
TIMEOUT_S = 600.0
"""A client-side timeout well above one call's latency on shared CPU cores."""
MISSING_EXIT = 3
"""A driver's exit status when its library is not installed."""
TURNS_ENV = "REINS_DOCTOR_TURNS"
DEFAULT_TURNS = 4

CITIES = ("Rome", "Oslo")
QUESTION = "Weather in Paris?"
TOOL_NAME = "get_weather"
TOOL_DESCRIPTION = "The current weather in a city"
TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOL_RESULT = "Sunny, 21 C"
FOLLOW_UPS = ("Thanks. And tomorrow?", "Should I take an umbrella?", "Say it in one word.")


def turns() -> int:
    """Calls per run: REINS_DOCTOR_TURNS (default 4, at least 1)."""
    raw = os.environ.get(TURNS_ENV, str(DEFAULT_TURNS))
    try:
        return max(1, int(raw))
    except ValueError:
        fail(f"{TURNS_ENV}={raw!r} is not a whole number of calls")


def follow_up(number: int) -> str:
    return FOLLOW_UPS[number % len(FOLLOW_UPS)]


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def require(module: str, package: str) -> ModuleType:
    """Imports `module`, or exits with `MISSING_EXIT` saying which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        fail(
            f"this harness needs the `{package}` package ({error}): pip install '{package}'",
            MISSING_EXIT,
        )


def env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        fail(f"{name} is not set: run this driver through `reins doctor NAME`")
    return value


# -- chat completions (openai SDK, litellm, LangChain) -----------------------------------------

CHAT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": TOOL_DESCRIPTION,
        "parameters": TOOL_PARAMETERS,
    },
}


def chat_call(city: str, call_id: str) -> dict[str, Any]:
    """An assistant message that calls the tool for `city`."""
    arguments = json.dumps({"city": city})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": TOOL_NAME, "arguments": arguments},
            }
        ],
    }


def chat_history() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for number, city in enumerate(CITIES, start=1):
        messages += [{"role": "user", "content": f"Weather in {city}?"}]
        messages.append(chat_call(city, f"call_{number}"))
    messages.append({"role": "user", "content": QUESTION})
    return messages


def chat_next(message: dict[str, Any], number: int) -> list[dict[str, Any]]:
    """What the harness sends after assistant `message`: tool results, or a follow-up."""
    calls = message.get("tool_calls") or ()
    if calls:
        return [{"role": "tool", "tool_call_id": c["id"], "content": TOOL_RESULT} for c in calls]
    return [{"role": "user", "content": follow_up(number)}]


# -- the Responses API --------------------------------------------------------------------------

RESPONSES_TOOL: dict[str, Any] = {
    "type": "function",
    "name": TOOL_NAME,
    "description": TOOL_DESCRIPTION,
    "parameters": TOOL_PARAMETERS,
}


def responses_history() -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for number, city in enumerate(CITIES, start=1):
        items.append({"role": "user", "content": f"Weather in {city}?"})
        items.append(
            {
                "type": "function_call",
                "call_id": f"call_{number}",
                "name": TOOL_NAME,
                "arguments": json.dumps({"city": city}),
            }
        )
    items.append({"role": "user", "content": QUESTION})
    return items


# -- the Messages API ---------------------------------------------------------------------------

MESSAGES_TOOL: dict[str, Any] = {
    "name": TOOL_NAME,
    "description": TOOL_DESCRIPTION,
    "input_schema": TOOL_PARAMETERS,
}


def messages_history() -> list[dict[str, Any]]:
    turns_: list[dict[str, Any]] = []
    for number, city in enumerate(CITIES, start=1):
        turns_.append({"role": "user", "content": f"Weather in {city}?"})
        block = {"type": "tool_use", "id": f"toolu_{number}", "name": TOOL_NAME}
        turns_.append({"role": "assistant", "content": [{**block, "input": {"city": city}}]})
    turns_.append({"role": "user", "content": QUESTION})
    return turns_


# -- the coding-agent CLIs (their sessions: harnesses/cli_sessions.py) -------------------------

CLI_PROMPT = "List the files."
"""The CLIs' task, and the few-shot turns' question: each answered by running `ls`."""
CLI_LISTINGS = ("notes.txt", "notes.txt\ntodo.txt", "notes.txt\ntodo.txt\nplan.md")
OPENCODE_LISTINGS = (*CLI_LISTINGS, "notes.txt\ntodo.txt\nplan.md\nREADME.md", "a.txt")
"""OpenCode's prompt names the folder and the date; with five few-shot turns the greedy choice of
a tool call holds whatever they are (with three it flipped with them)."""
CLI_ANSWER = "Done."
