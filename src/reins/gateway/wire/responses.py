"""The OpenAI Responses API (Codex, OpenCode, the Agents SDK) over the engine's chat completions.

Pure: the harness's `POST /v1/responses` body in, the engine's chat request out; the engine's
chat answer or stream chunks in, a `Response` object or the Responses SSE events out.

Invariants and decisions:
- Stateless. The gateway stores no responses: `previous_response_id`, `conversation`,
  `background: true`, `prompt` (a stored template) and `item_reference` items are answered 400
  with what to send instead (the whole input, `store: false`, as Codex and OpenCode do).
- One chat message per input message: system and developer become `system`; content parts are
  text only (images, files and audio are a 400: the engine serves text models) and are joined
  with "\\n", as vLLM joins text parts. `instructions` is a leading system message. A
  `function_call`/`custom_tool_call` joins the preceding assistant message's `tool_calls` (or
  opens an assistant turn); its output becomes a `tool` message and must answer a call earlier in
  the same input, so the next request maps a call id back to the same chat `tool_call_id`.
  A `reasoning` item's own text (its `reasoning_text` content, as this gateway answers the
  engine's `reasoning_content`) is the next assistant turn's `reasoning_content`, as a Messages
  `thinking` block is, so the engine's template decides what earlier reasoning the model sees;
  one with only a summary or encrypted content is dropped with a note.
- Tool names. `function` tools keep their names. A `custom` (freeform) tool becomes a function
  with one string parameter `input`; its grammar is described, not enforced. A function or custom
  tool nested in a `namespace` tool is the chat function `{namespace}__{name}` (the separator of
  Codex's own `mcp__server__tool` names); a call of it is reported as the openai-python types
  define one (`ResponseFunctionToolCall` / `ResponseCustomToolCall`): `name` the nested tool's
  name, `namespace` the namespace's. The map back is built from the request's own tools, and
  two tools with one chat name are a 400, so the mapping is never ambiguous. Hosted tools
  (web_search, file_search, mcp, ...) are dropped with a note.
- `text.format` json_schema / json_object is the chat `response_format`, and a function tool's
  `strict` its chat function's `strict` (constrained decoding is kept, as in chat completions: the
  harness must be able to parse its answer).
- Output items: reasoning and text in the order they arrived, one open at a time, then the tool
  calls. Streamed tool calls are held until the engine's finish (the pieces of parallel calls
  may interleave, text may come between them), then sent whole in index order with the engine's
  argument pieces as deltas, so a streamed answer is the non-streamed one. Leading whitespace
  with no text after it is no message (the space before a `<tool_call>`). Engine reasoning
  (`reasoning_content`) becomes a `reasoning` item with `reasoning_text` content.
- Logprobs: `include: ["message.output_text.logprobs"]` asks the engine for chat logprobs (with
  `top_logprobs` alternatives); every token's entry goes with the message (a streamed delta
  carries those that arrived with or before its text), so a stream shows what the whole answer
  does.
- Streams: every event has `type` and a `sequence_number` counting from 0; `stream_end` closes
  the open item and sends `response.completed` (or `response.incomplete` on length/abort); an
  engine error chunk sends `response.failed` and nothing follows.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from reins.gateway import jsonrule
from reins.gateway.wire import WireError, sse, tool_call_index
from reins.gateway.wire.overflow import Overflow, openai_body

KIND = "responses"
SEPARATOR = "__"
"""Between a namespace's name and a nested tool's name in the chat function's name."""

_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
_ERROR_TYPES[429] = "rate_limit_error"
LOGPROBS = "message.output_text.logprobs"
"""The `include` value that asks for the message text's token logprobs."""
_IGNORED = {
    "max_tool_calls": "`max_tool_calls` is not enforced",
    "service_tier": "`service_tier` is ignored",
    "stop": "`stop` is not a Responses API field; ignored",
    "context_management": "`context_management` is ignored",
}
_STATEFUL = {
    "previous_response_id": "this gateway does not store responses; send the whole "
    "conversation in `input` with `store: false`",
    "conversation": "this gateway stores no conversations; send the whole conversation in `input`",
    "background": "this gateway stores no responses to poll; stream or wait for the answer",
    "prompt": "stored prompt templates are not served; send the text in `instructions`/`input`",
}
_KNOWN = {
    *_IGNORED,
    *("include", "top_logprobs"),
    *_STATEFUL,
    *("model", "input", "instructions", "tools", "tool_choice", "max_output_tokens"),
    *("temperature", "top_p", "parallel_tool_calls", "stream", "stream_options", "store"),
    *("prompt_cache_key", "prompt_cache_retention", "client_metadata", "metadata", "user"),
    *("safety_identifier", "truncation", "reasoning", "text"),
}


