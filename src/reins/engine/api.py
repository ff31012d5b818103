"""The embedded engine's OpenAI-compatible HTTP API: `/v1/models`, `/v1/chat/completions`,
`/v1/completions`, streamed or not.

Answers carry the fields vLLM returns with `return_token_ids` and `logprobs` (top-level
`prompt_token_ids` for chat, per-choice for completions; per-choice `token_ids`; logprobs of the
sampled tokens), so the gateway's proxy reads both engines the same way, and the header
`x-reins-weight-version` with the version of the weights each request started on. The token IDs
are always returned (the proxy removes what the harness did not ask for); logprob alternatives
(`top_logprobs`) are not computed and come back empty.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from reins.engine.chat import (
    TOOL_CALL_OPEN,
    ChatRequestError,
    parse_tool_calls,
    prepare_messages,
    template_knows_tools,
)
from reins.engine.embedded import EmbeddedEngine, Token
from reins.engine.sampling import SamplingParams

WEIGHT_VERSION_HEADER = "x-reins-weight-version"


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None


class ChatRequest(_Request):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool | None = False


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = False


class EngineError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def create_engine_app(engine: EmbeddedEngine) -> Starlette:
    """The HTTP API of `engine`."""
    api = _Api(engine)
    return Starlette(
        routes=[
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/health", api.health, methods=["GET"]),
            Route("/reins/load_weights", api.load_weights, methods=["POST"]),
        ]
    )


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


class _Api:
    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self.native_tools = template_knows_tools(getattr(engine.tokenizer, "chat_template", None))

    async def load_weights(self, request: Request) -> Response:
        """`{"path": MODEL_FOLDER}`: loads those weights in place (`ReloadPublisher`)."""
        try:
            body = await _json(request)
            path = body.get("path") if isinstance(body, dict) else None
            if not isinstance(path, str) or not path:
                raise EngineError(400, 'the body must be {"path": "<a saved model folder>"}')
            version = await asyncio.to_thread(self.engine.load_weights, path)
        except EngineError as error:
            return _error(error.status, error.message)
        except OSError as error:
            return _error(400, f"cannot load weights from that folder: {error}")
        return JSONResponse({"weight_version": version})

    async def health(self, _: Request) -> Response:
        return Response(status_code=200)

    async def models(self, _: Request) -> Response:
        card = {
            "id": self.engine.name,
            "object": "model",
            "created": 0,
            "owned_by": "reins",
            "max_model_len": self.engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def chat(self, request: Request) -> Response:
        try:
            body = ChatRequest.model_validate(await _json(request))
            self._check_model(body)
            tools = body.tools if body.tool_choice != "none" else None
            messages = prepare_messages(body.messages, tools, native_tools=self.native_tools)
            prompt_ids = self._render(messages, tools)
            params = self._params(body, len(prompt_ids))
        except ValidationError as error:
            return _error(400, _validation_message(error))
        except (EngineError, ChatRequestError) as error:
            status = error.status if isinstance(error, EngineError) else 400
            return _error(status, str(error))
        call = _Call(self.engine, "chat", body, prompt_ids, parse_tools=bool(tools))
        headers = {WEIGHT_VERSION_HEADER: str(self.engine.weight_version)}
        if body.stream:
            return StreamingResponse(
                call.stream(params), media_type="text/event-stream", headers=headers
            )
        return await call.answer(params, headers)

    async def completions(self, request: Request) -> Response:
        try:
            body = CompletionRequest.model_validate(await _json(request))
            self._check_model(body)
            if body.echo:
                raise EngineError(400, "`echo` is not supported by the embedded engine")
            prompt_ids = self._completion_prompt(body.prompt)
            params = self._params(body, len(prompt_ids))
        except ValidationError as error:
            return _error(400, _validation_message(error))
        except EngineError as error:
            return _error(error.status, error.message)
        call = _Call(self.engine, "completions", body, prompt_ids, parse_tools=False)
        headers = {WEIGHT_VERSION_HEADER: str(self.engine.weight_version)}
        if body.stream:
            return StreamingResponse(
                call.stream(params), media_type="text/event-stream", headers=headers
            )
        return await call.answer(params, headers)

    def _check_model(self, body: _Request) -> None:
        if body.model is not None and body.model != self.engine.name:
            raise EngineError(
                404,
                f"The model `{body.model}` does not exist; this engine serves "
                f"`{self.engine.name}`.",
                "NotFoundError",
            )

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        tokenizer = self.engine.tokenizer
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools if self.native_tools else None,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as error:  # the template's own error (jinja) says what is wrong
            message = f"the chat template cannot render these messages: {error}"
            raise EngineError(400, message) from error
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def _completion_prompt(
        self, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> list[int]:
        if isinstance(prompt, str):
            return list(self.engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if prompt and all(isinstance(item, int) for item in prompt):
            vocab = len(self.engine.tokenizer)
            if any(not 0 <= item < vocab for item in prompt):  # type: ignore[operator]
                raise EngineError(400, f"prompt token IDs must be in [0, {vocab})")
            return list(prompt)  # type: ignore[arg-type]
        if isinstance(prompt, list) and len(prompt) == 1:
            return self._completion_prompt(prompt[0])  # type: ignore[arg-type]
        raise EngineError(400, "`prompt` must be one string or one list of token IDs (no batches)")

    def _params(self, body: _Request, prompt_length: int) -> list[SamplingParams]:
        room = self.engine.max_model_len - prompt_length
        if room < 1:
            raise EngineError(
                400,
                f"This model's maximum context length is {self.engine.max_model_len} tokens; "
                f"the prompt has {prompt_length}.",
            )
        asked = body.max_completion_tokens or body.max_tokens
        if asked is not None and asked > room:
            raise EngineError(
                400,
                f"This model's maximum context length is {self.engine.max_model_len} tokens; "
                f"the prompt has {prompt_length} and max_tokens asks for {asked} more.",
            )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        return [
            SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=max(body.top_k or 0, 0),
                max_tokens=asked or room,
                stop=tuple(s for s in stop if s),
                seed=None if body.seed is None else body.seed + index,
            )
            for index in range(body.n)
        ]


class _Choice:
    """What one choice has produced so far, and the text it may show."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.shown = ""
        self.finish_reason: str | None = None


