"""`reins doctor openai-chat` / `openai-chat-stream`: the `openai` SDK's chat completions, plain
or streamed (`--stream`: the answer assembled from the deltas, as a streaming harness does)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from reins.doctor.harnesses import task


def ask(client: Any, messages: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    common: dict[str, Any] = {
        "model": task.MODEL,
        "messages": messages,
        "tools": [task.CHAT_TOOL],
        "max_tokens": task.MAX_TOKENS,
        "temperature": 0,
    }
    if not stream:
        answer = client.chat.completions.create(**common)
        message: dict[str, Any] = answer.choices[0].message.model_dump(exclude_none=True)
        return message
    return assemble(client.chat.completions.create(stream=True, **common))


def assemble(chunks: Iterable[Any]) -> dict[str, Any]:
    """The assistant message a streaming harness builds from the SDK's chunks: the content's
    deltas joined, each tool call's name and arguments joined by its index."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        content.append(delta.content or "")
        for piece in delta.tool_calls or ():
            slot = calls.setdefault(
                piece.index,
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            slot["id"] = piece.id or slot["id"]
            if piece.function is not None:
                slot["function"]["name"] += piece.function.name or ""
                slot["function"]["arguments"] += piece.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    return message


def main(argv: list[str]) -> None:
    openai = task.require("openai", "openai")
    task.env("OPENAI_BASE_URL")
    client = openai.OpenAI(timeout=task.TIMEOUT_S, max_retries=0)
    stream = "--stream" in argv
    messages = task.chat_history()
    for number in range(task.turns()):
        message = ask(client, messages, stream)
        messages.append(message)
        messages += task.chat_next(message, number)
        print(f"call {number + 1}: {message}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
