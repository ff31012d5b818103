"""The Anthropic Messages API through the gateway, as the real `anthropic` SDK sees it: what it
raises and what it assembles, compared with what Anthropic's API answers and with the recorded
call. STUBBED: the engine, a Starlette app on loopback answering each chat completion with the
scripted answer (`Engine.answer`, or `Engine.chunks` for a stream)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import pytest
from pydantic import TypeAdapter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from reins.serving import BackgroundServer
from tests.conftest import Gateway

MESSAGES: Any = [{"role": "user", "content": "hi"}]
ERROR_RESPONSE = TypeAdapter(anthropic.types.ErrorResponse)


@dataclass
class Engine:
    """The scripted engine's next answer: `answer` (a plain call) or `chunks` (a stream)."""

    answer: dict[str, Any] = field(default_factory=dict)
    chunks: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture
def engine(gateway: Gateway) -> Iterator[Engine]:
    """The scripted engine, registered as model `m`; rollout `r`'s first attempt is open."""
    script = Engine()

    async def chat(request: Request) -> Response:
        if not (await request.json()).get("stream"):
            return JSONResponse(script.answer)

        async def events() -> AsyncIterator[bytes]:
            for chunk in script.chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route("/v1/chat/completions", chat, methods=["POST"])]
    server = BackgroundServer(Starlette(routes=routes)).start()
    try:
        gateway.http.post("/api/models", json={"model": "m", "endpoint": f"{server.url}/v1"})
        yield script
    finally:
        server.stop()


def sdk(gateway: Gateway) -> anthropic.Anthropic:
    """The SDK on rollout `r`'s first attempt (opened by the admin key's first call)."""
    base = f"{gateway.url}/proxy/rollout/r/attempt/1/mode/val/anthropic"
    return anthropic.Anthropic(base_url=base, api_key=gateway.api_key, max_retries=0)


def recorded(gateway: Gateway) -> list[dict[str, Any]]:
    response = gateway.http.get("/api/rollouts/r/events", params={"type": "model_request"})
    assert response.status_code == 200, response.text
    return [event["data"] for event in response.json()]


def test_no_registered_model_is_anthropics_not_found_error(gateway: Gateway) -> None:
    """The proxy's own `model_not_found` code is no Anthropic error type: the SDK's
    `ErrorResponse` would not read it, nor would a harness that checks `error.type`."""
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    with pytest.raises(anthropic.NotFoundError) as raised:
        sdk(gateway).messages.create(model="m", max_tokens=8, messages=MESSAGES)
    error = ERROR_RESPONSE.validate_python(raised.value.body)
    assert error.error.type == "not_found_error"
    assert "no model is registered" in error.error.message
