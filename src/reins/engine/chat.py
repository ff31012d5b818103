"""Chat messages in, prompt text out; sampled tokens in, the response and what it shows out. No I/O.

Tools: a chat template that knows tools (it mentions `tools`) gets them as they are. A template that
silently ignores them, like the default model's ChatML template, gets them described in the system
prompt in the widespread Hermes convention: the JSON schemas inside `<tools></tools>`, and calls
written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Earlier assistant tool calls
are written back in that form and tool results become `<tool_response>` user turns, so the model
sees its own convention in the history. Either way, `<tool_call>` blocks in the generated text are
parsed back into OpenAI `tool_calls`.

Fidelity (docs/proxy.md): the tokens an answer returns as its response (what the proxy records and
the trainer trains on) are exactly the tokens whose text the harness is shown, so that the
harness's next prompt, rendered from what it was shown, starts with the recorded prompt + response:

- `settle` decides how many of the sampled tokens are the response. A stop string ends it at the
  last token that ends before the stop starts (the text is cut at that token boundary, so when a
  stop string starts inside a token, the characters of that token before it are not shown); a
  special token other than end-of-turn (`<|im_start|>` sampled mid-answer) ends it before that
  token; when tools are offered, text after a `</tool_call>` that does not open another call ends
  it after that `</tool_call>` (the Hermes convention: the calls end the turn); with
  `parallel_tool_calls: false` the first `</tool_call>` ends it, as OpenAI and vLLM answer such a
  request with one call at most. The end-of-turn token itself stays: the template writes it back
  after the content.
- A tool-call answer's content is the text outside the calls, without the whitespace that
  separates it from them, streamed or not. `SampledTurns` remembers each tool-call answer's text by
  its call IDs: when the harness sends that assistant message back unchanged (its calls may be
  re-serialized JSON), `prepare_messages` renders the text as it was sampled, whatever its
  formatting, so the turn merges.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The chat roles OpenAI takes; its legacy `function` (a function's result) is read as `tool`."""
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
SAMPLED_TURNS = 65_536
"""Tool calls (by ID) `SampledTurns` remembers (least recently used first out). A harness re-sends
its whole history at every call, so every tool-call turn of every running rollout must stay."""

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


def text_of(content: Any, where: str = "message content") -> str:
    """Message content as text: a string, None, or a list of `{"type": "text", ...}` parts.
    `where` names the content in an error, which names a part by its position and type, never
    by its value (an image's data URL is megabytes)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            at = f"{where}[{index}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "input_text", "output_text"):
                text = part.get("text")
                if not isinstance(text, str):  # `str()` made a null "None" in the prompt
                    raise ChatRequestError(f"{at} has no text: its `text` must be a string")
                texts.append(text)
            else:
                what = f"a part of type {_brief(kind)}" if kind is not None else _brief(part)
                raise ChatRequestError(
                    f"{at} is {what}, not text: this engine serves text models; send text"
                )
        return "".join(texts)
    raise ChatRequestError(f"{where} must be a string or a list of parts, not {_brief(content)}")


def _brief(value: Any, most: int = 60) -> str:
    """`value` shown in an error, cut to `most` characters."""
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."


def prepare_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    native_tools: bool,
    sampled: SampledTurns | None = None,
) -> list[dict[str, Any]]:
    """Messages a chat template can render (see the module docstring). An assistant message that
    `sampled` recognises as one of its answers, unchanged, becomes its text as sampled."""
    if not messages:
        raise ChatRequestError("`messages` is empty")
    out: list[dict[str, Any]] = []
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ChatRequestError(f"messages[{position}] has no `role`")
        role = str(message["role"])
        if role not in ROLES:
            raise ChatRequestError(
                f"messages[{position}].role is {role!r}; it must be one of {', '.join(ROLES)}"
            )
        if role == "developer":
            role = "system"
        elif role == "function":
            role = "tool"
        content = text_of(message.get("content"), f"messages[{position}].content")
        _check_tool_calls(message.get("tool_calls"), position)
        as_sampled = sampled.recall(message) if sampled is not None else None
        if as_sampled is not None:
            out.append({"role": role, "content": as_sampled})
        elif native_tools:
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


def _check_tool_calls(calls: Any, position: int) -> None:
    """A message's `tool_calls`, when present, is a list of objects whose `function` is an
    object: anything else is the caller's error, said as such, not a failure to render."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ChatRequestError(f"messages[{position}].tool_calls must be a list")
    for index, call in enumerate(calls):
        where = f"messages[{position}].tool_calls[{index}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ChatRequestError(f"{where}.function must be an object")
        if not isinstance(call["function"].get("name", ""), str):
            raise ChatRequestError(f"{where}.function.name must be a string")


