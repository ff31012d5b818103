"""Token reuse with a vLLM engine: the call is rendered, prompted with token IDs and answered by
vLLM's own scale-out routes, so the gateway needs no tokenizer and vLLM's tool parser still
shapes the answer.

vLLM's chat route takes no token-ID prompt, so the embedded engine's field
(`reuse.PREFIX_FIELD`) means nothing to it. With `vllm serve --enable-scale-out` (vLLM >= 0.32)
it serves what the proxy needs instead:

1. `POST /v1/chat/completions/render`: the chat request -> the template's prompt token IDs and
   the call's sampling parameters (temperature, top_p, seed, stop, logprobs, ...), as vLLM's
   chat route would have used them.
2. `POST /detokenize` of the prefix IDs and of the rendering (special tokens kept), then the same
   rule as `reins.engine.chat.extend_prompt`: the rendering's text must start with the prefix's
   text; the prompt is then *prefix IDs + `POST /tokenize` of only the rest of the text*. When
   it does not (the harness changed its history) the call is `fallback`: sent to the chat route
   as usual.
3. `POST /inference/v1/generate` with that prompt and the rendered sampling parameters
   (`max_tokens` clamped to what the prompt leaves of `max_model_len`): token IDs and their
   logprobs, streamed or not.
4. `POST /v1/chat/completions/derender`: the generated tokens -> a chat completion, with the
   server's tool-call parser applied (streamed: one call per generated chunk, the parser's
   state carried by the proxy in `stream_state`).

The answer handed to the proxy (`ReusedAnswer`) has the shape of vLLM's chat answer with
`return_token_ids` and `logprobs`: top-level `prompt_token_ids` (as `generate` reports what it
consumed), `choices[i].token_ids` (every sampled token) and `choices[i].logprobs.content[j]
.logprob` (one per sampled token), so the proxy records it exactly as it records a chat call
(`reins.gateway.capture`; DESIGN invariant 1). What the harness is shown follows vLLM's chat
route, which derender alone does not: the token that ended the answer (end-of-turn or another
stop token) is not shown, a stop string and what follows it are cut from the content, and
`finish_reason` is `tool_calls` when the parser found calls.

Not reused (sent to the chat route as usual, recorded `none`): `n` > 1 (never asked), a stream
with stop strings (vLLM's chat route holds back text that may start a stop; derender does not),
a stream whose harness asked for logprobs (derender's parser path drops their token strings), a
prompt that leaves no room for an answer. An engine without these routes (older vLLM, or no
`--enable-scale-out`: 404/403) answers `unsupported`, logged once per endpoint: the proxy then
stops asking it (`TokenReuse.unsupported`) and every call works as without reuse.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Literal

import aiohttp

from reins.gateway.reuse import REUSE_HEADER

log = logging.getLogger(__name__)

RENDER = "/v1/chat/completions/render"
GENERATE = "/inference/v1/generate"
DERENDER = "/v1/chat/completions/derender"
_MISSING = {403, 404, 405, 501}
"""What a vLLM without a route answers (403: scale-out routes off, `--enable-scale-out`)."""

Declined = Literal["fallback", "none", "unsupported"]
"""`fallback`: the rendering does not continue the prefix; `none`: this call is not reused (see
the module docstring); `unsupported`: the engine lacks the routes."""


class _Unsupported(Exception):
    """A route answered as missing."""


class _Content:
    """The body of a `ReusedAnswer`, read as the proxy reads aiohttp's `StreamReader`."""

    def __init__(self, chunks: AsyncGenerator[bytes, None]) -> None:
        self._chunks = chunks
        self._eof = False

    async def iter_any(self) -> AsyncIterator[bytes]:
        async for data in self._chunks:
            yield data
        self._eof = True

    def at_eof(self) -> bool:
        return self._eof


