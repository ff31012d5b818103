"""The LLM proxy: forwards a harness's OpenAI call to a registered engine and records it.

One `LLMProxy` per gateway process. It picks the endpoint (a rollout sticks to one endpoint of
its model, for prefix-cache reuse), waits at the admission gate, retries transport errors with
backoff (moving to the model's next endpoint), and records every call as a `model_request` event
before the harness's call completes, so a trainer that sees the rollout finished sees its calls.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import orjson
from fastapi import Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from reins.disconnect import CLIENT_CLOSED_REQUEST, ClientLeft, unless_client_leaves
from reins.gateway import jsonrule
from reins.gateway.admission import AdmissionGate, AdmissionTimeout
from reins.gateway.capture import (
    CallFacts,
    Kind,
    SamplingPolicy,
    StreamRecorder,
    abandoned_records,
    answer_and_records,
    answer_failure,
    error_record,
    out_of_range,
    strip_for_harness,
    upstream_body,
    without_distribution_changes,
)
from reins.gateway.reuse import PREFIX_FIELD, REUSE_HEADER, TokenReuse
from reins.gateway.reuse_vllm import ReusedAnswer, VllmReuse
from reins.gateway.store import OUTAGES, Conflict, Invalid, Store
from reins.gateway.upstream import EngineClient, EngineResponse
from reins.gateway.wire import Translation, WireApi, WireError
from reins.gateway.wire.overflow import Overflow, openai_body, read_overflow
from reins.httpjson import JSONResponse
from reins.schemas import MODEL_REQUEST, EventIn, Model, ModelRequest

log = logging.getLogger(__name__)

WEIGHT_VERSION_HEADER = "x-reins-weight-version"
_PATHS: dict[Kind, str] = {"chat": "/chat/completions", "completions": "/completions"}
_JSON = {"content-type": "application/json"}
RETRY_HEADERS = ("retry-after", "retry-after-ms")
"""An engine's error headers that the harness's SDK reads to wait before its retry (the openai
and anthropic SDKs honour both on a 429 or 503): passed on with the engine's error, else the
SDK retries at once and meets the engine's limit again."""
Upstream = EngineResponse | ReusedAnswer
"""An engine's answer, body unread (`ReusedAnswer`: a call reused through vLLM's routes)."""


def _model_card(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "reins"}


