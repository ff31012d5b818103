"""Fixtures of the gateway tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from reins.serving import BackgroundServer
from tests.conftest import Gateway
from tests.stub_engine import StubEngine


@pytest.fixture
def stub() -> Iterator[StubEngine]:
    """A vLLM-shaped stub engine on loopback (the model is stubbed: see tests/stub_engine.py)."""
    with StubEngine() as engine:
        yield engine


@dataclass
class Engine:
    """The scripted engine's next answer: `answer` (a plain call) or `chunks` (a stream). STUBBED:
    the model (a Starlette app on loopback answers each chat completion with the script)."""

    answer: dict[str, Any] = field(default_factory=dict)
    chunks: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    """The chat requests it received, in order."""


@pytest.fixture
def engine(gateway: Gateway) -> Iterator[Engine]:
    """The scripted engine, registered as model `m`; rollout `r` created."""
    script = Engine()

    async def chat(request: Request) -> Response:
        body = await request.json()
        script.requests.append(body)
        if not body.get("stream"):
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
        gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
        yield script
    finally:
        server.stop()
