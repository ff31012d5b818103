"""Wire APIs besides OpenAI chat completions, each translated to and from the engine's chat API.

Harnesses speak the OpenAI Responses API (Codex, the OpenAI Agents SDK's default model, OpenCode)
and the Anthropic Messages API (Claude Code, OpenCode); engines (embedded, vLLM, SGLang) speak
chat completions with token IDs. One pure module per API (`responses`, `messages`): the harness's
request in, the engine's chat request out; the engine's answer or stream chunks in, the API's
answer or events out. The proxy does the I/O and records every call the same way, with the
request and the answer as the harness saw them and `kind` naming the API.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from reins.gateway.wire.overflow import Overflow


class WireError(Exception):
    """A request this API cannot serve: answered with `status` in the API's own error shape."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.kind = kind


def tool_call_index(call: Any, last: int | None) -> int:
    """The index of the tool call a streamed tool-call delta belongs to: its `index`; without
    one, the call the last delta added to (0 for the first), as every reader of a stream counts
    it. A whole message's calls carry no index: their positions are given as indexes first."""
    index = call.get("index") if isinstance(call, dict) else None
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    return 0 if last is None else last


def sse(event: str | None, data: dict[str, Any]) -> bytes:
    """One server-sent event: `event: NAME` (when named) and its JSON `data`."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Translation(Protocol):
    """One call's translation, from the harness's request to the engine and back."""

    notes: list[str]
    """What was dropped or ignored (hosted tools, thinking...), recorded with the call."""
    stream: bool
    """Whether the harness asked for a stream."""

    def chat_request(self) -> dict[str, Any]:
        """The engine's chat-completions body, without `model` (the proxy sets it)."""
        ...

    def sent_to_engine(self, body: dict[str, Any]) -> None:
        """The chat body the engine got, the mode's sampling policy applied (a mode's
        `max_tokens` may be lower than the harness's): what its answer is read against."""
        ...

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """This API's answer from the engine's chat completion."""
        ...

    def stream_events(self, chunk: dict[str, Any]) -> list[bytes]:
        """This API's SSE events for one engine chunk (the first call opens the stream)."""
        ...

    def stream_end(self) -> list[bytes]:
        """The closing events once the engine's stream has ended."""
        ...

    def assembled(self) -> dict[str, Any]:
        """After `stream_end`: the streamed answer as one non-streamed answer would be."""
        ...

    def stream_refusal(self, message: str, status: int = 409) -> list[bytes]:
        """After `stream_end`, sent instead of its closing events: the stream ends in an error
        (the attempt closed while the call ran, so the answer was not recorded: 409; the
        gateway's database failed to store it: 503; or the answer cannot be recorded: 502)."""
        ...


class WireApi(Protocol):
    """A wire API module (`responses`, `messages`)."""

    KIND: str
    """The recorded `kind` of its calls."""

    def error_body(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> dict[str, Any]:
        """An error in this API's own shape (`param`: the request field at fault, `code`: the
        proxy's code for it, e.g. `model_not_found`, where the shape has a place for them)."""
        ...

    def overflow_body(self, overflow: Overflow) -> dict[str, Any]:
        """The error this API answers for a prompt too long for the model's context, in the
        words its clients react to (`reins.gateway.wire.overflow`)."""
        ...

    def translate(self, body: dict[str, Any]) -> Translation:
        """Raises `WireError` for a request this API cannot serve."""
        ...