def openai_error(
    status: int,
    message: str,
    kind: str,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> JSONResponse:
    """An error shaped as OpenAI's, so SDKs show its message: `code` is the proxy's own code
    for it (`model_not_found`, as OpenAI's API says it), else the status, as vLLM answers."""
    error = {"message": message, "type": kind, "code": status if code is None else code}
    return JSONResponse({"error": error}, status, headers=headers)


@dataclass
class Target:
    model: Model
    endpoints: list[str]
    """The endpoints to try, the rollout's sticky one first."""
    engines: list[str]
    """Their kinds, in the same order."""


@dataclass
class _Failed:
    """A call that failed before an answer could be relayed (already recorded)."""

    status: int
    message: str
    kind: str
    content: bytes | None = None
    """The engine's own error body, when it answered one."""
    media: str | None = None
    overflow: Overflow | None = None
    """The engine refused the prompt as too long for its context (said in each API's words)."""
    headers: dict[str, str] | None = None
    """The engine's headers that tell a client when to retry (`RETRY_HEADERS`), passed on."""


@dataclass
class _Recording:
    """Whether a non-streamed call's own record is being written (`LLMProxy.unless_abandoned`)."""

    started: bool = False


_RECORDING: ContextVar[_Recording | None] = ContextVar("reins_proxy_recording", default=None)
"""Set by `unless_abandoned` around its work, whose task inherits it: `_record` marks it."""


class UnrecordableAnswer(Exception):
    """The engine's answer, as the harness's API carries it, breaks the record's JSON rule (a
    wire conversion decoded an escaped lone surrogate out of a tool call's arguments): the call
    stands recorded as failed (502), and the harness is told so (`LLMProxy._record`)."""


_NOT_STORED: tuple[type[Exception], ...] = (*OUTAGES, UnrecordableAnswer)
"""What `_record` raises when the call could not be stored as it was (`_record_unheard`)."""

_NO_MODEL = "no model is registered at the gateway; the trainer registers one: POST /api/models"

_PROMPT = frozenset(
    {"messages", "tools", "tool_choice", "documents", "chat_template", "chat_template_kwargs"}
    | {"add_generation_prompt", "continue_final_message", "add_special_tokens"}
    | {"mm_processor_kwargs"}
)
"""The chat request's fields that make its prompt (vLLM's `/tokenize` chat request's, and
`tool_choice`, whose `none` leaves the tools out on the embedded engine): those a mode's policy
sets are counted by `count_tokens` as the call sends them."""


def _error_message(text: str) -> str:
    """The message of an engine's error body (OpenAI's shape, FastAPI's, or plain text)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:2000]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if isinstance(body.get(key), str):
                return str(body[key])
    return text[:2000]


def _openai_failure(status: int, message: str, code: str | None = None) -> Response:
    headers = {"Retry-After": "30"} if status == 503 else None
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return openai_error(status, message, kind, headers=headers, code=code)


class ModelDirectory:
    """Registered models, cached for a moment so the hot path does not read the store."""

    def __init__(self, store: Store, ttl_s: float = 1.0) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._models: list[Model] = []
        self._fetched = -1e9
        self.served_names: dict[str, str] = {}
        """Per endpoint, the model name its engine answers to (see `LLMProxy._served_name`)."""

    def invalidate(self) -> None:
        self._fetched = -1e9
        self.served_names.clear()

    async def models(self) -> list[Model]:
        if time.monotonic() - self._fetched > self.ttl_s:
            self._models = await self.store.list_models()
            self._fetched = time.monotonic()
        return self._models

    async def target(self, requested: object, rollout_id: str) -> Target | None:
        """The named model if registered, else the default (first registered) one."""
        models = await self.models()
        if not models:
            return None
        chosen = next((m for m in models if m.model == requested), models[0])
        start = sticky_index(rollout_id, len(chosen.endpoints))
        engines = chosen.engines or [chosen.engine] * len(chosen.endpoints)
        return Target(
            chosen,
            chosen.endpoints[start:] + chosen.endpoints[:start],
            engines[start:] + engines[:start],
        )


def sticky_index(rollout_id: str, engines: int) -> int:
    """The engine a rollout's calls go to first: the same at every gateway replica, spread
    evenly. A CRC is linear: the ids of a group's rollouts (`...r1.0` to `...r1.3`) differ in a
    few bits, and `crc32 % 2` sent a whole group, then a whole step, to one engine."""
    digest = hashlib.blake2b(rollout_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % engines


class LLMProxy:
    def __init__(
        self,
        store: Store,
        gate: AdmissionGate,
        sampling: dict[str, SamplingPolicy],
        *,
        retries: int = 3,
        backoff_s: float = 0.2,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 3600.0,
        token_reuse: bool = False,
    ) -> None:
        self.store = store
        self.gate = gate
        self.sampling = sampling
        self.retries = retries
        self.backoff_s = backoff_s
        self.read_timeout_s = read_timeout_s
        self.directory = ModelDirectory(store)
        self.reuse = TokenReuse() if token_reuse else None
        """Token reuse (`GatewaySettings.token_reuse`, `reuse.py`); None when off."""
        self.on_record: Callable[[ModelRequest], None] | None = None
        """Called with every recorded call (the gateway's Prometheus counters)."""
        self.engines = EngineClient(connect_timeout_s, read_timeout_s)
        """The calls themselves (`upstream.py`: a lighter client than aiohttp's session)."""
        # aiohttp rather than httpx for the rest (model names, token counts, vLLM's reuse
        # routes): 0.56 vs 2.4 ms of CPU per call measured here.
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
            ),
            connector=aiohttp.TCPConnector(limit=1000),
            auto_decompress=True,
        )
        self.vllm_reuse = VllmReuse(self.http)
        """Token reuse with vLLM engines (`reuse_vllm.py`); used only when `reuse` is on."""

    async def close(self) -> None:
        await self.engines.close()
        await self.http.close()

    async def list_models(self) -> dict[str, Any]:
        models = await self.directory.models()
        return {"object": "list", "data": [_model_card(m.model) for m in models]}

    async def model_card(self, model_id: str) -> Response:
        """One registered model as OpenAI's `GET /v1/models/{model}` answers it
        (`client.models.retrieve`); an unknown one is OpenAI's 404 `model_not_found`."""
        if model_id not in {m.model for m in await self.directory.models()}:
            message = f"model {model_id} is not served here (GET .../openai/v1/models lists them)"
            return openai_error(404, message, "invalid_request_error", code="model_not_found")
        return JSONResponse(_model_card(model_id))

    async def forward(
        self, kind: Kind, rollout_id: str, attempt_id: int, mode: str, body: dict[str, Any]
    ) -> Response:
        """An OpenAI chat or text completion call, relayed as the engine answers it."""
        refusal = out_of_range(body)
        if refusal is not None:
            return openai_error(400, refusal, "invalid_request_error")
        opened = await self._open(body.get("model"), rollout_id, _openai_failure)
        if isinstance(opened, Response):
            return opened
        target = opened
        streaming = False
        try:
            sent = upstream_body(
                body, kind=kind, model=target.model.model, policy=self.sampling[mode]
            )
            facts = CallFacts(
                kind=kind,
                mode=mode,
                request=body,
                model=target.model.model,
                endpoint=target.endpoints[0],
                model_version=target.model.weight_version,
                latency_s=0.0,
                stream=bool(body.get("stream")),
            )
            self._apply_mode(mode, sent, facts)
            if self.reuse is not None and kind == "chat":
                self.reuse.prepare((rollout_id, attempt_id), body, sent, target.endpoints[0])
            started = time.perf_counter()
            upstream = await self._call(kind, target, sent, facts, started, rollout_id, attempt_id)
            if isinstance(upstream, _Failed):
                if upstream.overflow is not None:
                    param = "messages" if kind == "chat" else "prompt"
                    return JSONResponse(openai_body(upstream.overflow, param), 400)
                if upstream.content is not None:  # the engine's own error, passed on as it is
                    return Response(
                        upstream.content,
                        upstream.status,
                        headers=upstream.headers,
                        media_type=upstream.media,
                    )
                return openai_error(upstream.status, upstream.message, upstream.kind)
            if facts.stream:
                streaming = True
                return _ReleasingStream(
                    self._relay(upstream, facts, started, rollout_id, attempt_id),
                    release=lambda: self._release_stream(upstream, body),
                    media_type="text/event-stream",
                )
            payload = await self._json_answer(upstream, facts, started, rollout_id, attempt_id)
            if isinstance(payload, _Failed):
                return openai_error(payload.status, payload.message, payload.kind)
            try:
                shown, records = answer_and_records(facts, payload)
            except Exception as error:
                failure = _unreadable(facts, error)
                await self._record(rollout_id, attempt_id, [error_record(facts, 502, failure)])
                return openai_error(502, failure, "bad_upstream_answer")
            await self._record(rollout_id, attempt_id, records)
            return Response(orjson.dumps(shown), media_type="application/json")
        finally:
            # A stream keeps its admission slot until the response is over (see _ReleasingStream).
            if not streaming:
                self._ended(body)
                self.gate.exit()

    async def forward_wire(
        self, api: WireApi, rollout_id: str, attempt_id: int, mode: str, body: dict[str, Any]
    ) -> Response:
        """A call in another wire API (Responses, Messages): translated to the engine's chat
        completions and back (`reins.gateway.wire`), recorded like a chat call, with the request
        and the answer as the harness saw them and `kind` naming the API."""

        def failure_response(
            status: int,
            message: str,
            kind: str | None = None,
            param: str | None = None,
            code: str | None = None,
            retry: dict[str, str] | None = None,
        ) -> Response:
            headers = retry or ({"Retry-After": "30"} if status == 503 else None)
            body = api.error_body(status, message, kind, param=param, code=code)
            return JSONResponse(body, status, headers=headers)

        facts = CallFacts(
            kind="chat",
            mode=mode,
            request=body,
            model=str(body.get("model")),
            endpoint="",
            model_version=None,
            latency_s=0.0,
            stream=body.get("stream") is True,
            api=api.KIND,
        )
        try:
            translation = api.translate(body)
        except WireError as error:
            # Recorded too: a harness whose requests are refused shows up in its rollout.
            refused = error_record(facts, error.status, error.message)
            if self.reuse is not None:  # as every chat-translated call's record says it
                refused = refused.model_copy(update={"token_reuse": "none"})
            await self._record(rollout_id, attempt_id, [refused])
            return failure_response(error.status, error.message, error.kind, error.param)
        facts.notes = translation.notes  # the same list: notes made while answering count too
        opened = await self._open(body.get("model"), rollout_id, failure_response)
        if isinstance(opened, Response):
            return opened
        target = opened
        streaming = False
        try:
            facts.model = target.model.model
            facts.endpoint = target.endpoints[0]
            facts.model_version = target.model.weight_version
            sent = upstream_body(
                translation.chat_request(),
                kind="chat",
                model=target.model.model,
                policy=self.sampling[mode],
            )
            sent["stream"] = translation.stream
            self._apply_mode(mode, sent, facts)
            translation.sent_to_engine(sent)
            if self.reuse is not None:
                self.reuse.prepare((rollout_id, attempt_id), body, sent, target.endpoints[0])
            started = time.perf_counter()
            upstream = await self._call(
                "chat", target, sent, facts, started, rollout_id, attempt_id
            )
            if isinstance(upstream, _Failed):
                if upstream.overflow is not None:
                    return JSONResponse(api.overflow_body(upstream.overflow), 400)
                return failure_response(upstream.status, upstream.message, retry=upstream.headers)
            if translation.stream:
                streaming = True
                return _ReleasingStream(
                    self._relay_wire(upstream, translation, facts, started, rollout_id, attempt_id),
                    release=lambda: self._release_stream(upstream, body),
                    media_type="text/event-stream",
                )
            payload = await self._json_answer(upstream, facts, started, rollout_id, attempt_id)
            if isinstance(payload, _Failed):
                return failure_response(payload.status, payload.message)
            # Answered before the token IDs the harness did not ask for are stripped: usage the
            # engine did not send is counted from them, as a stream's is.
            try:
                answer = translation.answer(payload)
                _, records = answer_and_records(facts, payload)
            except Exception as error:
                failure = _unreadable(facts, error)
                await self._record(rollout_id, attempt_id, [error_record(facts, 502, failure)])
                return failure_response(502, failure)
            for record in records:
                record.response = answer
            await self._record(rollout_id, attempt_id, records)
            return Response(orjson.dumps(answer), media_type="application/json")
        finally:
            if not streaming:
                self._ended(body)
                self.gate.exit()

    def _apply_mode(self, mode: str, sent: dict[str, Any], facts: CallFacts) -> None:
        """Train mode's promise (`GatewaySettings.train_sampling`): the policy's own
        distribution, whatever the harness asked for."""
        if mode == "train":
            for name in without_distribution_changes(sent, self.sampling[mode]):
                facts.notes.append(
                    f"{name} dropped: train mode samples from the policy's own distribution"
                )

    async def count_tokens(self, chat: dict[str, Any], rollout_id: str, mode: str) -> int:
        """The prompt length of a chat request, counted by the engine's own tokenizer and chat
        template (`POST /tokenize`, as vLLM and the embedded engine serve it), with the prompt
        fields `mode`'s sampling policy sets, as the call itself would send them (a policy's
        `chat_template_kwargs` can change the rendered prompt: Qwen3's `enable_thinking`).

        Raises `WireError`: 400 with the engine's message when it refuses the request (400 or
        422, as its chat completions would refuse the same prompt: the harness's to fix, not to
        retry); 502/404 when no engine can count."""
        target = await self.directory.target(chat.get("model"), rollout_id)
        if target is None:
            raise WireError(_NO_MODEL, status=404, kind="not_found_error")
        prompt = self._prompt_as_sent(chat, mode, target.model.model)
        failure = ""
        for endpoint in target.endpoints:
            body = {
                # The call's own prompt: a new turn's header, unless the request continues its
                # last message (a prefill, `continue_final_message`), as the call would.
                "add_generation_prompt": True,
                **prompt,
                "model": await self._served_name(endpoint, target.model.model),
            }
            url = endpoint.rstrip("/").removesuffix("/v1") + "/tokenize"
            try:
                async with self.http.post(url, json=body) as response:
                    text = await response.text(errors="replace")
                    if response.status == 200:
                        count = json.loads(text).get("count")
                        if isinstance(count, int):
                            return count
                    elif response.status in (400, 422):
                        raise WireError(_error_message(text))
                    failure = f"the engine at {endpoint} could not count tokens: {text[:500]}"
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                failure = f"the engine at {endpoint} could not count tokens: {error!r}"
        raise WireError(failure, status=502, kind="api_error")

    def _prompt_as_sent(self, chat: dict[str, Any], mode: str, model: str) -> dict[str, Any]:
        """`chat`'s prompt fields as the call would send them, `mode`'s policy applied the way
        `upstream_body` applies it to the call; its sampling fields and token capture left out,
        which change no prompt."""
        sent = upstream_body(chat, kind="chat", model=model, policy=self.sampling[mode])
        return {name: value for name, value in sent.items() if name in chat or name in _PROMPT}

    async def _open(
        self, requested: object, rollout_id: str, failure: Callable[..., Response]
    ) -> Target | Response:
        """The call's target, with an admission slot held (the caller exits the gate), or the
        error answer.

        The target is looked up once admitted: a call held during a weight update goes to the
        endpoints, and records the version, that the trainer registered before resuming."""
        try:
            await self.gate.enter()
        except AdmissionTimeout as timeout:
            return failure(503, f"{timeout}; retry later", code="paused")
        try:
            target = await self.directory.target(requested, rollout_id)
        except BaseException:
            # Cancelled (the harness hung up during a store read) or failed: the slot is given
            # back here, since the caller's `finally` is not reached; a leaked one holds every
            # later drain of the gate.
            self.gate.exit()
            raise
        if target is None:
            self.gate.exit()
            return failure(404, _NO_MODEL, code="model_not_found")
        return target

    async def _call(
        self,
        kind: Kind,
        target: Target,
        sent: dict[str, Any],
        facts: CallFacts,
        started: float,
        rollout_id: str,
        attempt_id: int,
    ) -> Upstream | _Failed:
        """The engine's 2xx answer, body unread; a failure is recorded and returned."""
        heard: str | None = None
        upstream: Upstream | None = None
        if PREFIX_FIELD in sent and target.engines[0] == "vllm":
            upstream, heard = await self._reuse_vllm(target, sent, facts.request)
        if upstream is None:
            upstream, endpoint, failure = await self._send(kind, target, sent)
        else:
            endpoint, failure = target.endpoints[0], ""
        facts.endpoint = endpoint
        if upstream is None:
            facts.latency_s = time.perf_counter() - started
            await self._record(rollout_id, attempt_id, [error_record(facts, 502, failure)])
            return _Failed(502, failure, "upstream_unavailable")
        facts.model_version = _weight_version(upstream, target.model.weight_version)
        media = upstream.headers.get("content-type", "")
        if upstream.status < 400 and facts.stream and not media.startswith("text/event-stream"):
            # A stream request answered with anything else: a failure, recorded (issue #19).
            body = await self._body(upstream, facts, started, rollout_id, attempt_id)
            if isinstance(body, _Failed):
                return body
            text = body.decode(errors="replace")
            facts.latency_s = time.perf_counter() - started
            failure = (
                f"the engine at {endpoint} answered a stream request with {media or 'no type'}, "
                f"not a stream (text/event-stream): {text[:500]}"
            )
            await self._record(rollout_id, attempt_id, [error_record(facts, 502, failure)])
            return _Failed(502, failure, "bad_upstream_answer")
        if upstream.status < 400:
            if self.reuse is not None:
                heard = heard or upstream.headers.get(REUSE_HEADER)
                self.reuse.answered(facts.request, endpoint, heard)
            return upstream
        content = await self._body(upstream, facts, started, rollout_id, attempt_id)
        if isinstance(content, _Failed):
            return content
        facts.latency_s = time.perf_counter() - started
        text = content.decode(errors="replace")
        await self._record(rollout_id, attempt_id, [error_record(facts, upstream.status, text)])
        return _Failed(
            upstream.status,
            _error_message(text),
            "upstream_error",
            content,
            media or None,
            read_overflow(upstream.status, text),
            _retry_headers(upstream),
        )

    async def _json_answer(
        self,
        upstream: Upstream,
        facts: CallFacts,
        started: float,
        rollout_id: str,
        attempt_id: int,
    ) -> dict[str, Any] | _Failed:
        """The engine's 200 answer; one that is no answer is recorded and returned as failed."""
        content = await self._body(upstream, facts, started, rollout_id, attempt_id)
        if isinstance(content, _Failed):
            return content
        facts.latency_s = time.perf_counter() - started
        try:
            # The gateway's JSON rule: a NaN logprob (or any value JSON cannot carry) from the
            # engine fails the call, recorded, instead of reaching the store.
            payload = jsonrule.parse(content, loc=())
        except jsonrule.JsonRuleError as refused:
            payload = None if refused.kind == "json_invalid" else refused
        if isinstance(payload, jsonrule.JsonRuleError):
            failure = f"the engine at {facts.endpoint} answered what JSON cannot carry: {payload}"
            await self._record(rollout_id, attempt_id, [error_record(facts, 502, failure)])
            return _Failed(502, failure, "bad_upstream_answer")
        if not isinstance(payload, dict):
            failure = f"the engine at {facts.endpoint} answered 200 with a body that is not JSON"
            await self._record(rollout_id, attempt_id, [error_record(facts, 502, failure)])
            return _Failed(502, failure, "bad_upstream_answer")
        no_answer = answer_failure(payload, facts)
        if no_answer is not None:
            await self._record(rollout_id, attempt_id, [error_record(facts, 502, no_answer)])
            return _Failed(502, no_answer, "upstream_error")
        return payload

    async def _body(
        self,
        upstream: Upstream,
        facts: CallFacts,
        started: float,
        rollout_id: str,
        attempt_id: int,
    ) -> bytes | _Failed:
        """The engine's body; one that stalls past the read timeout or breaks off after the
        headers is a failed call, recorded (502)."""
        try:
            return await _read_body(upstream)
        except (aiohttp.ClientError, TimeoutError) as error:
            facts.latency_s = time.perf_counter() - started
            failure = f"the engine at {facts.endpoint} broke off its answer: {error!r}"
            await self._record(rollout_id, attempt_id, [error_record(facts, 502, failure)])
            return _Failed(502, failure, "bad_upstream_answer")

    async def _served_name(self, endpoint: str, registered: str) -> str:
        """The name the engine at `endpoint` answers to.

        Harnesses send whatever model name they were configured with, and a model may be
        registered under any name (`policy`); engines refuse names they do not serve. The
        engine's `GET /models` says its name once per endpoint; an engine that lists the
        registered name, lists several, or cannot be asked keeps the registered one.
        """
        known = self.directory.served_names.get(endpoint)
        if known is not None:
            return known
        name = registered
        try:
            async with self.http.get(
                endpoint.rstrip("/") + "/models", timeout=aiohttp.ClientTimeout(total=10)
            ) as response:
                listed = await response.json(content_type=None) if response.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return registered  # not remembered: asked again on the next call
        data = listed.get("data") if isinstance(listed, dict) else None
        ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if registered not in ids and len(ids) == 1 and isinstance(ids[0], str):
            name = ids[0]
        self.directory.served_names[endpoint] = name
        return name

    async def _reuse_vllm(
        self, target: Target, sent: dict[str, Any], request: dict[str, Any]
    ) -> tuple[ReusedAnswer | None, str | None]:
        """A reused call answered through vLLM's render/generate/derender routes, or None and
        what to tell `TokenReuse.answered` (`fallback`, `none`; None: the engine lacks them)."""
        endpoint = target.endpoints[0]
        prefix = sent.pop(PREFIX_FIELD).tolist()  # an int32 array (`ReuseMemory.prefix_for`)
        name = await self._served_name(endpoint, target.model.model)
        asked = bool(request.get("logprobs")) or bool(request.get("top_logprobs"))
        answer = await self.vllm_reuse.answer(endpoint, name, sent, prefix, shows_logprobs=asked)
        if isinstance(answer, ReusedAnswer):
            return answer, "reused"
        return None, None if answer == "unsupported" else answer

    async def _release_stream(self, upstream: Upstream, request: dict[str, Any]) -> None:
        self._ended(request)
        upstream.release()
        self.gate.exit()

    def _ended(self, request: dict[str, Any]) -> None:
        """The call of `request` is over: token reuse forgets it if it was not recorded."""
        if self.reuse is not None:
            self.reuse.ended(request)

    async def _send(
        self, kind: Kind, target: Target, sent: dict[str, Any]
    ) -> tuple[EngineResponse | None, str, str]:
        """Sends with retries on transport errors; (response, endpoint, last failure).

        The response's body is not read yet, so a stream can be relayed as it comes.

        Retried (backoff, next endpoint): an engine that could not be connected to, or that
        closed the connection before answering; either way it is not generating this call, so a
        retry duplicates no work. Not retried: an engine that took the request and did not
        answer within the read timeout, which may still be generating it (a retry would run the
        generation again, and wait as long again).
        """
        failure = ""
        endpoints = list(target.endpoints)
        endpoint = endpoints[0]
        payloads: dict[str, bytes] = {}
        attempt = 0
        while attempt <= self.retries:
            endpoint = endpoints[attempt % len(endpoints)]
            name = await self._served_name(endpoint, target.model.model)
            if name not in payloads:
                # The token reuse prefix is an int32 array (`ReuseMemory.prefix_for`).
                payloads[name] = orjson.dumps(
                    {**sent, "model": name}, option=orjson.OPT_SERIALIZE_NUMPY
                )
            try:
                response = await self.engines.post(
                    endpoint.rstrip("/") + _PATHS[kind], payloads[name], _JSON
                )
                return response, endpoint, ""
            except aiohttp.ConnectionTimeoutError as error:  # a TimeoutError, never connected
                failure = f"the engine at {endpoint} could not be reached: {error!r}"
            except TimeoutError:
                waited = self.read_timeout_s
                failure = (
                    f"the engine at {endpoint} did not answer within {waited:g} s (the gateway's "
                    "REINS_PROXY_READ_TIMEOUT_S); not retried, as it may still be generating the "
                    "call"
                )
                return None, endpoint, failure
            except aiohttp.ClientConnectionError as error:
                failure = (
                    f"the engine at {endpoint} could not be reached or closed the connection "
                    f"before answering: {error!r}"
                )
            except aiohttp.InvalidURL:
                # A registered endpoint no request can go to (port 99999, `http://[::1/v1`):
                # not a try of the call; the model's other endpoints are tried at once.
                failure = (
                    f"the engine's endpoint {endpoint} is not a URL a request can be sent to; "
                    "register the model with a valid one (POST /api/models)"
                )
                endpoints.remove(endpoint)
                if not endpoints:
                    break
                continue
            if attempt < self.retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
            attempt += 1
        return None, endpoint, failure

    def _relay(
        self,
        upstream: Upstream,
        facts: CallFacts,
        started: float,
        rollout_id: str,
        attempt_id: int,
    ) -> _StreamedCall:
        """Passes the engine's SSE events on as they come, recording the whole call (or, when
        the harness leaves first, the call as abandoned: `_StreamedCall.settle`)."""
        call = _StreamedCall(upstream, StreamRecorder(facts))
        call.chunks = self._relay_chunks(call, facts, started, rollout_id, attempt_id)
        call.abandon = lambda: self._abandon(call, facts, started, rollout_id, attempt_id)
        call.fail = lambda failure: self._fail(
            call, facts, started, rollout_id, attempt_id, failure
        )
        return call

    async def _relay_chunks(
        self,
        call: _StreamedCall,
        facts: CallFacts,
        started: float,
        rollout_id: str,
        attempt_id: int,
    ) -> AsyncGenerator[bytes, None]:
        done_line: bytes | None = None
        try:
            async for line in _lines(call.upstream):
                if not line.startswith("data:"):
                    if line:
                        yield (line + "\n").encode()
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done_line = b"data: [DONE]\n\n"
                    continue
                if not data:  # no chunk: dropped, as the openai SDK fails on an empty `data:`
                    continue
                try:
                    chunk = jsonrule.parse(data, loc=())
                except jsonrule.JsonRuleError as refused:
                    chunk = None if refused.kind == "json_invalid" else refused
                if isinstance(chunk, jsonrule.JsonRuleError):
                    # A chunk JSON cannot carry (a NaN logprob): the call fails, recorded.
                    failure = f"the engine sent a stream chunk JSON cannot carry: {chunk}"
                    yield await self._stream_failure(
                        call, facts, started, rollout_id, attempt_id, failure
                    )
                    return
                if not isinstance(chunk, dict):
                    # No chunk of the API: the harness's SDK fails on it (the openai SDK raises
                    # on a line that is not JSON), so the call failed, as in the other wire
                    # APIs. Passed on, it was recorded as a trainable answer.
                    failure = (
                        f"the engine sent a stream line that is not a JSON object: {data[:200]}"
                    )
                    yield await self._stream_failure(
                        call, facts, started, rollout_id, attempt_id, failure
                    )
                    return
                try:
                    call.recorder.feed(chunk)  # copies what it keeps: stripping is safe
                    engine_error = call.recorder.error
                    if engine_error is None:
                        chunk = strip_for_harness(chunk, facts.request, facts.kind)
                except Exception as error:
                    engine_error = _unreadable(facts, error)
                if engine_error is not None:  # its error chunk, or one that could not be read
                    # Recorded before the harness hears of it: it stops reading there.
                    yield await self._stream_failure(
                        call, facts, started, rollout_id, attempt_id, engine_error
                    )
                    return
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        except (aiohttp.ClientError, TimeoutError) as error:
            failure = f"the engine's stream broke off: {error!r}"
            yield await self._stream_failure(call, facts, started, rollout_id, attempt_id, failure)
            return
        finally:
            call.end_upstream()
        call.recorder.end()
        if call.recorder.error is not None:  # no choices, or one left unfinished
            yield await self._stream_failure(
                call, facts, started, rollout_id, attempt_id, call.recorder.error
            )
            return
        facts.latency_s = time.perf_counter() - started
        # Recorded before the stream ends, so a finished call is always a recorded call.
        call.recorded = True
        try:
            await self._record(rollout_id, attempt_id, call.recorder.records())
        except Conflict as closed:
            message = f"{closed}; this answer was not recorded"
            refusal = {"error": {"message": message, "type": "conflict", "code": 409}}
            yield b"data: " + json.dumps(refusal).encode() + b"\n\n"
            return
        except OUTAGES as outage:
            # The stream has begun: its end says why, in place of a connection cut mid-stream.
            unstored = {"error": {"message": _unstored(outage), "type": "unavailable", "code": 503}}
            yield b"data: " + json.dumps(unstored).encode() + b"\n\n"
            return
        except UnrecordableAnswer as failed:
            bad = {"error": {"message": str(failed), "type": "bad_upstream_answer", "code": 502}}
            yield b"data: " + json.dumps(bad).encode() + b"\n\n"
            return
        if done_line is not None:
            yield done_line

    async def _stream_failure(
        self,
        call: _StreamedCall,
        facts: CallFacts,
        started: float,
        rollout_id: str,
        attempt_id: int,
        failure: str,
    ) -> bytes:
        """Records a chat stream that failed midway (502) and returns the error event."""
        await self._fail(call, facts, started, rollout_id, attempt_id, failure)
        error = {"message": failure, "type": "bad_upstream_answer", "code": 502}
        return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"

    def _relay_wire(
        self,
        upstream: Upstream,
        translation: Translation,
        facts: CallFacts,
        started: float,
        rollout_id: str,
        attempt_id: int,
    ) -> _StreamedCall:
        """The engine's chat stream, recorded as it comes and passed on as the harness's API
        events; the call is recorded before the closing events are sent (or as abandoned when
        the harness leaves first)."""
        call = _StreamedCall(upstream, StreamRecorder(facts))
        call.chunks = self._relay_wire_chunks(
            call, translation, facts, started, rollout_id, attempt_id
        )
        call.abandon = lambda: self._abandon(call, facts, started, rollout_id, attempt_id)
        call.fail = lambda failure: self._fail(
            call, facts, started, rollout_id, attempt_id, failure
        )
        return call

    async def _relay_wire_chunks(
        self,
        call: _StreamedCall,
        translation: Translation,
        facts: CallFacts,
        started: float,
        rollout_id: str,
        attempt_id: int,
    ) -> AsyncGenerator[bytes, None]:
        try:
            async for line in _lines(call.upstream):
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                try:
                    chunk = jsonrule.parse(data, loc=())
                except jsonrule.JsonRuleError as refused:
                    chunk = None if refused.kind == "json_invalid" else refused
                if isinstance(chunk, jsonrule.JsonRuleError):
                    problem = f"the engine sent a stream chunk JSON cannot carry: {chunk}"
                    chunk = {"error": {"message": problem}}
                elif not isinstance(chunk, dict):
                    problem = f"the engine sent a stream line that is not JSON: {data[:200]}"
                    chunk = {"error": {"message": problem}}
                try:
                    call.recorder.feed(chunk)
                    events = (
                        [] if call.recorder.error is not None else translation.stream_events(chunk)
                    )
                except Exception as error:
                    call.recorder.fail(_unreadable(facts, error))
                if call.recorder.error is not None:
                    break  # the engine's error chunk, or one it could not read: told below
                for event in events:
                    yield event
        except (aiohttp.ClientError, TimeoutError) as error:
            call.recorder.fail(f"the engine's stream broke off: {error!r}")
        finally:
            call.end_upstream()
        call.recorder.end()  # keeps the first reason when the stream failed already
        failure = call.recorder.error
        # A failure is told in the API's shape, but only once it is recorded: the harness stops
        # reading at it (built now, as the failed answer is assembled from it).
        told = (
            []
            if failure is None
            else list(translation.stream_events({"error": {"message": failure}}))
        )
        closing = translation.stream_end()
        facts.latency_s = time.perf_counter() - started
        records = call.recorder.records()  # a failed call's one record, when it failed
        answer = translation.assembled()
        for record in records:
            record.response = answer
        # Recorded before the stream ends, so a finished call is always a recorded call.
        call.recorded = True
        try:
            await self._record(rollout_id, attempt_id, records)
        except Conflict as closed:
            if failure is not None:
                for event in told:  # it failed either way: nothing was recorded
                    yield event
                return
            # The closing events (built above, to assemble the answer) are not sent.
            for event in translation.stream_refusal(f"{closed}; this answer was not recorded"):
                yield event
            return
        except OUTAGES as outage:
            for event in translation.stream_refusal(_unstored(outage), 503):
                yield event
            return
        except UnrecordableAnswer as failed:
            for event in translation.stream_refusal(str(failed), 502):
                yield event
            return
        for event in [*told, *closing]:
            yield event

    async def _abandon(
        self,
        call: _StreamedCall,
        facts: CallFacts,
        started: float,
        rollout_id: str,
        attempt_id: int,
    ) -> None:
        """Records a stream whose harness left before its end: abandoned, with what it was sent
        (a wire API's partial answer is not assembled: its `response` stays empty)."""
        facts.latency_s = time.perf_counter() - started
        records = abandoned_records(facts, call.recorder.records())
        if facts.api is not None:
            for record in records:
                record.response = {}
        await self._record_unheard(rollout_id, attempt_id, records)

    async def _fail(
        self,
        call: _StreamedCall,
        facts: CallFacts,
        started: float,
        rollout_id: str,
        attempt_id: int,
        failure: str,
    ) -> None:
        """Records a stream whose relay failed (`_StreamedCall.failure`): a 502 with what the
        engine had sent, or the failure alone if that cannot be read either."""
        facts.latency_s = time.perf_counter() - started
        call.recorded = True
        try:
            call.recorder.fail(failure)
            records = call.recorder.records()
        except Exception:
            records = [error_record(facts, 502, failure)]
        if facts.api is not None:
            for record in records:
                record.response = {}
        await self._record_unheard(rollout_id, attempt_id, records)

    async def unless_abandoned(
        self,
        receive: Receive,
        work: Coroutine[Any, Any, Response],
        *,
        rollout_id: str,
        attempt_id: int,
        mode: str,
        body: dict[str, Any],
        wire: WireApi | None = None,
    ) -> Response:
        """`work` (this call's `forward` or `forward_wire`), cancelled when the harness hangs up
        or times out first: waiting at the admission gate, or for a non-streamed answer. The
        engine's connection is closed with it, so the engine cancels the generation (the
        embedded engine and vLLM both abort a request whose client left), and the call is
        recorded as abandoned, not as the full answer nobody received. A stream the harness
        leaves is handled by `_ReleasingStream`.

        A call whose attempt closed while it ran (its rollout ended, or a retry superseded it)
        is answered 409, in the API's error shape, and not recorded (`_record`)."""
        recording = _Recording()
        context = _RECORDING.set(recording)  # the work's task starts with it: `_record` marks it
        try:
            result = await unless_client_leaves(receive, work)
        except Conflict as closed:
            message = f"{closed}; this call's answer was not recorded and is not returned"
            # The attempt stays closed: the SDKs' retry of a 409 cannot succeed (as at the door,
            # `routes.proxy.forward_call`).
            no_retry = {"x-should-retry": "false"}
            if wire is not None:
                return JSONResponse(wire.error_body(409, message), 409, headers=no_retry)
            return openai_error(409, message, "invalid_request_error", headers=no_retry)
        except UnrecordableAnswer as failed:
            if wire is not None:
                return JSONResponse(wire.error_body(502, str(failed)), 502)
            return openai_error(502, str(failed), "bad_upstream_answer")
        finally:
            _RECORDING.reset(context)
        if not isinstance(result, ClientLeft):
            return result
        if recording.started:
            # The client left while the call's record was written: cancelling the wait for
            # the commit does not stop the write, and the call stands recorded as it was (a
            # stream whose client leaves then is too); one more record would double it.
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        target = await self.directory.target(body.get("model"), rollout_id)
        facts = CallFacts(
            kind="completions" if wire is None and "prompt" in body else "chat",
            mode=mode,
            request=body,
            model=target.model.model if target else str(body.get("model")),
            endpoint=target.endpoints[0] if target else "",
            model_version=target.model.weight_version if target else None,
            latency_s=result.after_s,
            stream=body.get("stream") is True,
            api=None if wire is None else wire.KIND,
        )
        await self._record_unheard(rollout_id, attempt_id, abandoned_records(facts, []))
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it

    async def _record(self, rollout_id: str, attempt_id: int, records: list[ModelRequest]) -> None:
        if not records:
            return
        recording = _RECORDING.get()
        if recording is not None:
            recording.started = True
        if self.reuse is not None:
            self.reuse.recorded(records)
        events = [
            EventIn.model_construct(
                type=MODEL_REQUEST,
                data=_record_data(record),
                idempotency_key=call_key(),
            )
            for record in records
        ]
        # Checked as the harness's own event posts are: a call still in flight when its rollout
        # ended (or its attempt was superseded) is not appended after the trainer may have read
        # the rollout. `Conflict` reaches `unless_abandoned`, which answers 409; a stream ends
        # with an error event instead of its last events.
        try:
            await self.store.record_calls(rollout_id, attempt_id, events)
        except Invalid as refused:
            # The harness's request passed the same rule at the door (`guards`): what broke it is
            # the answer as converted for the harness. Recorded as a failed call, answered 502,
            # never a 400 for the harness's request nor a stream cut short.
            message = f"the engine's answer cannot be recorded: {refused}"
            failed = [_failed_record(record, message) for record in records]
            await self.store.record_calls(
                rollout_id,
                attempt_id,
                [
                    event.model_copy(update={"data": _record_data(f)})
                    for event, f in zip(events, failed, strict=True)
                ],
            )
            self._observe(failed)
            raise UnrecordableAnswer(message) from refused
        self._observe(records)

    async def _record_unheard(
        self, rollout_id: str, attempt_id: int, records: list[ModelRequest]
    ) -> None:
        """Records a call whose outcome nobody can be told of any more (its harness left, or its
        stream is cut or ends in an error event already): an attempt closed meanwhile adds
        nothing, and a store that fails the write is logged rather than raised, so the call's
        admission slot and engine connection are still given back."""
        try:
            await self._record(rollout_id, attempt_id, records)
        except Conflict:
            pass
        except _NOT_STORED as failure:
            first = str(failure).splitlines()[0] if str(failure) else repr(failure)
            log.warning("a call of rollout %s could not be recorded: %s", rollout_id, first)

    def _observe(self, records: list[ModelRequest]) -> None:
        """The metrics count calls as recorded: not a call whose attempt closed (409) or whose
        store was down, nor an answer its record could not hold as it was."""
        if self.on_record is not None:
            for record in records:
                self.on_record(record)


