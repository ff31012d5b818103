"""The proxy's counts and relays, against real components: Anthropic's `count_tokens` of a prefill
through the gateway to the embedded engine (a tiny random Llama with the default model's real
tokenizer and chat template); token reuse's vLLM stream against a scripted vLLM on loopback
(STUBBED: its routes answer fixed token IDs and texts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import anthropic
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from reins.gateway.reuse_vllm import ReusedAnswer, VllmReuse
from reins.serving import BackgroundServer
from tests.conftest import Gateway
from tests.embedded_support import serving, tiny_engine


@contextlib.contextmanager
def anthropic_sdk_on_tiny_engine(gateway: Gateway) -> Iterator[anthropic.Anthropic]:
    """The tiny embedded engine registered as model `tiny`; the SDK on rollout `r`."""
    with serving(tiny_engine()) as served:
        gateway.http.post("/api/models", json={"model": "tiny", "endpoint": served.base_url})
        base, token = gateway.first_attempt()
        yield anthropic.Anthropic(base_url=f"{base}/anthropic", api_key=token, max_retries=0)


def recorded_prompt_lengths(gateway: Gateway) -> list[int]:
    events = gateway.http.get("/api/rollouts/r/events", params={"type": "model_request"}).json()
    return [len(event["data"]["prompt_token_ids"]) for event in events]


def test_count_tokens_of_a_prefill_is_the_prompt_the_call_has(gateway: Gateway) -> None:
    prefill = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
    ]
    closed = [*prefill, {"role": "user", "content": "Another?"}]
    with anthropic_sdk_on_tiny_engine(gateway) as sdk:
        counts = []
        for conversation in (prefill, closed):
            counts.append(
                sdk.messages.count_tokens(model="tiny", messages=conversation).input_tokens  # type: ignore[arg-type]
            )
            answer = sdk.messages.create(model="tiny", max_tokens=2, messages=conversation)  # type: ignore[arg-type]
            assert answer.usage.input_tokens == counts[-1]
    assert counts == recorded_prompt_lengths(gateway)


# Token reuse with vLLM: a scripted engine whose `generate` stream carries a byte that is not UTF-8.

PREFIX = [1, 2]
RENDERED = [1, 2, 3, 4]
CUT_CHARACTER = b"caf\xc3"
"""An engine's text cut inside a character (the first byte of `\u00e9`): not UTF-8."""


def scripted_vllm(generate_chunks: list[bytes]) -> Starlette:
    """vLLM's scale-out routes: render, detokenize (`<id>` per token), tokenize, generate
    (`generate_chunks`, streamed as they are) and derender (the chunk's token IDs as text)."""

    async def render(request: Request) -> Response:
        return JSONResponse({"token_ids": RENDERED, "sampling_params": {"temperature": 1.0}})

    async def detokenize(request: Request) -> Response:
        tokens = (await request.json())["tokens"]
        return JSONResponse({"prompt": "".join(f"<{token}>" for token in tokens)})

    async def tokenize(request: Request) -> Response:
        rest = (await request.json())["prompt"]
        tokens = [int(part) for part in rest.strip("<>").split("><")] if rest else []
        return JSONResponse({"tokens": tokens, "max_model_len": 100})

    async def generate(request: Request) -> Response:
        if not (await request.json())["stream"]:
            return Response(b"".join(generate_chunks), media_type="application/json")

        async def body() -> AsyncIterator[bytes]:
            for chunk in generate_chunks:
                yield chunk

        return StreamingResponse(body(), media_type="text/event-stream")

    async def derender(request: Request) -> Response:
        asked = await request.json()
        if "generate_response" in asked:  # a whole answer
            (choice,) = asked["generate_response"]["choices"]
            text = "".join(f"<{token}>" for token in choice["token_ids"])
            message = {"role": "assistant", "content": text}
            shown = {"index": 0, "message": message, "finish_reason": choice["finish_reason"]}
            return JSONResponse({"id": "c", "object": "chat.completion", "choices": [shown]})
        generated = asked["generate_chunk"]
        (choice,) = generated["choices"]
        text = "".join(f"<{token}>" for token in choice["token_ids"])
        delta = {"role": "assistant", "content": text}
        shown = {"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason")}
        chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [shown]}
        return JSONResponse({"chunk": chunk, "stream_state": {}})

    return Starlette(
        routes=[
            Route("/v1/chat/completions/render", render, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/inference/v1/generate", generate, methods=["POST"]),
            Route("/v1/chat/completions/derender", derender, methods=["POST"]),
        ]
    )


def sse(chunk: dict[str, Any], raw_field: bytes = b"") -> bytes:
    """One `data:` event; `raw_field` is spliced in as the bytes of a `text` field."""
    body = json.dumps(chunk).encode()
    if raw_field:
        body = body[:-1] + b', "text": "' + raw_field + b'"}'
    return b"data: " + body + b"\n\n"


def reused_stream(generate_chunks: list[bytes], *, stream: bool = True) -> list[bytes]:
    """What token reuse hands the proxy for a call, the pieces of its body in order (a stream's
    SSE events)."""
    server = BackgroundServer(scripted_vllm(generate_chunks)).start()

    async def ask() -> list[bytes]:
        async with aiohttp.ClientSession() as http:
            sent = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
            answer = await VllmReuse(http).answer(
                f"{server.url}/v1", "m", sent, PREFIX, shows_logprobs=False
            )
            assert isinstance(answer, ReusedAnswer), answer
            try:
                return [data async for data in answer.content.iter_any()]
            finally:
                answer.release()

    try:
        return asyncio.run(ask())
    finally:
        server.stop()


def test_a_generated_chunk_with_a_byte_that_is_not_utf8_does_not_cut_the_reused_stream() -> None:
    first = {"request_id": "g", "choices": [{"index": 0, "token_ids": [7]}]}
    last = {"choices": [{"index": 0, "token_ids": [8], "finish_reason": "length"}]}
    events = reused_stream([sse(first, CUT_CHARACTER), sse(last), b"data: [DONE]\n\n"])
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in events[:-1]]
    sampled = [
        token for chunk in chunks for choice in chunk["choices"] for token in choice["token_ids"]
    ]
    assert sampled == [7, 8]  # chunks that arrive together are merged: how many is not fixed
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1] == b"data: [DONE]\n\n"


def test_a_generated_answer_with_a_byte_that_is_not_utf8_is_still_reused() -> None:
    """Not streamed: decoded strictly, the generation was thrown away and the call sent again
    to the chat route, recorded as not reused."""
    generated = {"request_id": "g", "choices": [{"index": 0, "token_ids": [7, 8]}]}
    generated["choices"][0]["finish_reason"] = "length"
    body = json.dumps(generated).encode()
    (answer,) = reused_stream([body[:-1] + b', "text": "' + CUT_CHARACTER + b'"}'], stream=False)
    chat = json.loads(answer)
    assert chat["choices"][0]["token_ids"] == [7, 8]
    assert chat["choices"][0]["message"]["content"] == "<7><8>"
    assert chat["prompt_token_ids"] == RENDERED