class _Call:
    """One request's choices: collected for an answer, or turned into SSE chunks."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        kind: Literal["chat", "completions"],
        body: ChatRequest | CompletionRequest,
        prompt_ids: list[int],
        *,
        parse_tools: bool,
    ) -> None:
        self.engine = engine
        self.kind = kind
        self.body = body
        self.prompt_ids = prompt_ids
        self.parse_tools = parse_tools
        self.stops = tuple(
            s for s in ([body.stop] if isinstance(body.stop, str) else body.stop or ()) if s
        )
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def text(self, choice: _Choice) -> str:
        """The choice's text as shown: decoded without special tokens, cut before a stop string."""
        text = self.engine.decode(choice.token_ids)
        cuts = [text.find(stop) for stop in self.stops if stop in text]
        return text[: min(cuts)] if cuts else text

    async def answer(self, params: list[SamplingParams], headers: dict[str, str]) -> Response:
        choices = [_Choice(i) for i in range(len(params))]
        async for item in self.engine.generate(self.prompt_ids, params):
            choice = choices[item.index]
            if isinstance(item, Token):
                choice.token_ids.append(item.token_id)
                choice.logprobs.append(item.logprob)
            elif item.error is not None:
                return _error(500, item.error, "InternalServerError")
            else:
                choice.finish_reason = item.reason
        completion_tokens = sum(len(c.token_ids) for c in choices)
        usage = {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(self.prompt_ids) + completion_tokens,
        }
        if self.kind == "chat":
            payload: dict[str, Any] = {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.engine.name,
                "choices": [self._chat_choice(c) for c in choices],
                "usage": usage,
                "prompt_token_ids": self.prompt_ids,
            }
        else:
            payload = {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.engine.name,
                "choices": [self._completion_choice(c) for c in choices],
                "usage": usage,
            }
        return JSONResponse(payload, headers=headers)

    def _chat_choice(self, choice: _Choice) -> dict[str, Any]:
        text = self.text(choice)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish_reason = choice.finish_reason
        if self.parse_tools:
            content, calls = parse_tool_calls(text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish_reason = "tool_calls"
        return {
            "index": choice.index,
            "message": message,
            "logprobs": {"content": self._chat_logprobs(choice.token_ids, choice.logprobs)},
            "finish_reason": finish_reason,
            "token_ids": choice.token_ids,
        }

    def _completion_choice(self, choice: _Choice) -> dict[str, Any]:
        return {
            "index": choice.index,
            "text": self.text(choice),
            "logprobs": self._completion_logprobs(choice.token_ids, choice.logprobs),
            "finish_reason": choice.finish_reason,
            "token_ids": choice.token_ids,
            "prompt_token_ids": self.prompt_ids,
        }

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        pieces = self.engine.tokenizer.convert_ids_to_tokens(token_ids)
        return [
            {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "top_logprobs": []}
            for piece, logprob in zip(pieces, logprobs, strict=True)
        ]

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        return {
            "tokens": self.engine.tokenizer.convert_ids_to_tokens(token_ids),
            "token_logprobs": logprobs,
            "top_logprobs": None,
            "text_offset": [],
        }

    async def stream(self, params: list[SamplingParams]) -> AsyncIterator[bytes]:
        choices = [_Choice(i) for i in range(len(params))]
        started: set[int] = set()
        async for item in self.engine.generate(self.prompt_ids, params):
            choice = choices[item.index]
            if isinstance(item, Token):
                choice.token_ids.append(item.token_id)
                choice.logprobs.append(item.logprob)
                delta = self._release(choice, final=False)
                yield self._chunk(choice, delta, [item.token_id], [item.logprob], started)
            elif item.error is not None:
                error = {
                    "error": {"message": item.error, "type": "InternalServerError", "code": 500}
                }
                yield f"data: {json.dumps(error)}\n\n".encode()
                return
            else:
                choice.finish_reason = item.reason
                yield self._last_chunk(choice, started)
        options = self.body.stream_options or {}
        if options.get("include_usage"):
            completion_tokens = sum(len(c.token_ids) for c in choices)
            usage = {
                "prompt_tokens": len(self.prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(self.prompt_ids) + completion_tokens,
            }
            yield _sse({**self._envelope(), "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    def _release(self, choice: _Choice, *, final: bool) -> str:
        """The text that can be shown now: held back while it could still become a stop string
        or a tool call."""
        text = self.text(choice)
        if not final:
            if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
                return ""
            hold = max((len(stop) - 1 for stop in self.stops), default=0)
            if self.parse_tools:
                opened = text.find(TOOL_CALL_OPEN)
                if opened >= 0:
                    text = text[:opened]
                else:
                    hold = max(hold, len(TOOL_CALL_OPEN) - 1)
            if hold:
                text = text[: max(len(choice.shown), len(text) - hold)]
        if not text.startswith(choice.shown):
            return ""
        delta = text[len(choice.shown) :]
        choice.shown = text
        return delta

    def _envelope(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.engine.name,
        }

    def _chunk(
        self,
        choice: _Choice,
        delta: str,
        token_ids: list[int],
        logprobs: list[float],
        started: set[int],
    ) -> bytes:
        first = choice.index not in started
        started.add(choice.index)
        if self.kind == "chat":
            delta_body: dict[str, Any] = {"content": delta}
            if first:
                delta_body["role"] = "assistant"
            entry: dict[str, Any] = {
                "index": choice.index,
                "delta": delta_body,
                "logprobs": {"content": self._chat_logprobs(token_ids, logprobs)},
                "finish_reason": None,
                "token_ids": token_ids,
            }
            chunk = {**self._envelope(), "choices": [entry]}
            if first:
                chunk["prompt_token_ids"] = self.prompt_ids
        else:
            entry = {
                "index": choice.index,
                "text": delta,
                "logprobs": self._completion_logprobs(token_ids, logprobs),
                "finish_reason": None,
                "token_ids": token_ids,
            }
            if first:
                entry["prompt_token_ids"] = self.prompt_ids
            chunk = {**self._envelope(), "choices": [entry]}
        return _sse(chunk)

    def _last_chunk(self, choice: _Choice, started: set[int]) -> bytes:
        finish_reason = choice.finish_reason
        if self.kind != "chat":
            entry: dict[str, Any] = {
                "index": choice.index,
                "text": self._release(choice, final=True),
                "logprobs": None,
                "finish_reason": finish_reason,
                "token_ids": [],
            }
            return _sse({**self._envelope(), "choices": [entry]})
        calls = parse_tool_calls(self.text(choice))[1] if self.parse_tools else []
        if calls:
            # The text before the first `<tool_call>` was streamed already; the calls replace
            # the rest.
            delta: dict[str, Any] = {
                "content": None,
                "tool_calls": [{"index": i, **call} for i, call in enumerate(calls)],
            }
            finish_reason = "tool_calls"
        else:
            delta = {"content": self._release(choice, final=True)}
        if choice.index not in started:
            delta["role"] = "assistant"
            started.add(choice.index)
        entry = {
            "index": choice.index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish_reason,
            "token_ids": [],
        }
        return _sse({**self._envelope(), "choices": [entry]})


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as error:
        raise EngineError(400, f"the request body is not JSON: {error}") from error


def _validation_message(error: ValidationError) -> str:
    problems = [
        f"{'.'.join(str(p) for p in item['loc']) or 'body'}: {item['msg']}"
        for item in error.errors()
    ]
    return "invalid request: " + "; ".join(problems)