def _tool_call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        parsed = arguments
    body = json.dumps({"name": function.get("name", ""), "arguments": parsed})
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a generated text; blocks that are not valid calls stay text.

    With calls, the content is the text outside them, without the whitespace between it and a
    call (None when nothing else is left); without, it is the text unchanged."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in TOOL_CALL.finditer(text):
        call = _parse_call(match.group(1))
        if call is None:
            continue
        before = text[position : match.start()]
        kept.append(before.strip() if calls else before.rstrip())
        position = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[position:].lstrip())
    content = "".join(kept)
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


# -- which sampled tokens are the response --------------------------------------------------


@dataclass(frozen=True)
class ResponseRules:
    """What ends a response before its last sampled token (see the module docstring)."""

    stops: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    """Special tokens that end the response and are not part of it (all but end-of-turn)."""
    tool_calls: bool = False
    """Tools are offered: text after a `</tool_call>` that opens no other call ends the turn."""
    parallel_tool_calls: bool = True
    """False (the request's `parallel_tool_calls: false`): the first `</tool_call>` ends it."""
    include_stops: bool = False
    """vLLM's `include_stop_str_in_output`: a stop string ends the response after it (with the
    tokens that hold it), not before it."""

    @property
    def hold(self) -> int:
        """Characters at the end of the text that may still become the start of a stop string."""
        return max((len(stop) - 1 for stop in self.stops), default=0)


@dataclass(frozen=True)
class Settled:
    """The response so far: the first `count` sampled tokens, their text, and what ended it."""

    count: int
    text: str
    stop_reason: str | int | None = None
    """The stop string, the special token ID, or `</tool_call>` that ended the response."""


def tool_turn_end(text: str, *, final: bool, parallel: bool = True) -> int | None:
    """Where a tool-call turn ended: the end of the first `</tool_call>` followed, whitespace
    aside, by text that does not open another call (None: no such text). Unless `final`, text
    that may still become `<tool_call>` does not end the turn. Not `parallel`: the end of the
    first `</tool_call>`, whatever follows (one call at most, as OpenAI and vLLM answer a
    request with `parallel_tool_calls: false`; the second call is never sampled)."""
    start = 0
    while (found := text.find(TOOL_CALL_CLOSE, start)) >= 0:
        end = found + len(TOOL_CALL_CLOSE)
        if not parallel:
            return end
        rest = text[end:].lstrip()
        opening = rest.startswith(TOOL_CALL_OPEN) or (not final and TOOL_CALL_OPEN.startswith(rest))
        if rest and not opening:
            return end
        start = end
    return None


def _undecided_tool_tail(text: str) -> int | None:
    """Where the text after the last `</tool_call>` begins, while it is only whitespace or the
    start of `<tool_call>` (it may end the turn or go on with another call); else None."""
    found = text.rfind(TOOL_CALL_CLOSE)
    if found < 0:
        return None
    end = found + len(TOOL_CALL_CLOSE)
    rest = text[end:].lstrip()
    return end if TOOL_CALL_OPEN.startswith(rest) else None


def settle(
    token_ids: Sequence[int],
    decode: Callable[[list[int]], str],
    rules: ResponseRules,
    *,
    final: bool,
) -> Settled:
    """The sampled tokens that are the response. `final`: generation ended; else the tokens that
    are the response whatever comes next (what a stream may send now)."""
    tokens = list(token_ids)
    stop_reason: str | int | None = None
    if tokens and tokens[-1] in rules.stop_token_ids:
        stop_reason = tokens.pop()
    text = decode(tokens)
    found = [(text.find(stop), stop) for stop in rules.stops if stop in text]
    before, stop = min(found) if found else (None, None)
    after = (
        tool_turn_end(text, final=final, parallel=rules.parallel_tool_calls)
        if rules.tool_calls
        else None
    )
    if after is not None and (before is None or after <= before):
        count = _covering(tokens, decode, text, after)
        return Settled(count, decode(tokens[:count]), TOOL_CALL_CLOSE)
    if before is not None:
        if rules.include_stops and stop is not None:
            count = _covering(tokens, decode, text, before + len(stop))
        else:
            count = _within(tokens, decode, text, before)
        return Settled(count, decode(tokens[:count]), stop)
    if final:
        return Settled(len(tokens), text, stop_reason)
    # A multi-byte character not complete yet decodes as U+FFFD: it is held back, and the
    # characters that may start a stop string are held back before it.
    limit = len(text.rstrip("\ufffd")) - rules.hold
    if rules.tool_calls and (undecided := _undecided_tool_tail(text)) is not None:
        limit = min(limit, undecided)
    count = _within(tokens, decode, text, limit)
    return Settled(count, decode(tokens[:count]) if count < len(tokens) else text)


def _within(tokens: list[int], decode: Callable[[list[int]], str], text: str, limit: int) -> int:
    """The most leading tokens whose text is a prefix of `text` no longer than `limit`."""
    count = len(tokens)
    if len(text) <= limit:
        return count
    while count > 0:
        count -= 1
        prefix = decode(tokens[:count])
        if len(prefix) <= limit and text.startswith(prefix):
            return count
    return 0