class ReusedAnswer:
    """vLLM's answer to a reused call, with the part of `aiohttp.ClientResponse` the proxy uses:
    `status`, `headers` (`REUSE_HEADER: reused`), `content.iter_any()`, `read`, `release` and
    `close`. Closing it before the end closes `generate`'s response, so vLLM aborts the
    generation as it does for a chat client that left."""

    status = 200

    def __init__(
        self, chunks: AsyncGenerator[bytes, None], media: str, upstream: aiohttp.ClientResponse
    ) -> None:
        self.headers = {"content-type": media, REUSE_HEADER: "reused"}
        self.content = _Content(chunks)
        self._upstream = upstream

    async def read(self) -> bytes:
        return b"".join([data async for data in self.content.iter_any()])

    def release(self) -> None:
        self._upstream.release()

    def close(self) -> None:
        self._upstream.close()


class VllmReuse:
    """Token reuse through one gateway's vLLM engines (see the module docstring)."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http
        self._told: set[str] = set()
        """Endpoints whose missing routes were logged."""

    async def answer(
        self,
        endpoint: str,
        model: str,
        sent: dict[str, Any],
        prefix: Sequence[int],
        *,
        shows_logprobs: bool,
    ) -> ReusedAnswer | Declined:
        """The engine's answer to chat request `sent` (its `model` is the engine's name),
        prompted with `prefix` + the rest of its rendering; or why not. `shows_logprobs`: the
        harness asked for logprobs."""
        root = endpoint.rstrip("/").removesuffix("/v1")
        chat = {**sent, "model": model}
        stream = bool(chat.get("stream"))
        several = chat.get("n") not in (None, 1)  # null is one choice, as absent
        if several or (stream and (shows_logprobs or _stops(chat.get("stop")))):
            return "none"
        try:
            rendered = await self._post(root, RENDER, chat)
            if rendered is None:
                return "none"  # refused: the chat route answers the harness the same error
            prompt = await self._extend(root, model, list(prefix), rendered["token_ids"])
            if prompt is None:
                return "fallback"
            ids, max_model_len = prompt
            params = dict(rendered["sampling_params"])
            room = max_model_len - len(ids)
            asked = chat.get("max_completion_tokens") or chat.get("max_tokens")
            params["max_tokens"] = min(room, asked) if isinstance(asked, int) else room
            if room < 1:
                return "none"
            request = {
                key: value
                for key, value in rendered.items()
                if key not in ("token_ids", "token_offsets", "sampling_params")
            }
            request.update(
                token_ids=ids, sampling_params=params, return_token_ids=True, stream=stream
            )
            upstream = await self.http.post(root + GENERATE, json=request)
        except _Unsupported as missing:
            return self._missing(root, endpoint, str(missing), "no such route")
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as error:
            log.warning("token reuse with the vLLM engine at %s failed: %r", endpoint, error)
            return "none"
        if upstream.status >= 400:
            text = await upstream.text(errors="replace")
            upstream.release()
            if upstream.status in _MISSING:
                return self._missing(root, endpoint, f"{GENERATE} answered {upstream.status}", text)
            return "none"  # the chat route answers the harness the same error
        context = _Context(root, chat, ids, model)
        if stream:
            media = "text/event-stream; charset=utf-8"
            return ReusedAnswer(self._stream(context, upstream), media, upstream)
        try:
            body = await self._whole(context, upstream)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as error:
            log.warning("token reuse with the vLLM engine at %s failed: %r", endpoint, error)
            return "none"
        return ReusedAnswer(_once(body), "application/json", upstream)

    def _missing(self, root: str, endpoint: str, what: str, text: str) -> Declined:
        if root not in self._told:
            self._told.add(root)
            log.warning(
                "token reuse is off for the vLLM engine at %s: %s (%s); start it with "
                "`vllm serve --enable-scale-out` (vLLM >= 0.32) to turn it on",
                endpoint,
                what,
                " ".join(text[:300].split()),
            )
        return "unsupported"

    async def _post(self, root: str, route: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The route's JSON answer; None when it refused the request (4xx other than missing).
        Raises `_Unsupported` for a missing route, `ValueError` for a failure."""
        async with self.http.post(root + route, json=body) as response:
            text = await response.text(errors="replace")
            if response.status in _MISSING:
                raise _Unsupported(f"{route} answered {response.status}")
            if 400 <= response.status < 500:
                return None
            if response.status >= 300:
                raise ValueError(f"{route} answered {response.status}: {text[:500]}")
            answer = json.loads(text)
            if not isinstance(answer, dict):
                raise ValueError(f"{route} answered {text[:200]}")
            return answer

    async def _extend(
        self, root: str, model: str, prefix: list[int], rendering: list[int]
    ) -> tuple[list[int], int] | None:
        """(prefix + the tokens of the rest of the rendering's text, max_model_len), or None
        when the rendering's text does not start with the prefix's text (the rule of
        `reins.engine.chat.extend_prompt`)."""
        head, text = await asyncio.gather(
            self._text(root, model, prefix), self._text(root, model, rendering)
        )
        if not prefix or not head or not text.startswith(head):
            return None
        body = {"model": model, "prompt": text[len(head) :], "add_special_tokens": False}
        counted = await self._post(root, "/tokenize", body)
        if counted is None:
            raise ValueError("/tokenize refused the rest of the prompt")
        rest = counted["tokens"] if body["prompt"] else []
        return prefix + [int(token) for token in rest], int(counted["max_model_len"])

    async def _text(self, root: str, model: str, tokens: list[int]) -> str:
        answer = await self._post(root, "/detokenize", {"model": model, "tokens": tokens})
        if answer is None or not isinstance(answer.get("prompt"), str):
            raise ValueError(f"/detokenize answered {answer}")
        return str(answer["prompt"])

    async def _whole(self, context: _Context, upstream: aiohttp.ClientResponse) -> bytes:
        """The non-streamed answer: one JSON body."""
        try:
            generated = json.loads((await upstream.read()).decode(errors="replace"))
        finally:
            upstream.release()
        shown = copy.deepcopy(generated)
        for choice in shown["choices"]:
            choice["token_ids"] = _shown_ids(choice)
        blank = [choice for choice in shown["choices"] if not choice["token_ids"]]
        shown["choices"] = [choice for choice in shown["choices"] if choice["token_ids"]]
        answer: dict[str, Any] = {
            "id": generated.get("request_id"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": context.model,
            "choices": [],
        }
        if shown["choices"]:
            derendered = await self._post(context.root, DERENDER, context.derender(shown))
            if derendered is None:
                raise ValueError(f"{DERENDER} refused the generated answer")
            answer = derendered
        sampled = {choice["index"]: choice for choice in generated["choices"]}
        unshown = await self._unshown_logprobs(context, generated, blank, sampled)
        for choice in blank:  # nothing shown (the answer ended at once): nothing to parse
            answer["choices"].append(
                {
                    "index": choice["index"],
                    "message": {"role": "assistant", "content": ""},
                    "logprobs": unshown.get(choice["index"]),
                    "finish_reason": choice["finish_reason"],
                    "stop_reason": choice.get("stop_reason"),
                }
            )
        for choice in answer["choices"]:
            mine = sampled[choice["index"]]
            choice["token_ids"] = mine["token_ids"]
            choice["logprobs"] = _chat_logprobs(mine.get("logprobs"), choice.get("logprobs"))
            _as_chat_route(choice, context.chat, choice["message"])
        answer["choices"].sort(key=lambda choice: choice["index"])
        answer["prompt_token_ids"] = generated.get("prompt_token_ids") or context.prompt
        answer["usage"] = generated.get("usage") or answer.get("usage")
        return json.dumps(answer).encode()

    async def _unshown_logprobs(
        self,
        context: _Context,
        generated: dict[str, Any],
        blank: list[dict[str, Any]],
        sampled: dict[int, dict[str, Any]],
    ) -> dict[int, Any]:
        """The chat-shaped logprobs of the choices that show no text (their one token ended
        the answer), by index: derendered alone, only for their logprobs, since vLLM's chat route
        shows that token's entry (its text and alternatives) though not its text. Empty when
        none asked for logprobs."""
        unshown = [sampled[choice["index"]] for choice in blank]
        wanted = [choice for choice in unshown if choice.get("logprobs") and choice["token_ids"]]
        if not wanted:
            return {}
        body = context.derender({**generated, "choices": wanted})
        derendered = await self._post(context.root, DERENDER, body)
        if derendered is None:
            raise ValueError(f"{DERENDER} refused the generated answer's logprobs")
        return {choice["index"]: choice.get("logprobs") for choice in derendered["choices"]}

    async def _stream(
        self, context: _Context, upstream: aiohttp.ClientResponse
    ) -> AsyncGenerator[bytes, None]:
        """The streamed answer: each generated chunk derendered as it comes, as an SSE event. A
        failure raises `aiohttp.ClientPayloadError`: the proxy records the call as a stream that
        broke off (502) and tells the harness."""
        try:
            async for event in self._events(context, upstream):
                yield event
        except (ValueError, KeyError, TypeError, _Unsupported) as error:
            raise aiohttp.ClientPayloadError(f"token reuse: {error!r}") from error

    async def _events(
        self, context: _Context, upstream: aiohttp.ClientResponse
    ) -> AsyncGenerator[bytes, None]:
        state: dict[str, Any] | None = None
        calls = False
        async for generated in _generated(upstream):
            if "error" in generated:
                yield b"data: " + json.dumps(generated).encode() + b"\n\n"
                continue
            chunk: dict[str, Any] = {
                "id": generated.get("request_id"),
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": context.model,
                "choices": [],
            }
            if generated.get("choices"):
                (sampled,) = generated["choices"]
                shown = copy.deepcopy(generated)
                shown["choices"][0]["token_ids"] = _shown_ids(sampled)
                body = context.derender(shown, stream=True, state=state)
                derendered = await self._post(context.root, DERENDER, body)
                if derendered is None:
                    raise ValueError(f"{DERENDER} refused a generated chunk")
                state = derendered["stream_state"]
                chunk = derendered["chunk"]
                for choice in chunk["choices"]:
                    calls = calls or bool((choice.get("delta") or {}).get("tool_calls"))
                    choice["token_ids"] = sampled.get("token_ids") or []
                    choice["logprobs"] = _chat_logprobs(sampled.get("logprobs"), None)
                    if choice.get("finish_reason") == "stop" and calls:
                        _as_chat_route(choice, context.chat, {"tool_calls": [True]})
            if generated.get("prompt_token_ids"):
                chunk["prompt_token_ids"] = generated["prompt_token_ids"]
            if generated.get("usage"):
                chunk["usage"] = generated["usage"]
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


class _Context:
    """What derendering one call needs."""

    def __init__(self, root: str, chat: dict[str, Any], prompt: list[int], model: str) -> None:
        self.root = root
        self.chat = chat
        self.prompt = prompt
        self.model = model

    def derender(
        self, generated: dict[str, Any], *, stream: bool = False, state: Any = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt_token_ids": self.prompt,
            "prompt_tokens": len(self.prompt),
            "chat_request": self.chat,
        }
        if stream:
            return {**body, "stream": True, "generate_chunk": generated, "stream_state": state}
        return {**body, "generate_response": generated}


async def _once(body: bytes) -> AsyncGenerator[bytes, None]:
    yield body


def _stops(stop: Any) -> bool:
    return bool(stop) if isinstance(stop, (str, list)) else False


def _shown_ids(choice: dict[str, Any]) -> list[int]:
    """The sampled token IDs whose text vLLM's chat route shows: all but a final token that
    ended the answer as a stop token (end-of-turn, `stop_token_ids`)."""
    ids = list(choice.get("token_ids") or ())
    ended_by_token = choice.get("finish_reason") == "stop" and not isinstance(
        choice.get("stop_reason"), str
    )
    return ids[:-1] if ended_by_token and ids else ids


def _chat_logprobs(generated: Any, resolved: Any) -> dict[str, Any] | None:
    """Chat-shaped logprobs, one per sampled token: derender's (with token strings) when it
    resolved them all, else the values from `generate` (token strings empty: a harness that asked
    for logprobs in a stream is not reused)."""
    content = (generated or {}).get("content") if isinstance(generated, dict) else None
    if not content:
        return None
    if isinstance(resolved, dict) and len(resolved.get("content") or ()) == len(content):
        return resolved
    return {
        "content": [
            {"token": "", "logprob": item["logprob"], "bytes": None, "top_logprobs": []}
            for item in content
        ]
    }


def _as_chat_route(choice: dict[str, Any], chat: dict[str, Any], message: dict[str, Any]) -> None:
    """What vLLM's chat route does after parsing: a stop string and what follows it cut from
    the content, `finish_reason` `tool_calls` when the parser found calls (tool choice auto)."""
    stop = choice.get("stop_reason")
    content = message.get("content") if "content" in message else None
    if isinstance(stop, str) and stop and isinstance(content, str) and stop in content:
        message["content"] = content[: content.index(stop)]
    auto = chat.get("tool_choice") in (None, "auto")
    if choice.get("finish_reason") == "stop" and auto and message.get("tool_calls"):
        choice["finish_reason"] = "tool_calls"


async def _generated(upstream: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """`generate`'s stream chunks, those that arrived together merged into one (`_merged`): while
    a chunk is derendered the next ones pile up, and are then derendered in one call. A byte
    that is not UTF-8 becomes U+FFFD, as in the proxy's chat relay (`proxy._lines`): decoded
    strictly, it broke off an answer that was otherwise whole. A last line without its newline
    is read too."""
    pending = b""
    async for data in upstream.content.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        batch, done = _parsed(lines)
        for chunk in _merged(batch):
            yield chunk
        if done:
            return
    for chunk in _merged(_parsed([pending])[0]):
        yield chunk


def _parsed(lines: list[bytes]) -> tuple[list[dict[str, Any]], bool]:
    """The chunks of these SSE lines up to `[DONE]`, and whether it came."""
    chunks: list[dict[str, Any]] = []
    for line in lines:
        text = line.rstrip(b"\r").decode(errors="replace")
        payload = text[5:].strip() if text.startswith("data:") else ""
        if payload == "[DONE]":
            return chunks, True
        if payload:
            chunks.append(json.loads(payload))
    return chunks, False


def _merged(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive chunks of one choice as one chunk: token IDs and logprobs joined, the first
    `prompt_token_ids`, the last `finish_reason`, `stop_reason` and `usage`. An error chunk
    stays apart."""
    out: list[dict[str, Any]] = []
    for chunk in batch:
        last = out[-1] if out else None
        if last is None or "error" in chunk or "error" in last:
            out.append(copy.deepcopy(chunk))
            continue
        for key in ("usage", "metrics"):
            if chunk.get(key) is not None:
                last[key] = chunk[key]
        if chunk.get("prompt_token_ids") and not last.get("prompt_token_ids"):
            last["prompt_token_ids"] = chunk["prompt_token_ids"]
        if not chunk.get("choices"):
            continue
        if not last.get("choices"):
            last["choices"] = copy.deepcopy(chunk["choices"])
            continue
        (into,), (more,) = last["choices"], chunk["choices"]
        into["token_ids"] = (into.get("token_ids") or []) + (more.get("token_ids") or [])
        entries = ((more.get("logprobs") or {}).get("content")) or []
        if entries:
            logprobs = into.get("logprobs") or {"content": []}
            logprobs["content"] = (logprobs.get("content") or []) + entries
            into["logprobs"] = logprobs
        for key in ("finish_reason", "stop_reason"):
            if more.get(key) is not None:
                into[key] = more[key]
    return out
