"""The Anthropic Messages API (`POST .../anthropic/v1/messages`) on the engine's chat completions.

Claude Code and OpenCode's Anthropic provider speak it. Pure: a request body in, the engine's chat
request out; the engine's answer or stream chunks in, the Messages answer or SSE events out.

Request, block by block:
- `system` (a string or text blocks) becomes the first system message; a `role: "system"` message
  inside `messages` (Claude Code sends one) stays a system message at its place. Text blocks are
  joined with a newline, as vLLM joins a chat message's text parts, so every engine sees the same
  prompt; `cache_control` anywhere is ignored.
- Consecutive messages of one role are one turn, as Anthropic combines them: one chat message
  (their text joined with a newline, an assistant turn's calls together), noted; a `role:
  "system"` message between them keeps them apart.
- `tool_use` blocks become the assistant message's `tool_calls` (`arguments` = the `input` as
  JSON) with the same id; `tool_result` blocks become `tool` messages, placed before the text of
  the same user turn (the order a chat template needs). A result whose `is_error` is true gets
  its content prefixed with `Error: `, the only way a chat message can say so. A result must
  answer the id of an earlier `tool_use`.
- `thinking` blocks in the history become the assistant message's `reasoning_content`: it is the
  model's own reasoning, which templates that render reasoning (Qwen3-style) put back, and others
  ignore. `redacted_thinking` (opaque to any other model) is dropped with a note.
- Images and documents are refused (400): the engine serves text models. Any other unknown block
  is refused, naming its type and position.
- Server tools (`web_search_...`, `bash_...`, `code_execution_...`: any tool with a `type` other
  than `custom`) are dropped with a note: the engine cannot run them.
- `thinking` (enabled/adaptive/disabled) is passed as `chat_template_kwargs.enable_thinking`, the
  switch of templates that have one; a template without it (the default model's) ignores it
  (noted). A last message from the assistant is a prefill: the engine is asked to continue its
  text (`continue_final_message`, `add_generation_prompt: false`, as vLLM and the embedded
  engine take them), and the answer is only the continuation, as Anthropic's; one that ends
  with whitespace is refused (as Anthropic refuses it), and one without text (a `tool_use`
  awaiting its result, a thinking block alone) too. An empty last assistant message (Anthropic
  accepts one) is dropped, noted. `output_config.format` (structured output, a JSON schema) is
  the chat `response_format`, which the engine enforces. Fields this engine cannot honour
  (`output_config.effort`, `context_management`, `mcp_servers`, unknown ones) are noted;
  `metadata` (an object, else refused), `service_tier`, `container` are ignored.
- What Anthropic's API refuses with a 400 is refused here too, so a harness meets the same
  errors in training as when deployed: `temperature` or `top_p` outside 0-1, a negative `top_k`,
  a stop sequence without non-whitespace, a thinking `budget_tokens` below 1,024 or not below
  `max_tokens`, enabled thinking with a forced tool choice, a temperature other than 1, a
  `top_k` or a `top_p` below 0.95, a message with empty content (the optional final assistant
  one aside), an empty text block.

Answer: an answer the engine ended for its length with fewer tokens than the limit it got
(`sent_to_engine`: the harness's `max_tokens` or a mode's lower one) met the context's end:
`stop_reason: model_context_window_exceeded`, as Anthropic's newer models say; else `max_tokens`
(also when the engine names a stop it cut the answer at: the embedded engine drops a tool call
that `max_tokens` cut short after whole ones, so the answer has fewer tokens than it sampled).
The engine's call ids are kept as the `tool_use` ids (the harness sends them back and the
next request maps them to the same `tool_call_id`); an engine call without an id gets `toolu_...`.
Tool arguments that are not a JSON object are shown as text, with a note. The engine's reasoning
becomes a `thinking` block (empty signature) only when the request enabled thinking. Streamed tool
calls are held until the call is complete (a delta without an `index` belongs to the call the
last delta added to, as every reader of a stream counts it), then parsed by the gateway's JSON
rule (`jsonrule`: arguments with `NaN` or `Infinity` are not a JSON object, and become text) and
sent as `tool_use` with that `input` written again as one `input_json_delta`: the SDK's
accumulator then reads exactly the recorded `input` (the engine's own pieces may start with
whitespace, which it cannot parse, or hold numbers it reads otherwise). A plain answer is built
by the same code, as a stream of one chunk. An engine error chunk becomes an `error` event that
ends the stream (an engine error answered whole, the error body). Notes found while answering
are appended to `notes`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, TypeGuard

from reins.gateway import jsonrule
from reins.gateway.wire import WireError, sse, tool_call_index
from reins.gateway.wire.overflow import Overflow, anthropic_message

KIND = "messages"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_ANTHROPIC_TYPES = frozenset(_ERROR_TYPES.values())
"""The error types Anthropic's API answers with (its SDK's `ErrorObject`, and 413's)."""
_MEDIA = frozenset({"image", "document"})
# The fields read, or ignored without a note.
# fmt: off
_QUIET = frozenset({
    "model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k",
    "stop_sequences", "stream", "tools", "tool_choice", "metadata", "service_tier", "container",
    "cache_control", "thinking", "output_config", "context_management", "mcp_servers",
})
# fmt: on
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def error_body(
    status: int,
    message: str,
    kind: str | None = None,
    *,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """An error in Anthropic's shape, typed by status unless `kind` is one of Anthropic's error
    types (an engine's or a caller's other types, `BadRequestError`, are not: the SDK's error
    types do not know them), so a 404 says `not_found_error` as the API does. The shape has no
    `param` or `code`: the message names the field (`_fail`)."""
    if kind not in _ANTHROPIC_TYPES:
        kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def overflow_body(overflow: Overflow) -> dict[str, Any]:
    """Anthropic's answer to a prompt too long for the model, in the words Claude Code compacts
    its conversation on (or lowers `max_tokens` on, when only the answer's room ran out)."""
    return error_body(400, anthropic_message(overflow))


_UNKNOWN_RELEASE = "1970-01-01T00:00:00Z"
"""A model's `created_at` (its release date, which the gateway does not know): the epoch, as the
API's own answer does for an unknown date."""


def model_info(name: str) -> dict[str, Any]:
    """One served model in the shape of Anthropic's `GET /v1/models/{id}`."""
    return {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": _UNKNOWN_RELEASE,
        "lifecycle": "active",
    }


def model_list(
    names: list[str], *, after_id: str | None, before_id: str | None, limit: int
) -> dict[str, Any]:
    """A page of Anthropic's `GET /v1/models`: the models after `after_id` (or the last `limit`
    before `before_id`), as the SDK's paging follows `has_more` and `last_id`. A cursor that
    names no served model is a `WireError` (a 400 naming it)."""
    for param, cursor in (("after_id", after_id), ("before_id", before_id)):
        if cursor is not None and cursor not in names:
            raise _fail(f"no served model has the id {cursor!r}", param)
    low = names.index(after_id) + 1 if after_id is not None else 0
    high = names.index(before_id) if before_id is not None else len(names)
    if before_id is None:  # the first `limit` of the window
        start, end = low, min(high, low + limit)
        has_more = end < high
    else:  # the last `limit` of the window, the page just before `before_id`
        start, end = max(low, high - limit), high
        has_more = start > low
    page = names[start:end]
    return {
        "data": [model_info(name) for name in page],
        "has_more": has_more,
        "first_id": page[0] if page else None,
        "last_id": page[-1] if page else None,
    }


def _fail(message: str, param: str) -> WireError:
    return WireError(f"{param}: {message}", param=param)


def translate(body: dict[str, Any]) -> Translation:
    """A Messages request as the engine's chat request; WireError (400) for one it cannot serve."""
    if not isinstance(body, dict):
        raise WireError("the request body must be a JSON object")
    notes: list[str] = []
    model = _model(body)
    max_tokens = body.get("max_tokens")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise _fail("required: a positive integer (the most tokens to generate)", "max_tokens")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _fail("must be an object (its `user_id`), or null", "metadata")
    chat = _prompt(body, notes)
    _continue_prefill(chat)
    chat["max_tokens"] = max_tokens
    budget = _thinking_budget(body.get("thinking"))
    if budget is not None and max_tokens <= budget:
        raise _fail(
            f"must be greater than thinking.budget_tokens ({budget}), which it includes",
            "max_tokens",
        )
    for field in ("temperature", "top_p"):
        value = body.get(field)
        if value is not None:
            if not _is_number(value) or not 0 <= value <= 1:
                raise _fail("must be a number from 0 to 1", field)
            chat[field] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or top_k < 0:
            raise _fail("must be an integer of 0 or more", "top_k")
        chat["top_k"] = top_k
    if budget is not None:
        _check_enabled_thinking(body)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _fail("must be a list of strings", "stop_sequences")
        if not all(s.strip() for s in stops):
            raise _fail("each stop sequence must contain non-whitespace", "stop_sequences")
        if stops:
            chat["stop"] = stops
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _fail("must be true or false", "stream")
    chat["stream"] = bool(stream)
    if stream:
        chat["stream_options"] = {"include_usage": True}
    form = _output_format(body.get("output_config"))
    if form is not None:
        chat["response_format"] = form
    _note_ignored(body, notes)
    thinking = chat.get("chat_template_kwargs", {}).get("enable_thinking")
    return Translation(
        chat, notes, model=model, stream=bool(stream), thinking=bool(thinking), stops=stops or []
    )


def count_tokens_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request whose prompt length answers `POST /v1/messages/count_tokens`: the same
    prompt fields as `translate` sends (messages, tools, the tool choice, the thinking switch:
    each can change the rendered prompt, as `tool_choice: none` leaves the tools out of it on
    the embedded engine), without the sampling ones. No `max_tokens` is needed there."""
    if not isinstance(body, dict):
        raise WireError("the request body must be a JSON object")
    _model(body)  # required here too, as Anthropic's API and the call itself require it
    chat = _prompt(body, [])
    chat.pop("parallel_tool_calls", None)  # a sampling constraint: the prompt is the same
    _continue_prefill(chat)  # a prefill's prompt ends inside it, for the count as for the call
    return chat


def _continue_prefill(chat: dict[str, Any]) -> None:
    """A prefill (the last message is the assistant's): the prompt ends inside that message and
    the answer continues its text (vLLM's and the embedded engine's `continue_final_message`),
    as Anthropic answers it; without it the template would close that turn and open a new one."""
    if chat["messages"][-1].get("role") == "assistant":
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str):
        raise _fail("required: the model's name, a string", "model")
    return model


def _prompt(body: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The fields of the chat request that make its prompt: the conversation, the tools and
    tool choice, the thinking switch."""
    raw = body.get("messages")
    last = len(raw) - 1 if isinstance(raw, list) else -1
    empty_last = isinstance(raw, list) and last > 0 and _empty_assistant(raw[last])
    chat: dict[str, Any] = {"messages": _conversation(body, notes, drop_last=empty_last)}
    if empty_last:
        # An empty last assistant message (Anthropic accepts one) adds nothing to the prompt:
        # the assistant message before it, if any, is the prefill; else a new turn starts.
        notes.append(f"messages[{last}]: an empty last assistant message dropped")
    final = chat["messages"][-1]
    if final.get("role") == "assistant":
        _check_prefill(final, f"messages[{last - empty_last}]")
    _tools_and_choice(body, chat, notes)
    thinking = _thinking(body.get("thinking"), notes)
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    return chat


def _empty_assistant(message: Any) -> bool:
    """An assistant message with nothing in it: no content, or only empty text blocks."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return False
    content = message.get("content")
    if content == "":
        return True
    return isinstance(content, list) and all(
        isinstance(block, dict) and block.get("type") == "text" and block.get("text") == ""
        for block in content
    )


def _check_prefill(message: dict[str, Any], where: str) -> None:
    """A last assistant message is continued from its text: refused, as Anthropic refuses it,
    when the text ends with whitespace; and when there is no text to continue (a tool_use waits
    for its result, a thinking block alone has no text)."""
    if message.get("tool_calls"):
        raise _fail(
            "the last message is the assistant's and holds a tool_use: answer it with a "
            "tool_result in a user message; only text can be continued (a prefill)",
            where,
        )
    text = message.get("content")
    if not text:
        raise _fail(
            "the last message is the assistant's and has no text to continue (a prefill); "
            "end with a user message, or give the assistant's text to continue",
            where,
        )
    if text != text.rstrip():
        raise _fail("final assistant content cannot end with trailing whitespace", where)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _thinking(value: Any, notes: list[str]) -> bool | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise _fail('must be {"type": "enabled" | "adaptive" | "disabled", ...}', "thinking")
    enabled: bool = kind != "disabled"
    notes.append(
        f"thinking {kind}: sent as chat_template_kwargs.enable_thinking={str(enabled).lower()}; "
        "a model whose chat template has no such switch (the default model) ignores it"
        + ("; budget_tokens is not enforced" if "budget_tokens" in value else "")
    )
    return enabled


def _thinking_budget(value: Any) -> int | None:
    """An enabled thinking's `budget_tokens`, checked as Anthropic checks it (at least 1,024,
    and below `max_tokens`, which counts the thinking): the engine does not enforce it, but a
    request the API refuses is refused here too, so the harness meets the same errors."""
    if not isinstance(value, dict) or value.get("type") != "enabled":
        return None
    budget = value.get("budget_tokens")
    if not _is_int(budget) or budget < 1024:
        raise _fail("required: an integer of 1024 or more", "thinking.budget_tokens")
    return budget


def _check_enabled_thinking(body: dict[str, Any]) -> None:
    """What Anthropic's API refuses beside enabled thinking: a forced tool choice, a changed
    temperature or top_k, a top_p below 0.95."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        raise _fail("Thinking may not be enabled when tool_choice forces tool use.", "tool_choice")
    temperature = body.get("temperature")
    if temperature is not None and temperature != 1:
        raise _fail("may only be set to 1 when thinking is enabled", "temperature")
    if body.get("top_k") is not None:
        raise _fail("may not be set when thinking is enabled", "top_k")
    top_p = body.get("top_p")
    if top_p is not None and top_p < 0.95:
        raise _fail("must be from 0.95 to 1 when thinking is enabled", "top_p")


def _output_format(config: Any) -> dict[str, Any] | None:
    """The chat `response_format` of `output_config.format` (structured output): the engine
    constrains the answer to the schema, as Anthropic does."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise _fail("must be an object", "output_config")
    form = config.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        raise _fail('must be {"type": "json_schema", "schema": {...}}', "output_config.format")
    schema = form.get("schema")
    if not isinstance(schema, dict):
        raise _fail("required: the JSON schema, an object", "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _note_ignored(body: dict[str, Any], notes: list[str]) -> None:
    output_config = body.get("output_config")
    if isinstance(output_config, dict):
        ignored = sorted(str(key) for key in output_config if key != "format")
        if ignored:
            notes.append(f"output_config ignored ({', '.join(ignored)})")
    if body.get("context_management"):
        notes.append("context_management ignored: the history is sent to the model as it is")
    if body.get("mcp_servers"):
        notes.append("mcp_servers dropped: the engine cannot call MCP servers")
    unknown = sorted(str(key) for key in body if key not in _QUIET)
    if unknown:
        notes.append(f"unknown fields ignored: {', '.join(unknown)}")


# ---- the conversation ---------------------------------------------------------------------


def _conversation(
    body: dict[str, Any], notes: list[str], *, drop_last: bool = False
) -> list[dict[str, Any]]:
    """`system` and `messages` as chat messages, checked (`drop_last`: without the last
    message, an empty assistant one)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise _fail("required: a list of messages", "messages")
    if not raw:
        raise _fail("at least one message is required", "messages")
    final = len(raw) - 1  # the optional final assistant message's index, as Anthropic checks
    if drop_last:
        raw = raw[:-1]
    turns: list[tuple[str, list[tuple[str, Any]]]] = []
    """Each turn's role and its messages' (position, content): a user or assistant turn's
    content is its blocks."""
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _fail("must be an object with `role` and `content`", where)
        role = message.get("role")
        content = message.get("content")
        if role == "system":
            turns.append(("system", [(f"{where}.content", content)]))
            continue
        if role not in ("user", "assistant"):
            raise _fail(f"role must be user, assistant or system, not {role!r}", f"{where}.role")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _fail("must be a string or a list of content blocks", f"{where}.content")
        if not content and not (role == "assistant" and i == final):
            raise _fail(
                "all messages must have non-empty content except for the optional final "
                "assistant message",
                where,
            )
        if i < final or role == "user":
            _no_empty_text(blocks, f"{where}.content")
        if turns and turns[-1][0] == role:
            # Anthropic combines consecutive messages of one role into one turn: so does the
            # chat request (a template that needs alternating roles would refuse them apart).
            turns[-1][1].append((f"{where}.content", blocks))
            notes.append(f"{where} joined to the {role} turn before it, as Anthropic joins them")
        else:
            turns.append((role, [(f"{where}.content", blocks)]))
    answered: set[str] = set()
    for role, parts in turns:
        if role == "system":
            ((where, content),) = parts
            out.append({"role": "system", "content": _text(content, where)})
        elif role == "user":
            out.extend(_user(parts, answered))
        else:
            out.append(_assistant(parts, answered, notes))
    return out


def _blocks(blocks: list[Any], where: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(type, position, block) of each block of the list at `where`; media refused."""
    out = []
    for j, block in enumerate(blocks):
        position = f"{where}[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _fail("a content block must be an object with a string `type`", position)
        if block["type"] in _MEDIA:
            raise _fail(
                f"`{block['type']}` blocks cannot be served: this engine serves text models",
                position,
            )
        out.append((block["type"], position, block))
    return out


def _unknown(kind: str, position: str, role: str) -> WireError:
    return _fail(
        f"unknown or unsupported content block type {kind!r} in a {role} message", position
    )


def _no_empty_text(blocks: list[Any], where: str) -> None:
    """Anthropic refuses an empty text block in a message (the optional final assistant one
    aside, which `_prompt` drops when empty)."""
    for j, block in enumerate(blocks):
        if isinstance(block, dict) and block.get("type") == "text" and block.get("text") == "":
            raise _fail("text content blocks must be non-empty", f"{where}[{j}].text")


def _block_text(block: dict[str, Any], position: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _fail("a text block needs a string `text`", f"{position}.text")
    return text


def _text(value: Any, where: str) -> str:
    """A string, or text blocks joined with newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _fail("must be a string or a list of text blocks", where)
    texts = []
    for kind, position, block in _blocks(value, where):
        if kind != "text":
            raise _fail(f"only text blocks are accepted here, not {kind!r}", position)
        texts.append(_block_text(block, position))
    return "\n".join(texts)


def _turn_blocks(parts: list[tuple[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    """(type, position, block) of each block of a turn's messages, in order."""
    return [item for where, blocks in parts for item in _blocks(blocks, where)]


def _user(parts: list[tuple[str, Any]], answered: set[str]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for kind, position, block in _turn_blocks(parts):
        if kind == "text":
            texts.append(_block_text(block, position))
        elif kind == "tool_result":
            results.append(_tool_result(block, position, answered))
        else:
            raise _unknown(kind, position, "user")
    if texts or not results:
        results.append({"role": "user", "content": "\n".join(texts)})
    return results


def _tool_result(block: dict[str, Any], position: str, answered: set[str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in answered:
        raise _fail(
            f"tool_use_id {call_id!r} answers no earlier assistant tool_use; send the assistant "
            "message holding that tool_use before its tool_result",
            f"{position}.tool_use_id",
        )
    content = block.get("content")
    text = "" if content is None else _text(content, f"{position}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise _fail("must be true or false", f"{position}.is_error")
    if is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant(
    parts: list[tuple[str, Any]], answered: set[str], notes: list[str]
) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for kind, position, block in _turn_blocks(parts):
        if kind == "text":
            texts.append(_block_text(block, position))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id:
                raise _fail("a tool_use needs a string `id`", f"{position}.id")
            if not isinstance(name, str) or not name:
                raise _fail("a tool_use needs a string `name`", f"{position}.name")
            if not isinstance(arguments, dict):
                raise _fail("a tool_use's `input` must be an object", f"{position}.input")
            answered.add(call_id)
            function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind == "thinking":
            thought = block.get("thinking")
            if not isinstance(thought, str):
                raise _fail("a thinking block needs a string `thinking`", f"{position}.thinking")
            reasoning.append(thought)
        elif kind == "redacted_thinking":
            notes.append(f"{position}: redacted_thinking dropped (opaque to this model)")
        else:
            raise _unknown(kind, position, "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def _tools_and_choice(body: dict[str, Any], chat: dict[str, Any], notes: list[str]) -> None:
    raw = body.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise _fail("must be a list of tools", "tools")
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _fail("a tool must be an object", where)
        kind, name = tool.get("type"), tool.get("name")
        if kind not in (None, "custom"):
            notes.append(f"{where} ({kind} {name!r}) dropped: a server tool the engine cannot run")
            continue
        schema, description = tool.get("input_schema"), tool.get("description")
        if not isinstance(name, str) or not name:
            raise _fail("a tool needs a string `name`", f"{where}.name")
        if not isinstance(schema, dict):
            raise _fail("a tool needs an `input_schema` object", f"{where}.input_schema")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(description, str) and description:
            function["description"] = description
        # Strict tool use (the input must follow the schema): kept as the chat function's
        # `strict`, the constraint an engine that enforces it (vLLM) reads, not dropped.
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        tools.append({"type": "function", "function": function})
    choice = _tool_choice(body.get("tool_choice"), tools)
    if tools:  # without tools, the engine is asked for no tool choice
        chat["tools"] = tools
        chat.update(choice)


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat fields for a Messages `tool_choice` (any -> required)."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _fail('must be {"type": "auto" | "any" | "tool" | "none"}', "tool_choice")
    name = choice.get("name")
    if kind == "tool" and name not in [tool["function"]["name"] for tool in tools]:
        raise _fail(f"names {name!r}, which is not among the custom tools", "tool_choice.name")
    if kind == "any" and not tools:
        raise _fail("'any' needs at least one custom tool", "tool_choice")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise _fail("must be true or false", "tool_choice.disable_parallel_tool_use")
    fields: dict[str, Any] = {
        "tool_choice": {"type": "function", "function": {"name": name}}
        if kind == "tool"
        else _TOOL_CHOICES[kind]
    }
    if parallel:
        fields["parallel_tool_calls"] = False
    return fields


# ---- the answer -----------------------------------------------------------------------------


class Translation:
    """One Messages call: its chat request, and the engine's answer or stream turned back."""

    def __init__(
        self,
        chat: dict[str, Any],
        notes: list[str],
        *,
        model: str,
        stream: bool,
        thinking: bool,
        stops: list[str],
    ) -> None:
        self.notes = notes
        """What was dropped or ignored; answer() and the stream append what they drop."""
        self.stream = stream
        """Whether the harness asked for a stream."""
        self._chat = chat
        self._model = model
        self._thinking = thinking
        self._stops = stops
        self._id = f"msg_{uuid.uuid4().hex}"
        # The stream's state.
        self._started = False
        self._done = False
        self._error: str | None = None
        self._blocks: list[dict[str, Any]] = []
        self._open: str | None = None
        self._calls: dict[int, dict[str, Any]] = {}
        self._last_call: int | None = None
        self._finish: str | None = None
        self._stop: str | None = None
        self._dropped_reasoning = False
        self._stop_string: str | None = None
        self._cut_at_stop = False
        """The engine named where it cut the answer (its `stop_reason`: a stop string, the end
        of a tool-call turn): it may have sampled more tokens than the answer keeps."""
        self._input_tokens: int | None = None
        self._output_tokens: int | None = None
        self._token_count = 0
        self._limit: int | None = chat.get("max_tokens")

    def chat_request(self) -> dict[str, Any]:
        """The engine's chat request (without `model`: the proxy sets it)."""
        return dict(self._chat)

    def sent_to_engine(self, body: dict[str, Any]) -> None:
        """Its length limit (the harness's `max_tokens`, or a mode's lower one): an answer the
        engine ended for its length before that many tokens met the context's end."""
        limits = [body.get(key) for key in ("max_tokens", "max_completion_tokens")]
        self._limit = min((n for n in limits if _is_int(n)), default=None)

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Messages answer for the engine's chat completion: built as a stream of one chunk
        holding the whole answer would be, so streamed and plain answers never differ."""
        choices = chat.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = dict(choice.get("message") or {})
        calls = message.get("tool_calls")
        if isinstance(calls, list):  # a whole message's calls: their positions are indexes
            message["tool_calls"] = [
                {**call, "index": position} if isinstance(call, dict) else call
                for position, call in enumerate(calls)
            ]
        whole = {**choice, "index": 0, "delta": message}
        twin = Translation(
            self._chat,
            self.notes,
            model=self._model,
            stream=False,
            thinking=self._thinking,
            stops=self._stops,
        )
        twin._id = self._id
        twin._limit = self._limit
        if chat.get("error") is not None:  # answered as the stream answers one: an error
            twin.stream_events({"error": chat["error"]})
        prompt = chat.get("prompt_token_ids")
        twin.stream_events(
            {"choices": [whole], "usage": chat.get("usage"), "prompt_token_ids": prompt}
        )
        twin.stream_end()
        return twin.assembled()

    def stream_events(self, chunk: dict[str, Any]) -> list[bytes]:
        """The SSE events for one engine chunk (the first also opens the message)."""
        if self._done:
            return []
        if chunk.get("error"):
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            self._error = str(message or "the engine failed")
            self._done = True
            return [sse("error", error_body(500, self._error))]
        # The engine's fields are read by their types: an odd one is not counted, not a crash.
        prompt_ids = chunk.get("prompt_token_ids")
        if self._input_tokens is None and isinstance(prompt_ids, list) and prompt_ids:
            self._input_tokens = len(prompt_ids)
        events = self._start()
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            prompt, output = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if _count(prompt):
                self._input_tokens = prompt
            if _count(output):
                self._output_tokens = output
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            token_ids = choice.get("token_ids")
            self._token_count += len(token_ids) if isinstance(token_ids, list) else 0
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                if self._thinking:
                    events += self._delta("thinking", str(reasoning))
                else:
                    self._drop_reasoning()
            if delta.get("content"):
                events += self._delta("text", str(delta["content"]))
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                self._hold(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                self._stop_string = self._stop_string_of(choice)
                self._cut_at_stop = choice.get("stop_reason") is not None
                events += self._flush_calls()
        return events

    def stream_end(self) -> list[bytes]:
        """The closing events (a complete empty message when no chunk came); none after an
        engine error, whose `error` event ended the stream."""
        if self._done:
            return []
        events = self._start() + self._flush_calls() + self._close()
        self._done = True
        self._stop = self._stop_reason()
        usage: dict[str, Any] = {"output_tokens": self._output_count()}
        if self._input_tokens is not None:
            usage["input_tokens"] = self._input_tokens
        delta = {"stop_reason": self._stop, "stop_sequence": self._stop_sequence(self._stop)}
        events.append(
            sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        )
        events.append(sse("message_stop", {"type": "message_stop"}))
        return events

    def stream_refusal(self, message: str, status: int = 409) -> list[bytes]:
        return [sse("error", error_body(status, message))]

    def assembled(self) -> dict[str, Any]:
        """The streamed answer as one Messages answer (after an engine error: the error body,
        which is what the harness got)."""
        if self._error is not None:
            return error_body(500, self._error)
        return self._message(self._blocks, self._stop, self._output_count())

    # ---- pieces ----

    def _message(
        self, blocks: list[dict[str, Any]], stop_reason: str | None, output_tokens: int
    ) -> dict[str, Any]:
        return {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": self._stop_sequence(stop_reason),
            "usage": {
                "input_tokens": self._input_tokens or 0,
                "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }

    def _stop_string_of(self, choice: dict[str, Any]) -> str | None:
        """The stop sequence that ended the answer, when the engine says (vLLM's `stop_reason`)."""
        matched = choice.get("stop_reason")
        if choice.get("finish_reason") == "stop" and matched in self._stops:
            return str(matched)
        return None

    def _stop_sequence(self, stop_reason: str | None) -> str | None:
        """The matched stop sequence, named only beside `stop_reason: stop_sequence`, as
        Anthropic's API does: an answer whose tool calls make it `tool_use` names none."""
        return self._stop_string if stop_reason == "stop_sequence" else None

    def _stop_reason(self) -> str:
        if self._finish == "length":
            # Fewer tokens than the limit: the context's end stopped it. Anthropic's newer models
            # say so, and Claude Code then reports the context's limit, not an answer longer
            # than `max_tokens` (it asks for 32k-64k, whatever the model's context). Unless the
            # engine cut the answer at a stop it names: the embedded engine keeps a turn's whole
            # tool calls and drops a next one that `max_tokens` cut short, so fewer tokens than
            # it sampled are the answer's.
            short = self._limit is not None and self._output_count() < self._limit
            return (
                "model_context_window_exceeded" if short and not self._cut_at_stop else "max_tokens"
            )
        if any(block["type"] == "tool_use" for block in self._blocks):
            return "tool_use"
        if self._stop_string is not None:
            return "stop_sequence"
        if self._finish == "abort":
            self.notes.append("the engine aborted the answer; reported as end_turn")
        return "end_turn"

    def _drop_reasoning(self) -> None:
        if not self._dropped_reasoning:
            self._dropped_reasoning = True
            self.notes.append("the model's reasoning dropped: the request did not enable thinking")

    def _output_count(self) -> int:
        return self._output_tokens if self._output_tokens is not None else self._token_count

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        opening = self._message([], None, 0)
        return [sse("message_start", {"type": "message_start", "message": opening})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        index = len(self._blocks) - 1
        return [sse("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _begin(self, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self._blocks.append(block)
        self._open = block["type"]
        start = {"type": "content_block_start", "index": len(self._blocks) - 1}
        events.append(sse("content_block_start", {**start, "content_block": dict(block)}))
        return events

    def _block_delta(self, delta: dict[str, Any]) -> bytes:
        body = {"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta}
        return sse("content_block_delta", body)

    def _delta(self, kind: str, text: str) -> list[bytes]:
        """Text or thinking, appended to the open block of that kind (or a new one)."""
        events: list[bytes] = []
        if self._open != kind:
            empty = {"type": "text", "text": ""}
            if kind == "thinking":
                empty = {"type": "thinking", "thinking": "", "signature": ""}
            events += self._begin(empty)
        self._blocks[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        events.append(self._block_delta(delta))
        return events

    def _hold(self, call: Any) -> None:
        """A tool call's piece, held until the call is complete (see the module docstring)."""
        if not isinstance(call, dict):
            return
        index = self._last_call = tool_call_index(call, self._last_call)
        held = self._calls.setdefault(index, {"id": None, "name": "", "pieces": []})
        held["id"] = call.get("id") or held["id"]
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        held["name"] += str(function.get("name") or "")
        arguments = function.get("arguments")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if arguments:
            held["pieces"].append(str(arguments))

    def _flush_calls(self) -> list[bytes]:
        events: list[bytes] = []
        for index in sorted(self._calls):
            held = self._calls[index]
            call_id = held["id"] or f"toolu_{uuid.uuid4().hex}"
            arguments = "".join(held["pieces"])
            parsed = _json_object(arguments)
            if parsed is None:
                self.notes.append(
                    f"tool call {held['name']!r} ({call_id}): its arguments are not a JSON "
                    "object; sent as text"
                )
                events += self._delta("text", arguments) + self._close()
                continue
            tool_use = {"type": "tool_use", "id": call_id, "name": held["name"], "input": {}}
            events += self._begin(tool_use)
            tool_use["input"] = parsed
            written = json.dumps(parsed, ensure_ascii=False)
            events.append(self._block_delta({"type": "input_json_delta", "partial_json": written}))
            events += self._close()
        self._calls.clear()
        return events


def _json_object(arguments: str) -> dict[str, Any] | None:
    """The arguments as an object ({} for none); None when they are not a JSON object by the
    gateway's rule: `json.loads` reads `NaN` and `1e400`, which no answer can carry (the record
    of the call is refused) and the SDK cannot read back."""
    if not arguments.strip():
        return {}
    try:
        parsed = jsonrule.parse(arguments, loc=("arguments",))
    except jsonrule.JsonRuleError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _count(value: Any) -> bool:
    """Whether an engine's usage figure is a token count (not a bool, a float, a list...)."""
    return type(value) is int and value >= 0
