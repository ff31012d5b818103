"""A call's prompt and answer as chat messages, whatever wire API the harness spoke, so that the
rollout page reads every call the same way (`rollout.py` turns these into what it shows).

The record's `kind` says the API; `request` and `response` are in its shape, as the harness sent
and received them (`reins.gateway.capture`):

- `chat` (and any unknown kind): `messages`, and the recorded choice's `message`;
- `responses` (OpenAI Responses): `instructions` then `input` (a string, or items: messages,
  `function_call` / `custom_tool_call`, their `*_output`, `reasoning`), and the answer's `output`
  items;
- `messages` (Anthropic Messages): `system` then `messages` of content blocks (`text`,
  `tool_use`, `tool_result`, `thinking`), and the answer's `content` blocks;
- `completions`: no messages (None); the page shows its `prompt` and choice text.

Pure and tolerant: a record is whatever was stored (a harness's odd input, an event posted by
hand), so every shape not expected is kept as text, never an error. The shapes are read here,
not imported from `reins.gateway.wire`, whose translators refuse what they cannot serve.
"""

from __future__ import annotations

import json
from typing import Any

from reins.schemas import ModelRequest

Chat = dict[str, Any]
"""A chat message: `role`, `content` (text or parts), and optionally `reasoning_content`,
`tool_calls` (`{id, function: {name, arguments}}`), `tool_call_id`, `name`."""

RESPONSES = "responses"
MESSAGES = "messages"
_ASSISTANT_ITEMS = ("reasoning", "function_call", "custom_tool_call")


def kind_of(record: ModelRequest) -> str:
    kind = getattr(record, "kind", None)
    return kind if isinstance(kind, str) else "chat"


def choice(record: ModelRequest) -> dict[str, Any]:
    """The recorded choice of a chat or completions answer ({} when there is none)."""
    choices = record.response.get("choices")
    if not isinstance(choices, list) or not choices:
        return {}
    index = getattr(record, "choice_index", 0) or 0
    for candidate in choices:
        if isinstance(candidate, dict) and candidate.get("index", 0) == index:
            return candidate
    first = choices[0]
    return first if isinstance(first, dict) else {}


def prompt_messages(record: ModelRequest) -> list[Any] | None:
    """The prompt as chat messages; None when the call has none (a completions prompt)."""
    request = record.request
    kind = kind_of(record)
    if kind == RESPONSES:
        out: list[Any] = []
        if request.get("instructions") is not None:
            out.append({"role": "instructions", "content": request["instructions"]})
        raw = request.get("input")
        if isinstance(raw, list):
            out += _items(raw)
        elif raw is not None:
            out.append({"role": "user", "content": raw})
        return out
    if kind == MESSAGES:
        out = []
        if request.get("system") is not None:
            out.append({"role": "system", "content": request["system"]})
        raw = request.get("messages")
        for message in raw if isinstance(raw, list) else ():
            out += _blocks_message(message)
        return out
    messages = request.get("messages")
    return messages if isinstance(messages, list) else None


def answer_messages(record: ModelRequest) -> list[Any] | None:
    """The answer as chat messages; None when the answer has no such shape (a completions
    choice, or nothing recorded)."""
    response = record.response
    kind = kind_of(record)
    if kind == RESPONSES:
        output = response.get("output")
        return _items(output) if isinstance(output, list) and output else None
    if kind == MESSAGES:
        if "content" not in response:
            return None
        return _blocks_message({"role": response.get("role", "assistant"), **response})
    message = choice(record).get("message")
    return [message] if isinstance(message, dict) else None


def response_token_texts(record: ModelRequest) -> list[Any] | None:
    """The token texts the engine's logprobs gave the harness, if it asked for them."""
    if kind_of(record) == RESPONSES:
        output = record.response.get("output")
        entries = [
            entry
            for item in (output if isinstance(output, list) else ())
            if isinstance(item, dict) and item.get("type") == "message"
            for part in _list(item.get("content"))
            if isinstance(part, dict)
            for entry in _list(part.get("logprobs"))
        ]
        return [e.get("token") if isinstance(e, dict) else None for e in entries] or None
    logprobs = choice(record).get("logprobs")
    if isinstance(logprobs, dict):
        if isinstance(logprobs.get("content"), list):
            return [e.get("token") if isinstance(e, dict) else None for e in logprobs["content"]]
        if isinstance(logprobs.get("tokens"), list):
            return list(logprobs["tokens"])
    return None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


# -- OpenAI Responses ---------------------------------------------------------------------------