def error_body(
    status: int,
    message: str,
    kind: str | None = None,
    *,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """An error as the OpenAI API answers one: `{"error": {message, type, param, code}}`."""
    kind = kind or _ERROR_TYPES.get(status, "server_error" if status >= 500 else None)
    error = {"message": message, "type": kind or "invalid_request_error", "param": param}
    return {"error": error | {"code": code}}


def overflow_body(overflow: Overflow) -> dict[str, Any]:
    """OpenAI's answer to an input too long for the model: code `context_length_exceeded`
    (Codex reads it), the engine's words."""
    return openai_body(overflow, "input")


@dataclass(frozen=True)
class _Tool:
    """What a chat function name stands for in the harness's tools."""

    kind: Literal["function", "custom"]
    name: str
    namespace: str | None


def translate(body: dict[str, Any]) -> Translation:
    """The engine's chat request for a Responses body; WireError (400) for one it cannot serve."""
    if not isinstance(body, dict):
        raise WireError("the request body must be a JSON object")
    for key, problem in _STATEFUL.items():
        if body.get(key) not in (None, False):
            raise _bad(key, f"`{key}` cannot be served: {problem}")
    if not isinstance(body.get("model"), str):  # OpenAI's 400 too: the answer names its model
        raise _bad(
            "model",
            f"`model` is required: the model's name, a string, not {_show(body.get('model'))}",
        )
    notes: list[str] = []
    chat_tools, tools = _tools(body.get("tools"), notes)
    choice, chat_tools = _tool_choice(body.get("tool_choice"), chat_tools, tools, notes)
    stream = _get(body, "stream", bool, "true or false") or False
    chat: dict[str, Any] = {"messages": _messages(body, notes), "stream": stream}
    if stream:
        chat["stream_options"] = {"include_usage": True}
    if chat_tools:
        chat["tools"] = chat_tools
        if choice is not None:
            chat["tool_choice"] = choice
        if _get(body, "parallel_tool_calls", bool, "true or false") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    elif choice == "required":
        raise _bad("tool_choice", "`tool_choice` is `required` but no tool this gateway serves")
    limit = _get(body, "max_output_tokens", int, "a positive integer")
    if limit is not None:
        if limit < 1:
            raise _bad("max_output_tokens", "`max_output_tokens` must be at least 1")
        chat["max_tokens"] = limit
    for key, most in (("temperature", 2), ("top_p", 1)):
        value = _get(body, key, (int, float), "a number")
        if value is not None:
            if not 0 <= value <= most:  # OpenAI's 400, whatever the mode then samples with
                raise _bad(key, f"`{key}` must be a number from 0 to {most}")
            chat[key] = value
    form = _response_format(body.get("text"))
    if form is not None:
        chat["response_format"] = form
    shows_logprobs = _logprobs(body, chat, notes)
    _note_ignored(body, notes)
    return Translation(
        chat, _echo(body), tools, notes, stream=stream, shows_logprobs=shows_logprobs
    )


def _logprobs(body: dict[str, Any], chat: dict[str, Any], notes: list[str]) -> bool:
    """Whether the answer shows the message text's token logprobs (`include` names
    `LOGPROBS`), with `top_logprobs` alternatives each; the chat request asks for them."""
    include = _get(body, "include", list, "a list of strings") or []
    if not all(isinstance(value, str) for value in include):
        raise _bad("include", f"`include` must be a list of strings, not {_show(include)}")
    others = sorted(set(include) - {LOGPROBS})
    if others:
        notes.append(
            f"`include` {', '.join(others)} ignored: no encrypted reasoning or extra fields are "
            "returned"
        )
    top = _get(body, "top_logprobs", int, "an integer from 0 to 20")
    if top is not None and not 0 <= top <= 20:
        raise _bad("top_logprobs", f"`top_logprobs` must be from 0 to 20, not {top}")
    if LOGPROBS not in include:
        if top:
            notes.append(f"`top_logprobs` is ignored: `include` does not name {LOGPROBS}")
        return False
    chat["logprobs"] = True
    if top:
        chat["top_logprobs"] = top
    return True


def _bad(param: str, message: str) -> WireError:
    return WireError(message, param=param)


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _get(where: dict[str, Any], key: str, types: Any, what: str, path: str = "") -> Any:
    """`where[key]` when it is of `types` (never a bool for numbers), None when absent or null."""
    value = where.get(key)
    if value is None:
        return None
    wants_bool = types is bool or (isinstance(types, tuple) and bool in types)
    if not isinstance(value, types) or (isinstance(value, bool) and not wants_bool):
        name = f"{path}.{key}" if path else key
        raise _bad(name, f"`{name}` must be {what}, not {_show(value)}")
    return value


def _need(item: dict[str, Any], key: str, path: str) -> str:
    value = _get(item, key, str, "a string", path)
    if value is None:
        raise _bad(f"{path}.{key}", f"`{path}` has no `{key}`; it is required")
    return str(value)


def _note_ignored(body: dict[str, Any], notes: list[str]) -> None:
    notes.extend(note for key, note in _IGNORED.items() if body.get(key) not in (None, [], {}))
    if body.get("store") is True:
        notes.append("`store: true` is ignored: this gateway does not store responses")
    if body.get("truncation") == "auto":
        notes.append("`truncation: auto` is ignored: a prompt too long for the engine fails")
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and any(v is not None for v in reasoning.values()):
        notes.append("`reasoning` settings are ignored: the model reasons as its template makes it")
    text = body.get("text")
    if isinstance(text, dict) and text.get("verbosity") is not None:
        notes.append("`text.verbosity` is ignored")
    unknown = sorted(key for key in body if key not in _KNOWN)
    if unknown:
        notes.append(f"unknown fields ignored: {', '.join(unknown)}")


def _response_format(text: Any) -> dict[str, Any] | None:
    """The chat `response_format` of `text.format`: structured output is constrained as a chat
    call's `response_format` is (the engine enforces it, as vLLM does), so the harness can parse
    its answer (docs/proxy.md, "Sampling per mode"); None for plain text."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", f"`text` must be an object, not {_show(text)}")
    form = text.get("format")
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise _bad(
            "text.format",
            f"`text.format` must be a text, json_object or json_schema format, not {_show(form)}",
        )
    assert isinstance(form, dict)
    schema = _get(form, "schema", dict, "a JSON schema object", "text.format")
    if schema is None:
        raise _bad("text.format.schema", "`text.format` json_schema has no `schema`")
    chat = {"name": _need(form, "name", "text.format"), "schema": schema}
    if _get(form, "description", str, "a string", "text.format") is not None:
        chat["description"] = form["description"]
    if _get(form, "strict", bool, "true or false", "text.format") is not None:
        chat["strict"] = form["strict"]
    return {"type": "json_schema", "json_schema": chat}


def _echo(body: dict[str, Any]) -> dict[str, Any]:
    """The request's settings as a `Response` object repeats them."""
    metadata = _get(body, "metadata", dict, "an object of strings")
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise _bad("metadata", "`metadata` values must be strings")
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata or {},
        "model": body["model"],
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": None,
        "reasoning": body["reasoning"] if isinstance(body.get("reasoning"), dict) else None,
        "temperature": body.get("temperature"),
        "text": body["text"]
        if isinstance(body.get("text"), dict)
        else {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "auto" if body.get("truncation") == "auto" else "disabled",
        "background": False,
    }
    for key in ("user", "prompt_cache_key", "safety_identifier"):
        if isinstance(body.get(key), str):
            echo[key] = body[key]
    return echo


# --- tools -------------------------------------------------------------------------------------


def _tools(raw: Any, notes: list[str]) -> tuple[list[dict[str, Any]], dict[str, _Tool]]:
    """The chat functions, and what each chat function name stands for."""
    if raw is None:
        return [], {}
    if not isinstance(raw, list):
        raise _bad("tools", f"`tools` must be a list, not {_show(raw)}")
    chat: list[dict[str, Any]] = []
    tools: dict[str, _Tool] = {}
    for index, tool in enumerate(raw):
        path = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in ("function", "custom"):
            chat.append(_chat_tool(tool, None, "", path, tools, notes))
        elif kind == "namespace":
            namespace = _need(tool, "name", path)
            about = _get(tool, "description", str, "a string", path) or ""
            nested = tool.get("tools")
            if not isinstance(nested, list):
                raise _bad(f"{path}.tools", f"`{path}.tools` must be a list of tools")
            for position, inner in enumerate(nested):
                where = f"{path}.tools[{position}]"
                if not isinstance(inner, dict) or inner.get("type") not in ("function", "custom"):
                    raise _bad(where, f"`{where}` must be a function or custom tool")
                chat.append(_chat_tool(inner, namespace, about, where, tools, notes))
        elif isinstance(kind, str):
            notes.append(f"hosted tool `{kind}` ({path}) dropped: the engine serves functions")
        else:
            raise _bad(path, f"`{path}` must be a tool object with a `type`, not {_show(tool)}")
    return chat, tools


def _chat_tool(
    tool: dict[str, Any],
    namespace: str | None,
    about: str,
    path: str,
    tools: dict[str, _Tool],
    notes: list[str],
) -> dict[str, Any]:
    kind: Literal["function", "custom"] = "custom" if tool.get("type") == "custom" else "function"
    name = _need(tool, "name", path)
    chat_name = name if namespace is None else f"{namespace}{SEPARATOR}{name}"
    if chat_name in tools:
        raise _bad(f"{path}.name", f"`{path}`: two tools are named `{chat_name}`; rename one")
    tools[chat_name] = _Tool(kind, name, namespace)
    description = _get(tool, "description", str, "a string", path) or ""
    function: dict[str, Any] = {"name": chat_name}
    if about or description:
        function["description"] = "\n\n".join(text for text in (about, description) if text)
    if kind == "function":
        parameters = _get(tool, "parameters", dict, "a JSON schema object", path)
        function["parameters"] = parameters or {"type": "object", "properties": {}}
        # The arguments' constraint, kept as a chat call's is (the Agents SDK sends `strict:
        # true` on every function tool): an engine that enforces it (vLLM's structured
        # outputs) sees it, as for `text.format`.
        if _get(tool, "strict", bool, "true or false", path) is not None:
            function["strict"] = tool["strict"]
    else:
        function["parameters"] = {
            "type": "object",
            "properties": {"input": {"type": "string", "description": _custom_input(tool, notes)}},
            "required": ["input"],
            "additionalProperties": False,
        }
    return {"type": "function", "function": function}


def _custom_input(tool: dict[str, Any], notes: list[str]) -> str:
    """The `input` parameter's description: free text, or the grammar it must follow."""
    form = tool.get("format")
    definition = form.get("definition") if isinstance(form, dict) else None
    if isinstance(form, dict) and form.get("type") == "grammar" and isinstance(definition, str):
        notes.append(f"custom tool `{tool['name']}`: its grammar is described, not enforced")
        return f"The input, in this {form.get('syntax')} grammar:\n{definition}"
    return "The input, as free text."


def _tool_choice(
    raw: Any, chat: list[dict[str, Any]], tools: dict[str, _Tool], notes: list[str]
) -> tuple[Any, list[dict[str, Any]]]:
    """The chat `tool_choice`, and the chat tools left (`allowed_tools` narrows them)."""
    if raw is None or raw in ("auto", "none", "required"):
        return raw, chat
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("function", "custom"):
        name = _need(raw, "name", "tool_choice")
        namespace = _get(raw, "namespace", str, "a string", "tool_choice")
        return {"type": "function", "function": {"name": _resolve(name, namespace, tools)}}, chat
    if kind == "allowed_tools":
        mode, listed = raw.get("mode"), raw.get("tools")
        if mode not in ("auto", "required") or not isinstance(listed, list):
            raise _bad("tool_choice", "allowed_tools needs `mode` auto or required and `tools`")
        allowed = {
            _resolve(entry["name"], entry.get("namespace"), tools, strict=False)
            for entry in listed
            if isinstance(entry, dict) and isinstance(entry.get("name"), str)
        }
        notes.append("`tool_choice` allowed_tools: the engine is given only the allowed tools")
        return mode, [tool for tool in chat if tool["function"]["name"] in allowed]
    if isinstance(raw, dict):
        raise _bad("tool_choice", f"`tool_choice` forces {_show(kind)}, a tool not served here")
    raise _bad("tool_choice", "`tool_choice` must be auto, none, required or an object")


def _resolve(name: str, namespace: Any, tools: dict[str, _Tool], *, strict: bool = True) -> str:
    """The chat function name of a tool the harness names (with or without its namespace)."""
    if isinstance(namespace, str) and f"{namespace}{SEPARATOR}{name}" in tools:
        return f"{namespace}{SEPARATOR}{name}"
    nested = [key for key, tool in tools.items() if tool.name == name]
    if name in tools or len(nested) != 1:
        if strict and name not in tools:
            raise _bad(
                "tool_choice", f"`tool_choice` names `{name}`, not a function or custom tool"
            )
        return name
    return nested[0]


# --- input -------------------------------------------------------------------------------------


def _messages(body: dict[str, Any], notes: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if _get(body, "instructions", str, "a string"):
        out.append({"role": "system", "content": body["instructions"]})
    raw = body.get("input")
    if isinstance(raw, str):
        out.append({"role": "user", "content": raw})
    elif isinstance(raw, list):
        out.extend(_history(raw, notes))
    elif raw is not None:
        raise _bad("input", f"`input` must be a string or a list of items, not {_show(raw)}")
    if not out:
        raise _bad("input", "`input` is required: a string or a list of items")
    return out


def _history(items: list[Any], notes: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    called: set[str] = set()
    dropped = 0
    reasoning: list[str] = []
    """The text of reasoning items not yet given to the assistant turn they precede."""
    for index, item in enumerate(items):
        path = f"input[{index}]"
        if not isinstance(item, dict):
            raise _bad(path, f"`{path}` must be an object, not {_show(item)}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _message(item, path)
            if message["role"] == "assistant":
                _give_reasoning(message, reasoning)
            elif reasoning:  # no assistant turn followed it
                dropped += len(reasoning)
                reasoning.clear()
            out.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            call = _call(item, path)
            if out and out[-1]["role"] == "assistant":
                turn = out[-1]
                turn.setdefault("tool_calls", []).append(call)
            else:
                turn = {"role": "assistant", "content": None, "tool_calls": [call]}
                out.append(turn)
            _give_reasoning(turn, reasoning)
            called.add(call["id"])
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _need(item, "call_id", path)
            if call_id not in called:
                raise _bad(
                    f"{path}.call_id",
                    f"`{path}` answers the call `{call_id}`, but no function_call or "
                    "custom_tool_call before it in `input` has that call_id; this gateway "
                    "stores no responses, so send the whole history",
                )
            output = item.get("output")
            content = _text("" if output is None else output, f"{path}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
            dropped += len(reasoning)
            reasoning.clear()
        elif kind == "reasoning":
            text = _reasoning_text(item, path)
            if text:
                reasoning.append(text)
            else:  # a summary or encrypted content only: not the model's own text
                dropped += 1
        elif kind == "item_reference":
            raise _bad(path, f"`{path}` is an item_reference: no items are stored; send the item")
        else:
            raise _bad(
                f"{path}.type",
                f"`{path}` has the type {_show(kind)}, which this gateway cannot serve: it "
                "serves messages, function and custom tool calls and their outputs",
            )
    dropped += len(reasoning)
    if dropped:
        notes.append(
            f"{dropped} reasoning item(s) in `input` dropped (no reasoning_text content, or no "
            "assistant turn after them)"
        )
    return out


def _reasoning_text(item: dict[str, Any], path: str) -> str:
    """A reasoning item's own text (its `reasoning_text` content, as the gateway answers it);
    empty for one with only a summary or encrypted content."""
    content = item.get("content")
    return _text(content, f"{path}.content") if content else ""


def _give_reasoning(turn: dict[str, Any], reasoning: list[str]) -> None:
    """The reasoning items before an assistant turn, as its chat `reasoning_content`, where the
    engine's answer had it: a chat template that renders earlier reasoning (Qwen3's, within a
    tool-calling turn) then renders the turn as it was sampled, as for a Messages `thinking`
    block."""
    if reasoning:
        earlier = turn.get("reasoning_content")
        turn["reasoning_content"] = "\n".join([earlier, *reasoning] if earlier else reasoning)
        reasoning.clear()


def _call(item: dict[str, Any], path: str) -> dict[str, Any]:
    """A chat tool call from a `function_call` or `custom_tool_call` item."""
    call_id, name = _need(item, "call_id", path), _need(item, "name", path)
    namespace = _get(item, "namespace", str, "a string", path)
    if item.get("type") == "function_call":
        arguments = _need(item, "arguments", path)
    else:
        arguments = json.dumps({"input": _need(item, "input", path)}, ensure_ascii=False)
    chat_name = name if namespace is None else f"{namespace}{SEPARATOR}{name}"
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": chat_name, "arguments": arguments},
    }


def _message(item: dict[str, Any], path: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise _bad(f"{path}.role", f"`{path}.role` must be one of {_ROLES}, not {_show(role)}")
    if item.get("content") is None:
        raise _bad(f"{path}.content", f"`{path}` has no `content`")
    chat_role = "system" if role in ("system", "developer") else role
    return {"role": chat_role, "content": _text(item["content"], f"{path}.content")}


def _text(content: Any, path: str) -> str:
    """A string, or text parts joined with "\\n"; anything but text is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(path, f"`{path}` must be a string or a list of parts, not {_show(content)}")
    texts = []
    for index, part in enumerate(content):
        where = f"{path}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS or kind == "refusal":
            texts.append(_need(part, "refusal" if kind == "refusal" else "text", where))
        elif kind in _MEDIA_PARTS:
            raise _bad(where, f"`{where}` is {kind}: this engine serves text models; send text")
        else:
            raise _bad(where, f"`{where}` must be an input_text or output_text part")
    return "\n".join(texts)


# --- output ------------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _output_text(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _logprob_entries(choice: dict[str, Any]) -> list[Any]:
    """A chat choice's token logprobs (token, logprob, bytes, top_logprobs: the Responses
    entry's fields too)."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return (
        [entry for entry in content if isinstance(entry, dict)] if isinstance(content, list) else []
    )


@dataclass
class _Item:
    """One output item: its text (message, reasoning, function arguments) and call fields."""

    kind: Literal["message", "reasoning", "function_call", "custom_tool_call"]
    id: str
    index: int = 0
    text: str = ""
    call_id: str = ""
    name: str = ""
    namespace: str | None = None
    status: str = "in_progress"
    raw: str = ""
    """A custom call's chat arguments, `{"input": ...}`, as they arrive."""
    logprobs: list[Any] = field(default_factory=list)
    """A message's token logprobs, when the request included them."""

    def body(self, final: bool = True) -> dict[str, Any]:
        """The item as the API shows it: whole, or empty as `output_item.added` opens it."""
        text = self.text if final else ""
        head: dict[str, Any] = {"type": self.kind, "id": self.id}
        if self.kind == "message":
            parts = [_output_text(text, self.logprobs)] if final else []
            return head | {"role": "assistant", "status": self.status, "content": parts}
        if self.kind == "reasoning":
            parts = [{"type": "reasoning_text", "text": text}] if final else []
            return head | {"summary": [], "content": parts, "status": self.status}
        head |= {"call_id": self.call_id, "name": self.name}
        if self.kind == "function_call":
            head |= {"arguments": text, "status": self.status}
        else:
            head["input"] = text
        return head | ({"namespace": self.namespace} if self.namespace is not None else {})


@dataclass
class _HeldCall:
    """A streamed tool call, held until it is complete."""

    call_id: str = ""
    name: str = ""
    pieces: list[str] = field(default_factory=list)


def _usage(usage: Any, counted: tuple[int, int]) -> dict[str, Any]:
    """Responses usage from chat usage; what the engine did not count is counted from its token
    IDs (`counted`: prompt, output)."""
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    counts = (usage.get("prompt_tokens"), usage.get("completion_tokens"), cached)
    prompt, output, cached = (n if isinstance(n, int) else None for n in counts)
    prompt = counted[0] if prompt is None else prompt
    output = counted[1] if output is None else output
    cached = cached or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


class Translation:
    """One Responses request: its chat request; then its answer, or its events, from the engine's.

    Single use: `answer` once, or `stream_events` per chunk then `stream_end` once.
    """

    def __init__(
        self,
        chat: dict[str, Any],
        echo: dict[str, Any],
        tools: dict[str, _Tool],
        notes: list[str],
        *,
        stream: bool,
        shows_logprobs: bool = False,
    ) -> None:
        self.notes = notes
        """What was dropped or ignored, for the record."""
        self.stream = stream
        """Whether the harness asked for a stream."""
        self.shows_logprobs = shows_logprobs
        """The harness included the message text's logprobs: chat's token entries (all of the
        answer's tokens, as vLLM's Responses API gives them) go with the message."""
        self._held_logprobs: list[Any] = []  # entries not yet sent with a text delta
        self._chat, self._echo, self._tools = chat, echo, tools
        self._id, self._created = _new_id("resp"), int(time.time())
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, _HeldCall] = {}  # the engine's tool-call index -> its call
        self._last_call: int | None = None
        self._pending = ""  # whitespace that may yet start a message
        self._events: list[bytes] = []
        self._sequence = 0
        self._closing_from: int | None = None  # the first sequence number `stream_end` used
        self._started = False
        self._finish_reason: Any = None
        self._usage: Any = None
        self._counted = (0, 0)  # prompt and output token IDs seen, for an engine without usage
        self._final: dict[str, Any] | None = None

    def chat_request(self) -> dict[str, Any]:
        """The engine's chat-completions body (without `model`: the proxy sets it)."""
        return dict(self._chat)

    def sent_to_engine(self, body: dict[str, Any]) -> None:
        """Nothing to read: an answer the length limit ended is `max_output_tokens` whichever
        limit it met (OpenAI's API has no reason for a context's end)."""

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The `Response` object for the engine's (non-streamed) chat completion."""
        self._started = True  # one object, no events: the opening events are not made
        if chat.get("error") is not None:
            self._fail(chat["error"])
        else:
            choices = chat.get("choices")
            choice = choices[0] if isinstance(choices, list) and choices else None
            choice = choice if isinstance(choice, dict) else {}
            message = choice.get("message")
            message = dict(message) if isinstance(message, dict) else {}
            calls = message.get("tool_calls")
            if isinstance(calls, list):  # a whole message's calls: their positions are indexes
                message["tool_calls"] = [
                    {**call, "index": position} if isinstance(call, dict) else call
                    for position, call in enumerate(calls)
                ]
            self._hold_logprobs(choice)
            self._feed(message)
            self._finish_reason, self._usage = choice.get("finish_reason"), chat.get("usage")
            self._count(chat, choice)
            self._finish()
        self._events.clear()
        return self.assembled()

    def stream_events(self, chunk: dict[str, Any]) -> list[bytes]:
        """The SSE events for one engine chunk (the first call also opens the response)."""
        if self._final is not None:
            return []
        self._start()
        if chunk.get("error") is not None:
            self._fail(chunk["error"])
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        self._count(chunk, None)
        choices = chunk.get("choices") if self._final is None else None
        for choice in choices if isinstance(choices, list) else ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._hold_logprobs(choice)
                delta = choice.get("delta")
                self._feed(delta if isinstance(delta, dict) else {})
                self._count({}, choice)
                if choice.get("finish_reason"):
                    self._finish_reason = choice["finish_reason"]
                    self._flush_calls()
        return self._take()

    def stream_end(self) -> list[bytes]:
        """The closing events: the open item's `.done` events, then `response.completed`."""
        if self._final is not None:
            return []
        self._closing_from = self._sequence
        self._start()
        self._finish()
        return self._take()

    def stream_refusal(self, message: str, status: int = 409) -> list[bytes]:
        """`response.failed` in place of the closing events `stream_end` built, which were not
        sent: its number follows the last event sent (`status`: the message says why)."""
        if self._closing_from is not None:
            self._sequence = self._closing_from
        # `server_error`: the SDK's `ResponseError.code` has no conflict; the message says why.
        self._final = {
            **self._response("failed"),
            "error": {"code": "server_error", "message": message},
        }
        self._emit("response.failed", response=self._final)
        return self._take()

    def assembled(self) -> dict[str, Any]:
        """The whole `Response` as the harness received it (after `stream_end` or `answer`)."""
        return self._final if self._final is not None else self._response("in_progress")

    # --- building the output, item by item, with its events ---

    def _emit(self, kind: str, **fields: Any) -> None:
        data = {"type": kind, **fields, "sequence_number": self._sequence}
        self._events.append(sse(kind, data))
        self._sequence += 1

    def _take(self) -> list[bytes]:
        events, self._events = self._events, []
        return events

    def _start(self) -> None:
        if not self._started:
            self._started = True
            self._emit("response.created", response=self._response("in_progress"))
            self._emit("response.in_progress", response=self._response("in_progress"))

    def _feed(self, delta: dict[str, Any]) -> None:
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            self._text("reasoning", reasoning)
        if isinstance(delta.get("content"), str) and delta["content"]:
            self._text("message", delta["content"])
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict):
                self._hold(call)

    def _hold_logprobs(self, choice: dict[str, Any]) -> None:
        if self.shows_logprobs:
            self._held_logprobs += _logprob_entries(choice)

    def _message_logprobs(self) -> list[Any]:
        """The held entries, now the open message's."""
        assert self._open is not None
        entries, self._held_logprobs = self._held_logprobs, []
        self._open.logprobs += entries
        return entries

    def _text(self, kind: Literal["message", "reasoning"], piece: str) -> None:
        if self._open is None or self._open.kind != kind:
            if kind == "message" and not (self._pending + piece).strip():
                self._pending += piece  # no message item for whitespace alone
                return
            self._add(_Item(kind, _new_id("msg" if kind == "message" else "rs")))
            part = _output_text("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            self._emit("response.content_part.added", **self._where(), content_index=0, part=part)
        if kind == "message":
            piece, self._pending = self._pending + piece, ""
        assert self._open is not None
        self._open.text += piece
        extra: dict[str, Any] = {"logprobs": self._message_logprobs()} if kind == "message" else {}
        name = "output_text" if kind == "message" else "reasoning_text"
        self._emit(f"response.{name}.delta", **self._where(), content_index=0, delta=piece, **extra)

    def _count(self, chat: dict[str, Any], choice: dict[str, Any] | None) -> None:
        """Counts the prompt's and the answer's token IDs, for usage the engine did not send."""
        prompt, output = self._counted
        if isinstance(chat.get("prompt_token_ids"), list):
            prompt = len(chat["prompt_token_ids"])
        ids = choice.get("token_ids") if choice is not None else None
        self._counted = (prompt, output + (len(ids) if isinstance(ids, list) else 0))

    def _hold(self, call: dict[str, Any]) -> None:
        """A tool call's piece, held until the finish (see the module docstring)."""
        index = self._last_call = tool_call_index(call, self._last_call)
        held = self._calls.get(index)
        if held is None:
            held = self._calls[index] = _HeldCall()
            self._pending = ""  # the whitespace before a call starts no message
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        call_id, name, piece = call.get("id"), function.get("name"), function.get("arguments")
        if isinstance(call_id, str) and call_id:
            held.call_id = call_id
        if isinstance(name, str):
            held.name += name
        if isinstance(piece, str) and piece:
            held.pieces.append(piece)

    def _flush_calls(self) -> None:
        """The held calls, each sent whole, in the engine's index order; the last is left open,
        for the finish to close (`incomplete` when the answer was cut)."""
        for index in sorted(self._calls):
            held = self._calls[index]
            tool = self._tools.get(held.name)
            custom = tool is not None and tool.kind == "custom"
            item = _Item(
                "custom_tool_call" if custom else "function_call",
                _new_id("ctc" if custom else "fc"),
                call_id=held.call_id or _new_id("call"),
                name=tool.name if tool else held.name,
                namespace=tool.namespace if tool else None,
            )
            self._add(item)
            if custom:
                item.raw = "".join(held.pieces)  # its `input` is read from the whole (`_close`)
            for piece in held.pieces if not custom else ():
                item.text += piece
                self._emit("response.function_call_arguments.delta", **self._where(), delta=piece)
        self._calls.clear()

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": self._open.index}

    def _add(self, item: _Item) -> _Item:
        self._close()
        item.index = len(self._items)
        self._items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=item.index, item=item.body(False))
        return item

    def _close(self, status: str = "completed") -> None:
        item = self._open
        if item is None:
            return
        item.status = status
        where = self._where()
        if item.kind == "message":
            text = item.text
            self._message_logprobs()  # those of the tokens after its last text
            self._emit(
                "response.output_text.done",
                **where,
                content_index=0,
                text=text,
                logprobs=item.logprobs,
            )
            part = _output_text(text, item.logprobs)
            self._emit("response.content_part.done", **where, content_index=0, part=part)
        elif item.kind == "reasoning":
            self._emit("response.reasoning_text.done", **where, content_index=0, text=item.text)
            part = {"type": "reasoning_text", "text": item.text}
            self._emit("response.content_part.done", **where, content_index=0, part=part)
        elif item.kind == "function_call":
            self._emit("response.function_call_arguments.done", **where, arguments=item.text)
        else:
            item.text = self._custom_input(item)
            if item.text:
                self._emit("response.custom_tool_call_input.delta", **where, delta=item.text)
            self._emit("response.custom_tool_call_input.done", **where, input=item.text)
        self._emit("response.output_item.done", output_index=item.index, item=item.body())
        self._open = None

    def _custom_input(self, item: _Item) -> str:
        try:
            # By the gateway's rule, as Messages reads arguments: `json.loads` would decode an
            # escaped lone surrogate, NaN or 1e400, which no answer can carry.
            parsed = jsonrule.parse(item.raw, loc=("arguments",))
        except jsonrule.JsonRuleError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("input"), str):
            return str(parsed["input"])
        if item.raw:
            self.notes.append(f'custom tool call `{item.name}`: arguments not {{"input": ...}}')
        return item.raw

    def _finish(self) -> None:
        incomplete = self._finish_reason in ("length", "abort")
        if self._finish_reason == "abort":
            self.notes.append("the engine aborted the generation; answered as incomplete")
        self._flush_calls()
        self._close("incomplete" if incomplete else "completed")
        status = "incomplete" if incomplete else "completed"
        self._final = self._response(status)
        self._emit(f"response.{status}", response=self._final)

    def _fail(self, error: Any) -> None:
        message = error.get("message") if isinstance(error, dict) else error
        if self._open is not None:
            self._open.status, self._open = "incomplete", None
        self._final = self._response("failed")
        self._final["error"] = {"code": "server_error", "message": str(message or "engine error")}
        self._emit("response.failed", response=self._final)

    def _response(self, status: str) -> dict[str, Any]:
        done = status != "in_progress"
        reason = "max_output_tokens" if self._finish_reason == "length" else None
        return {
            "id": self._id,
            "object": "response",
            "created_at": self._created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": reason} if status == "incomplete" else None,
            **self._echo,
            "output": [item.body() for item in self._items] if done else [],
            "usage": _usage(self._usage, self._counted) if done else None,
            **({"completed_at": int(time.time())} if status == "completed" else {}),
        }
