"""An instruction-following agent with a computer (the LLM-in-Sandbox setting, paper 4.2).

A multi-turn harness on the plain `openai` SDK with OpenAI function calling: `run_shell`,
`write_file`, `read_file` and `finish`, for up to `MAX_TURNS` model calls. Every tool runs in the
rollout's own `reins.sandbox.Sandbox` (a folder under a temporary root, its /work; removed when
the rollout ends), so a command cannot reach the network, the host or another rollout's folder,
and a runaway one is stopped by the sandbox's limits. Either way the model gets a clear error text
as the tool's result and the episode goes on; the reward is the checker's (checkers.py), so a task
not solved scores 0 however it failed.

What keeps the rollout one training sequence: the history is append-only, and each assistant
message goes back exactly as the SDK returned it (the proxy recognises its own sampled turn).

Reported per rollout: a `tool` event per tool call (`report_tool`) and the reward with its reason
and metrics `tool_calls`, `finished` (finish was called) and `limit_hits` (commands a sandbox
limit stopped). A reply without a tool call ends the episode and its text is the answer.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from openai import OpenAI

from examples.sandbox.checkers import Verdict, check
from reins.agent import report_reward, report_tool
from reins.sandbox import Sandbox, SandboxLimits

MODEL = "policy"  # the gateway routes every name to the model being trained
MAX_TURNS = 6
MAX_TOKENS = 512
"""Per model call: a tool call or a short answer fits; a rambling one is cut."""
SHOWN_CHARS = 2000
"""Tool output shown to the model (head and tail): small models have small contexts. The
`tool` event keeps the sandbox's full (already bounded) output."""
LIMITS = SandboxLimits()

SYSTEM = """You are an agent with a Linux computer. Solve the user's task with the tools:
- run_shell runs a bash command in /work, your working folder (python3 and the usual \
command-line tools are installed; there is no network);
- write_file and read_file write and read a file under /work;
- finish ends the task with your final answer: the number or text asked for, or a short note \
when the task was to write a file."""

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a bash command in /work; returns its output and exit code.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "A bash command"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file under /work (created or replaced).",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path relative to /work"},
                    "content": {"type": "string", "description": "The file's whole text"},
                },
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file under /work.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "Path relative to /work"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "finish",
            "description": "End the task with the final answer.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "The final answer"}},
                "required": ["answer"],
            },
        },
    },
]
TOOL_NAMES = [tool["function"]["name"] for tool in TOOLS]

LIMIT_TEXT = {
    "wall time": "it ran past {wall_s:g} s of wall time",
    "cpu time": "it used more than {cpu_s} s of CPU time",
    "memory": "it used more than {memory_mb} MB of memory",
    "processes": "it started more than {processes} processes at once (a fork bomb?)",
    "file size": "it wrote a file larger than {file_mb} MB",
}


@dataclass(frozen=True)
class ToolResult:
    output: str
    """What the model is told (before shortening to SHOWN_CHARS)."""
    ok: bool
    limit: str | None = None
    """The sandbox limit that stopped a command, if one did."""
    seconds: float = 0.0


@dataclass
class Episode:
    answer: str | None = None
    """The text given to `finish`, or the last reply when it had no tool call."""
    finished: bool = False
    tool_calls: int = 0
    limit_hits: int = 0
    turns: int = 0
    ended: str = ""
    """Why the episode ended, for the reward's reason."""


OnTool = Callable[[str, Any, ToolResult], None]
"""Called after each tool call with its name, its arguments (decoded when they are JSON) and
result: `run` posts it as a `tool` event."""


def prompt(task: dict[str, Any]) -> str:
    files = sorted(task.get("files") or {})
    listing = f"\n\nFiles in /work: {', '.join(files)}" if files else ""
    return f"{task['instruction']}{listing}"


def in_work(path: str) -> str:
    """`path` relative to /work; a ValueError for a path elsewhere (the host side of the file
    tools refuses anything outside the sandbox's folder too)."""
    path = path.strip()
    if path == "/work" or path.startswith("/work/"):
        path = path[len("/work/") :]
    if path.startswith("/"):
        raise ValueError(f"{path} is outside /work: write_file and read_file work under /work")
    if not path:
        raise ValueError("the path is empty")
    return path


