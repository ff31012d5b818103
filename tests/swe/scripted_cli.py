"""A scripted stand-in for the gateway's model proxy, for the CLI harness tests: a real HTTP server
on 127.0.0.1 that answers Anthropic Messages (Claude Code) and Responses (Codex) calls, streamed,
each with the script's next shell command as the CLI's own tool call, then a closing text. No LLM:
the step is the number of tool results in the request (a retried call gets the same answer).
Every request is kept (method, path, body) for the test to read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.support import http_server

ATTEMPT = "/proxy/rollout/r-cli/attempt/1/mode/val"  # the gateway's proxy path for it
EVENTS = "/api/rollouts/r-cli/attempt/1/events"  # and its event API
DONE_TEXT = "The fix is in place."


@dataclass
class ScriptedProxy:
    url: str
    """The attempt's OpenAI base URL on this server (what the controller sets)."""
    received: list[tuple[str, str, Any]] = field(default_factory=list)

    def model_calls(self) -> list[Any]:
        return [body for method, path, body in self.received if method == "POST" and body]


def _sse(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


def _anthropic(body: dict[str, Any], script: list[str]) -> list[bytes]:
    step = sum(
        1
        for message in body["messages"]
        if isinstance(message.get("content"), list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    )
    usage = {"input_tokens": 1, "output_tokens": 1}
    start = {"id": f"msg_{step}", "type": "message", "role": "assistant", "model": body["model"],
             "content": [], "stop_reason": None, "usage": usage}  # fmt: skip
    events = [_sse({"type": "message_start", "message": start})]
    if step < len(script) and body.get("tools"):
        block = {"type": "tool_use", "id": f"toolu_{step}", "name": "Bash", "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps({"command": script[step]})}
        stop = "tool_use"
    else:
        block = {"type": "text", "text": ""}
        delta, stop = {"type": "text_delta", "text": DONE_TEXT}, "end_turn"
    events += [
        _sse({"type": "content_block_start", "index": 0, "content_block": block}),
        _sse({"type": "content_block_delta", "index": 0, "delta": delta}),
        _sse({"type": "content_block_stop", "index": 0}),
        _sse({"type": "message_delta", "delta": {"stop_reason": stop}, "usage": usage}),
        _sse({"type": "message_stop"}),
    ]
    return events


def _responses(body: dict[str, Any], script: list[str]) -> list[bytes]:
    items = body.get("input") or []
    step = sum(1 for item in items if item.get("type") == "function_call_output")
    if step < len(script):
        item: dict[str, Any] = {
            "type": "function_call", "id": f"fc_{step}", "call_id": f"call_{step}",
            "name": "exec_command", "arguments": json.dumps({"cmd": script[step]}),
            "status": "completed",
        }  # fmt: skip
    else:
        text = {"type": "output_text", "text": DONE_TEXT, "annotations": []}
        item = {"type": "message", "id": f"msg_{step}", "role": "assistant",
                "status": "completed", "content": [text]}  # fmt: skip
    usage = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2,
             "input_tokens_details": {"cached_tokens": 0},
             "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
    response = {"id": f"resp_{step}", "object": "response", "status": "completed",
                "model": body["model"], "output": [item], "usage": usage}  # fmt: skip
    return [
        _sse({"type": "response.output_item.added", "output_index": 0, "item": item}),
        _sse({"type": "response.output_item.done", "output_index": 0, "item": item}),
        _sse({"type": "response.completed", "response": response}),
    ]


@contextmanager
def scripted_proxy(script: list[str]) -> Iterator[ScriptedProxy]:
    proxy = ScriptedProxy(url="")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _refuse(self) -> None:
            proxy.received.append((self.command, self.path, None))
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = _refuse

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            proxy.received.append(("POST", self.path, body))
            path = self.path.split("?")[0]
            if path.endswith("/anthropic/v1/messages"):
                events = _anthropic(body, script)
            elif path.endswith("/openai/v1/responses"):
                events = _responses(body, script)
            else:
                self._refuse()
                return
            data = b"".join(events)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    with http_server(Handler) as port:
        proxy.url = f"http://127.0.0.1:{port}{ATTEMPT}/openai/v1"
        yield proxy