def _covering(tokens: list[int], decode: Callable[[list[int]], str], text: str, end: int) -> int:
    """The fewest leading tokens whose text covers `text[:end]`."""
    count = len(tokens)
    while count > 0:
        prefix = decode(tokens[: count - 1])
        if len(prefix) < end or not text.startswith(prefix):
            return count
        count -= 1
    return 0


class PrefixDecoder:
    """`decode` of the prefixes of one growing token list, remembering the last `keep` texts:
    a stream calls `settle` at every token, and `settle` walks back a few tokens from the end."""

    def __init__(self, decode: Callable[[list[int]], str], keep: int = 64) -> None:
        self._decode = decode
        self._keep = keep
        self._texts: OrderedDict[tuple[int, int], str] = OrderedDict()

    def __call__(self, tokens: list[int]) -> str:
        key = (len(tokens), tokens[-1] if tokens else -1)
        text = self._texts.get(key)
        if text is None:
            text = self._texts[key] = self._decode(tokens)
            while len(self._texts) > self._keep:
                self._texts.popitem(last=False)
        return text


def shown_content(text: str, *, tools: bool, final: bool) -> str | None:
    """A chat answer's content from its settled text. Unless `final`, the part a stream may send
    now: with tools, the text before a `<tool_call>` (or what may become one), without its
    trailing whitespace (content keeps no whitespace before a call)."""
    if final:
        return parse_tool_calls(text)[0] if tools else text
    if not tools:
        return text
    opened = text.find(TOOL_CALL_OPEN)
    if opened < 0:
        last = text.rfind("<")
        if last >= 0 and TOOL_CALL_OPEN.startswith(text[last:]):
            opened = last
    return (text if opened < 0 else text[:opened]).rstrip()


# -- tool-call answers rendered back as they were sampled ---------------------------------------


@dataclass(frozen=True)
class _Turn:
    text: str
    content: str
    call_ids: tuple[str, ...]
    calls: tuple[tuple[str, Any], ...]


class SampledTurns:
    """The text of recent tool-call answers, by their call IDs (see the module docstring)."""

    def __init__(self, capacity: int = SAMPLED_TURNS) -> None:
        self.capacity = capacity
        self._turns: OrderedDict[str, _Turn] = OrderedDict()

    def remember(self, text: str, content: str | None, calls: list[dict[str, Any]]) -> None:
        """An answer's sampled `text`, shown as `content` and `calls` (OpenAI `tool_calls`)."""
        parsed = tuple(_call_key(call) for call in calls)
        if not calls or any(key is None for key in parsed):
            return
        turn = _Turn(
            text,
            (content or "").strip(),
            tuple(str(call["id"]) for call in calls),
            tuple(key for key in parsed if key is not None),
        )
        for call_id in turn.call_ids:
            self._turns[call_id] = turn
            self._turns.move_to_end(call_id)
        while len(self._turns) > self.capacity:
            self._turns.popitem(last=False)

    def recall(self, message: dict[str, Any]) -> str | None:
        """The sampled text of `message` when it is a remembered answer, unchanged: the same
        calls (arguments compared as JSON values) and the same content (surrounding whitespace
        aside). None otherwise."""
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not calls or not isinstance(calls, list):
            return None
        first = calls[0].get("id") if isinstance(calls[0], dict) else None
        turn = self._turns.get(first) if isinstance(first, str) else None
        if turn is None:
            return None
        ids = tuple(call.get("id") if isinstance(call, dict) else None for call in calls)
        if ids != turn.call_ids or tuple(_call_key(call) for call in calls) != turn.calls:
            return None
        try:
            content = text_of(message.get("content")).strip()
        except ChatRequestError:
            return None
        if content != turn.content:
            return None
        for call_id in turn.call_ids:
            self._turns.move_to_end(call_id)
        return turn.text


def _call_key(call: Any) -> tuple[str, Any] | None:
    """(name, arguments as a JSON value) of an OpenAI tool call; None when it is not one."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    return function["name"], json.dumps(arguments, sort_keys=True)


# -- token reuse: a prompt that continues a prefix of token IDs as they were consumed ------------


def extend_prompt(
    prefix_ids: Sequence[int],
    text: str,
    decode: Callable[[list[int]], str],
    encode: Callable[[str], list[int]],
) -> list[int] | None:
    """`prefix_ids` + the tokens of what the rendered prompt `text` adds after their text, or
    None when `text` does not start with their text (`decode` keeps special tokens).

    The proxy sends as `prefix_ids` an earlier call's prompt and sampled response (docs/proxy.md,
    token reuse): the new prompt then holds those tokens exactly as they were consumed and
    sampled, so the calls merge into one training sequence, and its text is still the template's
    rendering of the messages. The harness having changed its history (an edited or dropped turn,
    a template that strips reasoning) shows as a text that does not start so: None, and the
    prompt is rendered as usual."""
    prefix = list(prefix_ids)
    if not prefix:
        return None
    head = decode(prefix)
    if not head or not text.startswith(head):
        return None
    rest = text[len(head) :]
    return prefix + (encode(rest) if rest else [])
