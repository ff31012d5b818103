"""A prompt too long for the engine's context, read from the engine's refusal, and said in each
wire API's own words.

Harnesses react to a context overflow, but only when it is said their API's way: Claude Code
compacts its conversation on Anthropic's `prompt is too long: N tokens > M maximum` (it reads the
two numbers) and retries with a smaller `max_tokens` on `input length and `max_tokens` exceed
context limit: N + X > M`; Codex and OpenAI-client libraries read the error code
`context_length_exceeded`. Passed on in the engine's words (vLLM's `BadRequestError`, code 400)
the same refusal is a plain failure to them, and a long agent run on a small-context model ends
where it could have gone on.

Read here: the embedded engine's refusal (`code: context_length_exceeded`, `This model's maximum
context length is M tokens; the prompt has N.`) and vLLM's (`... However, your request has N input
tokens`, `... you requested T tokens (N in the messages, X in the completion)`, `'max_tokens' or
'max_completion_tokens' is too large: X. ... your request has N input tokens`, `The decoder prompt
(length N) is longer than the maximum model length of M`), or any 400 with that code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

CODE = "context_length_exceeded"


@dataclass(frozen=True)
class Overflow:
    message: str
    """The engine's own words."""
    limit: int | None
    """The engine's context, in tokens (None when its message does not say)."""
    prompt_tokens: int | None
    max_tokens: int | None = None
    """Set when the prompt fits but not with the `max_tokens` asked for."""


_LIMIT = re.compile(r"maximum (?:context|model) length (?:is|of) (\d+)", re.IGNORECASE)
_PROMPT = re.compile(
    r"(?:the prompt has (\d+)|your request has (\d+) input tokens|\((\d+) in the messages"
    r"|prompt \(length (\d+)\))",
    re.IGNORECASE,
)
_MAX_TOKENS = re.compile(
    r"(?:'max_tokens' or 'max_completion_tokens' is too large: (\d+)|(\d+) in the completion\))",
    re.IGNORECASE,
)
_SAYS_OVERFLOW = re.compile(
    r"maximum context length is \d+|is longer than the maximum model length", re.IGNORECASE
)


def read_overflow(status: int, text: str) -> Overflow | None:
    """The overflow an engine's error answer (`status`, body `text`) says, or None if it says
    something else."""
    if status != 400:
        return None
    message, code = _message_and_code(text)
    if code != CODE and not _SAYS_OVERFLOW.search(message):
        return None
    limit = _first_int(_LIMIT.search(message))
    prompt = _first_int(_PROMPT.search(message))
    asked = _first_int(_MAX_TOKENS.search(message))
    if asked is not None and prompt is not None and limit is not None and prompt >= limit:
        asked = None  # the prompt alone is too long: what was asked for does not matter
    return Overflow(message, limit, prompt, asked)


def openai_body(overflow: Overflow, param: str) -> dict[str, Any]:
    """OpenAI's own error (chat and text completions, Responses): its code, the engine's words."""
    return {
        "error": {
            "message": overflow.message,
            "type": "invalid_request_error",
            "param": param,
            "code": CODE,
        }
    }


def anthropic_message(overflow: Overflow) -> str:
    """Anthropic's words for it, with the numbers Claude Code reads from them where the engine
    gave them; the engine's own words follow."""
    limit, prompt, asked = overflow.limit, overflow.prompt_tokens, overflow.max_tokens
    if asked is not None and prompt is not None and limit is not None:
        head = (
            f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > {limit}, "
            "decrease input length or `max_tokens` and try again"
        )
    elif prompt is not None and limit is not None:
        head = f"prompt is too long: {prompt} tokens > {limit} maximum"
    else:
        head = "prompt is too long"
    return f"{head} (the engine: {overflow.message})"


def _message_and_code(text: str) -> tuple[str, object]:
    try:
        body = json.loads(text)
    except ValueError:
        return text, None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"], error.get("code")
    if isinstance(body, dict):
        for key in ("message", "detail"):
            if isinstance(body.get(key), str):
                return body[key], body.get("code")
    return text, None


def _first_int(match: re.Match[str] | None) -> int | None:
    if match is None:
        return None
    return next((int(group) for group in match.groups() if group is not None), None)
