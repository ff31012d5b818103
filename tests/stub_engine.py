"""A stub inference engine: answers like vLLM with `return_token_ids`, without a model.

STUBBED: the model. Its "tokenizer" is UTF-8 bytes (token ID = byte value), its reply is fixed
(`reply` below, or the last user message reversed), each sampled token has logprob -0.25 - i/1000.
The wire format (fields and their paths, SSE framing) follows vLLM, so the proxy's single code
path is exercised. Used by proxy tests, fault tests and `benchmarks/proxy.py`; the real-engine
path is tested against vLLM (`tests/engine`).

Controls, in the request body: `stub_status` (answer with this error status), `stub_delay_s`
(sleep before answering), `stub_raw` (answer 200 with this text, not JSON), `stub_chunk_delay_s`
(sleep between streamed chunks), `stub_reply` (the text to answer), `stub_hold` (a name: wait
until the test calls `StubEngine.release(name)`, so a call stays in flight however slow the
machine is). `app.state.chunk_delay_s`
slows every stream that does not say otherwise (a wire API's request carries no stub controls);
`app.state.hold` holds every call that names no hold of its own, `app.state.reply` is the chat
reply of every call that names none;
`app.state.usage = False` answers without `usage`, as some engines do; `app.state.error =
(status, message)` answers every call with that error, `app.state.raw` with that JSON text.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from tests.support import free_port

DEFAULT_REPLY = "Hello from the stub."


def encode(text: str) -> list[int]:
    return list(text.encode())


def decode(ids: list[int]) -> str:
    return bytes(ids).decode(errors="replace")


def render_chat(messages: list[dict[str, Any]]) -> str:
    """A ChatML-like template, so a longer history extends the prompt."""
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        parts.append(f"<|{message.get('role')}|>{content or ''}\n")
    return "".join(parts) + "<|assistant|>"


def _logprobs(tokens: list[int]) -> list[float]:
    return [-0.25 - i / 1000 for i in range(len(tokens))]


def create_stub_app(weight_version: int | None = None) -> FastAPI:
    app = FastAPI()
    app.state.requests = []
    app.state.chunk_delay_s = 0.0
    app.state.usage = True
    app.state.error = None
    app.state.raw = None
    app.state.holds = {}
    app.state.hold = None
    app.state.reply = DEFAULT_REPLY

    async def _common(request: Request) -> tuple[dict[str, Any], Response | None]:
        body = await request.json()
        app.state.requests.append(body)
        if body.get("stub_delay_s"):
            await asyncio.sleep(float(body["stub_delay_s"]))
        hold = body.get("stub_hold") or app.state.hold
        if hold:
            released = app.state.holds.setdefault(str(hold), threading.Event())
            deadline = time.monotonic() + 60
            while not released.is_set():
                if time.monotonic() > deadline:
                    return body, JSONResponse({"error": "stub hold never released"}, 500)
                await asyncio.sleep(0.01)
        if body.get("stub_raw"):
            return body, Response(str(body["stub_raw"]), 200, media_type="text/plain")
        if body.get("stub_status"):
            status = int(body["stub_status"])
            error = {"object": "error", "message": "stub failure", "type": "BadRequestError"}
            return body, JSONResponse(error, status)
        if app.state.raw is not None:
            return body, Response(app.state.raw, 200, media_type="application/json")
        if app.state.error is not None:
            status, message = app.state.error
            error = {"object": "error", "message": message, "type": "BadRequestError"}
            # Escaped as JSON carries it (`json.dumps`): the message may hold a lone surrogate.
            return body, Response(json.dumps(error), status, media_type="application/json")
        return body, None

    def _headers() -> dict[str, str]:
        return {} if weight_version is None else {"x-reins-weight-version": str(weight_version)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body, error = await _common(request)
        if error is not None:
            return error
        prompt = encode(render_chat(body.get("messages", [])))
        reply = body.get("stub_reply", app.state.reply)
        n = int(body.get("n") or 1)
        replies = [reply if i == 0 else f"{reply} #{i}" for i in range(n)]
        if body.get("stream"):
            return StreamingResponse(
                _chat_stream(
                    {"stub_chunk_delay_s": app.state.chunk_delay_s, **body}, prompt, replies
                ),
                media_type="text/event-stream",
                headers=_headers(),
            )
        choices = []
        for index, text in enumerate(replies):
            tokens = encode(text)
            choice: dict[str, Any] = {
                "index": index,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "finish_reason": "stop",
                "token_ids": tokens if body.get("return_token_ids") else None,
                "logprobs": None,
            }
            if body.get("logprobs"):
                choice["logprobs"] = {
                    "content": [
                        {"token": chr(t), "logprob": lp, "bytes": [t], "top_logprobs": []}
                        for t, lp in zip(tokens, _logprobs(tokens), strict=True)
                    ]
                }
            choices.append(choice)
        payload = {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(encode(reply))},
            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
        }
        if not app.state.usage:
            del payload["usage"]
        return JSONResponse(payload, headers=_headers())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body, error = await _common(request)
        if error is not None:
            return error
        raw = body.get("prompt", "")
        prompt = list(raw) if isinstance(raw, list) else encode(str(raw))
        text = body.get("stub_reply", DEFAULT_REPLY)
        tokens = encode(text)
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "finish_reason": "length",
            "logprobs": None,
        }
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = prompt
            choice["token_ids"] = tokens
        if body.get("logprobs") is not None:
            choice["logprobs"] = {
                "tokens": [chr(t) for t in tokens],
                "token_logprobs": _logprobs(tokens),
                "top_logprobs": None,
                "text_offset": list(range(len(tokens))),
            }
        if body.get("stream"):
            return StreamingResponse(
                _completion_stream(choice), media_type="text/event-stream", headers=_headers()
            )
        return JSONResponse(
            {
                "id": "cmpl-stub",
                "object": "text_completion",
                "model": body.get("model"),
                "choices": [choice],
            },
            headers=_headers(),
        )

    return app


async def _chat_stream(
    body: dict[str, Any], prompt: list[int], replies: list[str]
) -> AsyncIterator[bytes]:
    """Each reply as its choice, four tokens a chunk, one after the other; as vLLM does, every
    choice's last chunk carries its finish reason (an empty reply's too)."""
    ids = body.get("return_token_ids")
    for index, text in enumerate(replies):
        tokens = encode(text)
        logprobs = _logprobs(tokens)
        first: dict[str, Any] = {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "model": body.get("model"),
            "choices": [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if ids and index == 0:
            first["prompt_token_ids"] = prompt
        yield b"data: " + json.dumps(first).encode() + b"\n\n"
        starts = range(0, len(tokens), 4) if tokens else range(1)
        for start in starts:
            piece = tokens[start : start + 4]
            choice: dict[str, Any] = {
                "index": index,
                "delta": {"content": decode(piece)},
                "logprobs": None,
                "finish_reason": "stop" if start + 4 >= len(tokens) else None,
            }
            if ids:
                choice["token_ids"] = piece
            if body.get("logprobs"):
                choice["logprobs"] = {
                    "content": [
                        {"token": chr(t), "logprob": lp, "bytes": [t], "top_logprobs": []}
                        for t, lp in zip(piece, logprobs[start : start + 4], strict=True)
                    ]
                }
            chunk = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "choices": [choice]}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await asyncio.sleep(float(body.get("stub_chunk_delay_s") or 0))
    yield b"data: [DONE]\n\n"


async def _completion_stream(choice: dict[str, Any]) -> AsyncIterator[bytes]:
    yield b"data: " + json.dumps({"object": "text_completion", "choices": [choice]}).encode()
    yield b"\n\n"
    yield b"data: [DONE]\n\n"


class StubEngine:
    """The stub served by uvicorn on a loopback port, in a thread."""

    def __init__(self, weight_version: int | None = None) -> None:
        self.port = free_port()
        self.app = create_stub_app(weight_version)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every request body the stub received, in order."""
        return list(self.app.state.requests)

    def release(self, hold: str) -> None:
        """Lets the calls sent with `stub_hold: hold` answer (now or when they come)."""
        self.app.state.holds.setdefault(hold, threading.Event()).set()

    def __enter__(self) -> StubEngine:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the stub engine did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