def _items(items: list[Any]) -> list[Chat]:
    """Responses items as chat messages. An assistant's reasoning, text and tool calls in a row
    are one assistant message, as the answer that made them: a call that sends the previous
    answer back then shows it as the same message (and the page can leave it out)."""
    out: list[Chat] = []
    joining = False  # the last message is an assistant turn that items may join
    for item in items:
        if not isinstance(item, dict):
            out.append({"role": "?", "content": item})
            joining = False
            continue
        kind = item.get("type", "message" if "role" in item else None)
        is_assistant = kind in _ASSISTANT_ITEMS or (
            kind == "message" and item.get("role") == "assistant"
        )
        if not is_assistant:
            out.append(_input_item(kind, item))
            joining = False
            continue
        if not joining:
            out.append({"role": "assistant", "content": ""})
            joining = True
        _join(out[-1], kind, item)
    return out


def _input_item(kind: Any, item: dict[str, Any]) -> Chat:
    if kind == "message":
        return {"role": str(item.get("role", "?")), "content": item.get("content")}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")}
    return {"role": str(kind or "item"), "content": json.dumps(item, ensure_ascii=False)}


def _join(turn: Chat, kind: Any, item: dict[str, Any]) -> None:
    """Adds an assistant-side item to the assistant message `turn`."""
    if kind == "reasoning":
        parts = _list(item.get("content")) or _list(item.get("summary"))
        text = "\n".join(p["text"] for p in parts if isinstance(p, dict) and "text" in p)
        turn["reasoning_content"] = "\n".join(t for t in (turn.get("reasoning_content"), text) if t)
    elif kind == "message":
        text = _parts_text(item.get("content"))
        turn["content"] = "\n".join(t for t in (turn["content"], text) if t)
    else:
        name = str(item.get("name", "?"))
        if isinstance(item.get("namespace"), str):
            name = f"{item['namespace']}.{name}"
        arguments = item.get("arguments") if kind == "function_call" else item.get("input")
        call = {"id": item.get("call_id"), "function": {"name": name, "arguments": arguments}}
        turn.setdefault("tool_calls", []).append(call)


def _parts_text(content: Any) -> str:
    """Output parts' text (a refusal says so)."""
    if isinstance(content, str):
        return content
    texts = []
    for part in _list(content):
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, dict) and isinstance(part.get("refusal"), str):
            texts.append(f"[refusal] {part['refusal']}")
        else:
            texts.append(json.dumps(part, ensure_ascii=False))
    return "\n".join(texts)


# -- Anthropic Messages -------------------------------------------------------------------------


def _blocks_message(message: Any) -> list[Chat]:
    """One Messages message as chat messages: its `tool_result` blocks become `tool` messages,
    in block order; the other blocks make the message itself (text, thinking, tool calls)."""
    if not isinstance(message, dict):
        return [{"role": "?", "content": message}]
    role = str(message.get("role", "?"))
    content = message.get("content")
    if not isinstance(content, list):
        return [{"role": role, "content": content}]
    out: list[Chat] = []
    current: Chat = {"role": role, "content": ""}
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result" and isinstance(block, dict):
            if _has_any(current):
                out.append(current)
                current = {"role": role, "content": ""}
            out.append(_tool_result(block))
        elif kind == "text" and isinstance(block, dict):
            current["content"] = _joined(current["content"], _text_of(block.get("text")))
        elif kind == "thinking" and isinstance(block, dict):
            thought = _text_of(block.get("thinking"))
            current["reasoning_content"] = _joined(current.get("reasoning_content", ""), thought)
        elif kind == "tool_use" and isinstance(block, dict):
            call = {
                "id": block.get("id"),
                "function": {"name": block.get("name", "?"), "arguments": block.get("input")},
            }
            current.setdefault("tool_calls", []).append(call)
        else:  # redacted thinking, an image, anything else: named, not shown
            shown = f"[{kind}]" if isinstance(kind, str) else json.dumps(block, ensure_ascii=False)
            current["content"] = _joined(current["content"], shown)
    if _has_any(current) or not out:
        out.append(current)
    return out


def _tool_result(block: dict[str, Any]) -> Chat:
    result: Chat = {"role": "tool", "tool_call_id": block.get("tool_use_id")}
    content = block.get("content")
    if isinstance(content, list):
        content = "\n".join(
            _text_of(part.get("text")) if isinstance(part, dict) and part.get("type") == "text"
            else f"[{part.get('type', 'part')}]" if isinstance(part, dict)
            else json.dumps(part, ensure_ascii=False)
            for part in content
        )  # fmt: skip
    result["content"] = content
    if block.get("is_error") is True:
        result["name"] = "error"
    return result


def _has_any(message: Chat) -> bool:
    return bool(message["content"] or message.get("reasoning_content") or message.get("tool_calls"))


def _text_of(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _joined(before: Any, text: str) -> str:
    return f"{before}\n{text}" if before else text