def _unreadable(facts: CallFacts, error: Exception) -> str:
    """Why a call failed that the gateway could not read or translate (a defect of the gateway,
    or an engine answering out of its API): logged with the traceback, recorded as a 502."""
    log.exception("the answer from %s could not be read", facts.endpoint)
    return (
        f"the gateway could not read the engine's answer ({type(error).__name__}: "
        f"{str(error)[:300]}); the gateway's log has the traceback"
    )


def _failed_record(record: ModelRequest, message: str) -> ModelRequest:
    """`record` as a failed call's (`capture.error_record`): the request, no answer."""
    update: dict[str, Any] = {
        "response": {},
        "prompt_token_ids": [],
        "response_token_ids": [],
        "response_logprobs": None,
        "finish_reason": None,
        "status": 502,
        "error": message[:10_000],
    }
    return record.model_copy(update=update)


def _unstored(outage: Exception) -> str:
    first = str(outage).splitlines()[0] if str(outage) else repr(outage)
    return (
        f"the gateway could not store this call's record ({first}); the answer is not "
        "acknowledged: retry the call once the gateway's database is back"
    )


_TOKEN_FIELDS = ("prompt_token_ids", "response_token_ids")


def call_key() -> str:
    """A recorded call's idempotency key: what its retried append (the call journal's replay,
    a store write retried after a lost answer) is known by, within its attempt. 72 random bits
    in 12 characters: the key is stored in the call's row and again in the key index, with the
    rollout's id, so each character costs two bytes a call (a uuid's 37 cost ~0.02x of the
    final sequence's bytes, `benchmarks/records.py`); two calls of one attempt share one with a
    chance of about n^2 / 2^73 (1e-16 for 1,000 calls)."""
    return secrets.token_urlsafe(9)


