"""A scripted stand-in for the LLM, for the sandbox example's tests: `ScriptedClient` answers each
`chat.completions.create` with the next fixed assistant turn of a script (tool calls decided in
advance, not by a model), as `openai` SDK objects, and checks that the harness keeps its history
append-only. `run` is an agent module the controller launches (`tests.examples.sandbox_scripted:
run`): the example's real rollout (sandbox, tools, checker, events) with this client as the model.

A script is a list of turns; a turn is a list of `[tool name, arguments]` calls, or a string (a
reply without a tool call).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_function_tool_call import (
    ChatCompletionMessageFunctionToolCall,
    Function,
)

from examples.sandbox.agent import rollout
from reins.sandbox import SandboxLimits

Turn = list[list[Any]] | str


class ScriptedClient:
    """Duck-types the part of `openai.OpenAI` the harness uses."""

    def __init__(self, script: list[Turn]) -> None:
        self.script = list(script)
        self.chat = SimpleNamespace(completions=self)
        self.requests: list[list[Any]] = []
        self.replies: list[ChatCompletionMessage] = []

    def create(self, *, messages: list[Any], **_: Any) -> ChatCompletion:
        if self.requests:  # append-only: the last request, then the reply as it was returned
            before = [*self.requests[-1], self.replies[-1]]
            if messages[: len(before)] != before or messages[len(before) - 1] is not before[-1]:
                raise AssertionError("the harness rewrote its history")
        self.requests.append(list(messages))
        turn = self.script[len(self.replies)]
        if isinstance(turn, str):
            message = ChatCompletionMessage(role="assistant", content=turn)
        else:
            calls = [
                ChatCompletionMessageFunctionToolCall(
                    id=f"call_{len(self.replies)}_{i}",
                    type="function",
                    function=Function(name=name, arguments=json.dumps(arguments)),
                )
                for i, (name, arguments) in enumerate(turn)
            ]
            message = ChatCompletionMessage(role="assistant", content=None, tool_calls=calls)
        self.replies.append(message)
        reason = "stop" if isinstance(turn, str) else "tool_calls"
        return ChatCompletion(
            id=f"scripted-{len(self.replies)}",
            object="chat.completion",
            created=0,
            model="scripted",
            choices=[Choice(index=0, finish_reason=reason, message=message)],
        )


def run(task: dict[str, Any]) -> None:
    """The example's rollout with the task's `script` as the model; a short wall limit keeps the
    tests quick."""
    rollout(ScriptedClient(task["script"]), task, limits=SandboxLimits(wall_s=5))  # type: ignore[arg-type]