def execute(
    sandbox: Sandbox, name: str, arguments: Any, limits: SandboxLimits = LIMITS
) -> ToolResult:
    """Runs one tool call in `sandbox`; every failure becomes an error text, never an exception
    (the episode goes on). `limits` are the sandbox's, named in the error text."""
    started = time.monotonic()
    if not isinstance(arguments, dict):
        return ToolResult(f"error: the arguments of {name} must be a JSON object", False)
    try:
        if name == "run_shell":
            result = sandbox.run(str(arguments["command"]))
            if result.limit is not None:
                why = LIMIT_TEXT.get(result.limit, "it hit the {limit} limit")
                why = why.format(limit=result.limit, **dataclasses.asdict(limits))
                status = f"[error: the sandbox killed the command: {why}]"
                if result.exit_code is not None:  # a process of it: the command ran on
                    code = result.exit_code
                    status = f"[exit code {code}, after the sandbox stopped part of it: {why}]"
            else:
                status = f"[exit code {result.exit_code}]"
            text = f"{result.output.rstrip()}\n{status}".lstrip("\n")
            return ToolResult(text, result.ok, result.limit, result.seconds)
        if name == "write_file":
            content = str(arguments["content"])
            sandbox.write_file(in_work(str(arguments["path"])), content)
            output = f"wrote {len(content)} characters to {arguments['path']}"
            return ToolResult(output, True, seconds=time.monotonic() - started)
        if name == "read_file":
            text = sandbox.read_file(in_work(str(arguments["path"])))
            return ToolResult(text, True, seconds=time.monotonic() - started)
    except KeyError as missing:
        return ToolResult(f"error: {name} needs the argument {missing}", False)
    except Exception as error:  # a refused path, a missing file: the model should read why
        text = str(error).replace(str(sandbox.path), "/work")  # the host's path is not its own
        return ToolResult(f"error: {text}", False, seconds=time.monotonic() - started)
    if name == "finish":  # here only without its answer
        return ToolResult("error: finish needs the argument 'answer'", False)
    return ToolResult(f"error: no tool {name!r}; the tools are {', '.join(TOOL_NAMES)}", False)


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}"


def decode(arguments: str | None) -> Any:
    try:
        return json.loads(arguments)  # type: ignore[arg-type]
    except (json.JSONDecodeError, TypeError):  # not JSON, or null: the episode went down
        return arguments  # `execute` says they are not an object


def episode(
    client: OpenAI,
    task: dict[str, Any],
    sandbox: Sandbox,
    *,
    on_tool: OnTool | None = None,
    max_turns: int = MAX_TURNS,
    limits: SandboxLimits = LIMITS,
) -> Episode:
    """Runs the conversation: model call, tool calls, their results, until `finish`, a reply
    without a tool call, or `max_turns` model calls."""
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": prompt(task)},
    ]
    result = Episode(ended=f"no finish after {max_turns} model calls")
    while result.turns < max_turns and not result.finished:
        try:
            # Every turn is a tool call (the episode ends with `finish`): the engine constrains
            # the answer to one, so a small model that would answer in prose still acts.
            response = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                tools=TOOLS,
                tool_choice="required",
                max_tokens=MAX_TOKENS,
            )
        except openai.BadRequestError as error:
            if result.turns == 0:
                raise  # the first call is refused: a setup problem, not the model's doing
            result.ended = f"the history no longer fits the model ({error.message})"
            break
        result.turns += 1
        message = response.choices[0].message
        messages.append(message)  # as returned: the proxy recognises the turn it sampled
        calls = message.tool_calls or []
        if not calls:
            result.answer = message.content or ""
            result.ended = "replied without a tool call"
            break
        for call in calls:
            function = getattr(call, "function", None)  # None: a custom (non-function) tool call
            name = function.name if function else "?"
            arguments = decode(function.arguments) if function else None
            result.tool_calls += 1
            if name == "finish" and isinstance(arguments, dict) and "answer" in arguments:
                result.answer, result.finished = str(arguments["answer"]), True
                result.ended = "finished"
                if on_tool:
                    on_tool(name, arguments, ToolResult("the episode ends", True))
                break  # no further call: the history needs no tool message for it
            outcome = execute(sandbox, name, arguments, limits)
            result.limit_hits += outcome.limit is not None
            if on_tool:
                on_tool(name, arguments, outcome)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": shown(outcome.output)}
            )
    return result


def post_tool(name: str, arguments: Any, outcome: ToolResult) -> None:
    report_tool(name, arguments, outcome.output, ok=outcome.ok, seconds=outcome.seconds)


def play(
    client: OpenAI,
    task: dict[str, Any],
    *,
    limits: SandboxLimits = LIMITS,
    on_tool: OnTool | None = None,
) -> tuple[Episode, Verdict]:
    """One rollout: a fresh sandbox under a temporary root holding the task's files, the episode,
    the checker's verdict on the folder as the episode left it; the root is removed after."""
    with tempfile.TemporaryDirectory(prefix="reins-sandbox-") as root:
        with Sandbox(Path(root) / "work", limits) as sandbox:
            for name, content in (task.get("files") or {}).items():
                sandbox.write_file(name, content)
            result = episode(client, task, sandbox, on_tool=on_tool, limits=limits)
        # Closed: nothing of the agent's still runs and writes while the checker reads.
        verdict = check(task, result.answer, sandbox.path)
    return result, verdict


def reward_reason(result: Episode, verdict: Verdict) -> str:
    return f"{verdict.reason}; {result.ended} ({result.tool_calls} tool calls)"


def metrics(result: Episode) -> dict[str, float]:
    return {
        "tool_calls": result.tool_calls,
        "finished": int(result.finished),
        "limit_hits": result.limit_hits,
    }


def rollout(client: OpenAI, task: dict[str, Any], *, limits: SandboxLimits = LIMITS) -> None:
    """One rollout with `client` as the model: the episode, its `tool` events and its reward."""
    result, verdict = play(client, task, limits=limits, on_tool=post_tool)
    report_reward(verdict.reward, reason=reward_reason(result, verdict), metrics=metrics(result))


def run(task: dict[str, Any]) -> None:
    """The agent the controller runs (`examples.sandbox.agent:run`); it reports its own reward."""
    rollout(OpenAI(max_retries=5, timeout=600), task)