def _record_data(record: ModelRequest) -> dict[str, Any]:
    """The record as its event's data (`model_dump`, in its key order), but with its token ID
    lists as they are: copied, a `CheckedTokenIds` would lose the array made when the call was
    recorded (`reins.gateway.capture`), which the token reuse memory and the store's packing
    take instead of making it again. Nothing changes a record's token IDs once recorded."""
    rest = record.model_dump(exclude=set(_TOKEN_FIELDS))
    return {name: getattr(record, name) for name in _TOKEN_FIELDS} | rest


def _retry_headers(upstream: Upstream) -> dict[str, str] | None:
    """The engine's `RETRY_HEADERS` that it answered (None: none)."""
    kept = {name: upstream.headers.get(name) for name in RETRY_HEADERS}
    return {name: value for name, value in kept.items() if value is not None} or None


def _weight_version(upstream: Upstream, registered: int) -> int:
    """The engine's own word on its weights (the embedded engine sends it), else the registry's."""
    header = upstream.headers.get(WEIGHT_VERSION_HEADER)
    return int(header) if header and header.isdigit() else registered


async def _read_body(upstream: Upstream) -> bytes:
    try:
        return await upstream.read()
    finally:
        upstream.release()


async def _lines(upstream: Upstream) -> AsyncIterator[str]:
    """The body's lines, however long: an SSE chunk carrying a long prompt's token IDs can be
    far over aiohttp's own line limit. A byte that is not UTF-8 (an engine's text cut inside a
    character) becomes U+FFFD: decoded strictly, it cut the relay (a recorded 502) and lost an
    answer that was otherwise whole. The harness is sent UTF-8 either way."""
    pending = b""
    async for data in upstream.content.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode(errors="replace")
    if pending:
        yield pending.rstrip(b"\r").decode(errors="replace")


