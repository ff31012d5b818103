"""Chat messages in, prompt text out; generated text in, `content` and `tool_calls` out. Pure.

Tools: a chat template that knows tools (it mentions `tools`) gets them as they are. A template that
silently ignores them, like the default model's ChatML template, gets them described in the system
prompt in the widespread Hermes convention: the JSON schemas inside `<tools></tools>`, and calls
written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Earlier assistant tool calls
are written back in that form and tool results become `<tool_response>` user turns, so the model
sees its own convention in the history. Either way, `<tool_call>` blocks in the generated text are
parsed back into OpenAI `tool_calls`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"

TOOLS_PROMPT = """You can call functions. Their JSON schemas:
<tools>
{schemas}
</tools>
To call a function, answer with one block per call, holding a JSON object with the function's \
name and its arguments:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>"""


class ChatRequestError(ValueError):
    """The messages cannot be rendered; the message says which and why."""


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in str(chat_template)


def text_of(content: Any) -> str:
    """Message content as text: a string, None, or a list of `{"type": "text", ...}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                texts.append(str(part.get("text", "")))
            else:
                raise ChatRequestError(
                    f"message content part {part!r} is not text; this engine serves text models"
                )
        return "".join(texts)
    raise ChatRequestError(f"message content must be a string or a list of parts, not {content!r}")


def prepare_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, native_tools: bool
) -> list[dict[str, Any]]:
    """Messages a chat template can render (see the module docstring)."""
    if not messages:
        raise ChatRequestError("`messages` is empty")
    out: list[dict[str, Any]] = []
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ChatRequestError(f"messages[{position}] has no `role`")
        role = str(message["role"])
        if role == "developer":
            role = "system"
        content = text_of(message.get("content"))
        if native_tools:
            out.append({**message, "role": role, "content": content})
        elif role == "assistant" and message.get("tool_calls"):
            calls = [_tool_call_text(call) for call in message["tool_calls"]]
            out.append({"role": role, "content": "\n".join([content, *calls]).strip("\n")})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools and not native_tools:
        described = TOOLS_PROMPT.format(schemas="\n".join(json.dumps(tool) for tool in tools))
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def _tool_call_text(call: Any) -> str:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        parsed = arguments
    body = json.dumps({"name": function.get("name", ""), "arguments": parsed})
    return f"{TOOL_CALL_OPEN}\n{body}\n</tool_call>"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a generated text; blocks that are not valid calls stay text."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in TOOL_CALL.finditer(text):
        call = _parse_call(match.group(1))
        if call is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    content = "".join(kept).strip()
    if not calls:
        return text, []
    return (content or None), calls


def _parse_call(body: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": parsed["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }
