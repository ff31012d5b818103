"""What a harness received from one call, and whether the recorded tokens say exactly that.

Pure: a recorded `model_request`'s `response` (the answer as the harness got it, a stream
assembled into one answer) is read in its wire API's shape (`kind`: `chat`, `completions`,
`responses`, `messages`) into text and tool calls; the recorded response token IDs, decoded as the
harness is shown text (special tokens dropped), must say the same: the same text, or text whose
`<tool_call>` blocks parse to the same calls (name and arguments compared as JSON values), with
the text around them as the harness got it. Reasoning the API hands over apart from the content
(`reasoning_content`, `thinking` blocks, `reasoning` items) only has to occur in the decoded text
before the content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from reins.engine.chat import parse_tool_calls

ToolCall = tuple[str, Any]
"""(name, parsed arguments)."""


@dataclass(frozen=True)
class Answer:
    """Text and tool calls of one answer."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""
    """Reasoning the API returned apart from the text (empty: none)."""


class UnreadableAnswer(ValueError):
    """The recorded answer is not in the shape its `kind` names."""


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def received_answer(kind: str, response: dict[str, Any]) -> Answer:
    """The answer a harness received, read from the recorded `response` of API `kind`."""
    texts: list[str] = []
    calls: list[ToolCall] = []
    reasoning: list[str] = []
    try:
        if kind == "chat":
            message = response["choices"][0]["message"]
            texts.append(message.get("content") or "")
            reasoning.append(message.get("reasoning_content") or message.get("reasoning") or "")
            for call in message.get("tool_calls") or ():
                function = call["function"]
                calls.append((function["name"], _arguments(function["arguments"])))
        elif kind == "completions":
            texts.append(response["choices"][0].get("text") or "")
        elif kind == "responses":
            for item in response["output"]:
                if item["type"] == "message":
                    texts += [p["text"] for p in item["content"] if p["type"] == "output_text"]
                elif item["type"] == "function_call":
                    calls.append((item["name"], _arguments(item["arguments"])))
                elif item["type"] == "reasoning":
                    parts = item.get("content") or item.get("summary") or ()
                    reasoning += [str(p.get("text", "")) for p in parts]
        elif kind == "messages":
            for block in response["content"]:
                if block["type"] == "text":
                    texts.append(block["text"])
                elif block["type"] == "tool_use":
                    calls.append((block["name"], block["input"]))
                elif block["type"] == "thinking":
                    reasoning.append(block.get("thinking", ""))
        else:
            raise UnreadableAnswer(f"unknown kind {kind!r}")
    except (KeyError, IndexError, TypeError) as error:
        raise UnreadableAnswer(f"a {kind} answer without {error}") from error
    return Answer("".join(texts), tuple(calls), "".join(reasoning))


def decoded_answer(text: str) -> Answer:
    """What decoded response tokens say: their text, or the tool calls parsed out of it (the
    text around the calls as the engine shows it)."""
    content, parsed = parse_tool_calls(text)
    if not parsed:
        return Answer(text)
    calls = tuple((c["function"]["name"], _arguments(c["function"]["arguments"])) for c in parsed)
    return Answer(content or "", calls)


def matches(decoded_text: str, received: Answer) -> bool:
    """Whether tokens that decode to `decoded_text` are what the harness `received`."""
    if received.reasoning:
        # Reasoning handed over apart: the decoded text holds it, then the answer.
        at = decoded_text.find(received.reasoning.strip())
        if at < 0:
            return False
        rest = decoded_text[at + len(received.reasoning.strip()) :]
        rest = rest.split("</think>", 1)[-1] if "</think>" in rest else rest
        return matches(rest.lstrip(), Answer(received.text.lstrip(), received.tool_calls))
    if not received.tool_calls:
        # No calls offered or none sampled: the harness got the text as it is.
        return decoded_text == received.text
    said = decoded_answer(decoded_text)
    return said.tool_calls == received.tool_calls and said.text == received.text