class _StreamedCall:
    """A stream being relayed: its chunks (an async generator), what was recorded of it, and
    how it is recorded when the harness leaves before its end (`settle`)."""

    def __init__(self, upstream: Upstream, recorder: StreamRecorder) -> None:
        self.upstream = upstream
        self.recorder = recorder
        self.chunks: AsyncGenerator[bytes, None] | None = None
        self.abandon: Callable[[], Awaitable[None]] | None = None
        self.fail: Callable[[str], Awaitable[None]] | None = None
        self.recorded = False
        """Set when the relay records the call (answered or failed); else it was abandoned,
        or the relay itself failed (`failure`)."""
        self.failure: str | None = None

    def __aiter__(self) -> _StreamedCall:
        return self

    async def __anext__(self) -> bytes:
        assert self.chunks is not None
        try:
            return await self.chunks.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as error:
            # The stream is cut (its events may be half sent); the call is recorded as failed,
            # not as a harness that left (`settle`).
            log.exception("relaying a stream failed")
            self.failure = (
                f"the gateway failed while relaying the engine's stream ({type(error).__name__}: "
                f"{str(error)[:300]}); the gateway's log has the traceback"
            )
            raise

    def end_upstream(self) -> None:
        """The engine's response is done with: released when the stream ended, else closed, so
        the engine sees its client leave and cancels the generation."""
        if self.upstream.content.at_eof():
            self.upstream.release()
        else:
            self.upstream.close()

    async def settle(self) -> None:
        """After the response, however it ended: closes the relay (and the engine's response)
        and records the call as abandoned if the relay did not record it. Shielded: it runs
        while Starlette cancels the stream of a client that left."""
        with anyio.CancelScope(shield=True):
            if self.chunks is not None:
                await self.chunks.aclose()
            self.end_upstream()
            if self.recorded:
                return
            self.recorded = True
            if self.failure is not None and self.fail is not None:
                await self.fail(self.failure)
            elif self.abandon is not None:
                await self.abandon()


class _ReleasingStream(StreamingResponse):
    """A streamed answer that releases its admission slot however the response ends, and has a
    relayed call (`_StreamedCall`) recorded as abandoned when the harness left before the end.

    Starlette always calls the response it got from the route, also when the client has gone;
    the stream's own generator may never start, so it cannot be the one to release.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        release: Callable[[], Awaitable[None]],
        media_type: str,
    ) -> None:
        super().__init__(content, media_type=media_type)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                if isinstance(self.body_iterator, _StreamedCall):
                    await self.body_iterator.settle()
            finally:
                await self._release()  # whatever settling met: a kept slot holds every drain
