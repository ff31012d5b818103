"""Anthropic's `count_tokens` through the proxy, by the real `anthropic` SDK. STUBBED: the engine,
a Starlette app on loopback whose `/tokenize` and chat completions refuse the prompt with 400 (as
vLLM does when a chat template raises, e.g. on roles that do not alternate) or lack `/tokenize`
(404)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import anthropic
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from reins.serving import BackgroundServer
from tests.conftest import Gateway

REFUSAL = "the chat template cannot render these messages: roles must alternate"
MESSAGES = [{"role": "user", "content": "hi"}]


@contextlib.contextmanager
def sdk_on_engine(
    gateway: Gateway, tokenize_status: int
) -> Iterator[tuple[anthropic.Anthropic, list[str]]]:
    """An engine registered as model `m` whose `/tokenize` answers `tokenize_status` (404: no
    such route) and whose chat completions refuse with 400; the SDK on rollout `r`'s first
    attempt, and the paths the engine was asked, in order."""
    asked: list[str] = []

    async def refuse(request: Request) -> Response:
        asked.append(request.url.path)
        if request.url.path == "/tokenize" and tokenize_status == 404:
            return JSONResponse({"detail": "Not Found"}, 404)
        error = {"message": REFUSAL, "type": "BadRequestError", "param": None, "code": 400}
        return JSONResponse({"error": error}, 400)

    routes = [
        Route("/v1/chat/completions", refuse, methods=["POST"]),
        Route("/tokenize", refuse, methods=["POST"]),
    ]
    engine = BackgroundServer(Starlette(routes=routes)).start()
    try:
        gateway.http.post("/api/models", json={"model": "m", "endpoint": f"{engine.url}/v1"})
        gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
        token = str(gateway.http.post("/api/rollouts/r/attempts").json()["token"])
        base = f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train/anthropic"
        # Retries on: a 5xx answer would be retried by the SDK, a 4xx never.
        yield anthropic.Anthropic(base_url=base, api_key=token, max_retries=2), asked
    finally:
        engine.stop()


def test_a_prompt_the_engine_refuses_is_a_400_for_count_tokens_as_for_the_call(
    gateway: Gateway,
) -> None:
    with sdk_on_engine(gateway, 400) as (sdk, asked):
        with pytest.raises(anthropic.BadRequestError) as counted:
            sdk.messages.count_tokens(model="m", messages=MESSAGES)  # type: ignore[arg-type]
        assert asked == ["/tokenize"]  # asked once: not retried, by the proxy or the SDK
        with pytest.raises(anthropic.BadRequestError) as called:
            sdk.messages.create(model="m", max_tokens=8, messages=MESSAGES)  # type: ignore[arg-type]
    for raised in (counted.value, called.value):
        assert raised.body["type"] == "error"  # type: ignore[index]
        assert raised.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert REFUSAL in raised.body["error"]["message"]  # type: ignore[index]


def test_an_engine_without_tokenize_is_a_502_for_count_tokens(gateway: Gateway) -> None:
    with sdk_on_engine(gateway, 404) as (sdk, _), pytest.raises(anthropic.APIStatusError) as raised:
        sdk.with_options(max_retries=0).messages.count_tokens(model="m", messages=MESSAGES)  # type: ignore[arg-type]
    assert raised.value.status_code == 502
    assert raised.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert "could not count tokens" in raised.value.body["error"]["message"]  # type: ignore[index]


def test_a_count_without_a_model_is_anthropics_400_and_asks_no_engine(gateway: Gateway) -> None:
    """Anthropic's `count_tokens` requires `model`: a count without one (or with a number) was
    answered with the default model's count."""
    with sdk_on_engine(gateway, 200) as (sdk, asked):
        for body in ({"messages": MESSAGES}, {"model": 7, "messages": MESSAGES}):
            with pytest.raises(anthropic.BadRequestError) as raised:
                sdk.post("/v1/messages/count_tokens", body=body, cast_to=object)
            error = raised.value.body
            assert error["type"] == "error"  # type: ignore[index]
            assert error["error"]["type"] == "invalid_request_error"  # type: ignore[index]
            assert error["error"]["message"].startswith("model: required")  # type: ignore[index]
    assert asked == []
