"""The embedded engine's OpenAI-compatible HTTP API: `/v1/models`, `/v1/chat/completions`,
`/v1/completions`, streamed or not.

Answers carry the fields vLLM returns with `return_token_ids` and `logprobs` (top-level
`prompt_token_ids` for chat, per-choice for completions; per-choice `token_ids`; logprobs of the
sampled tokens), so the gateway's proxy reads both engines the same way, and the header
`x-reins-weight-version` with the version of the weights each request's prefill ran with (the
oldest of its choices'), known once each choice has sampled its first token. The token IDs
are always returned (the proxy removes what the harness did not ask for), and the most likely
alternatives at each position when asked (chat's `top_logprobs`, completions' `logprobs`), from
the distribution whose logprob the sampled token reports.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from reins.disconnect import CLIENT_CLOSED_REQUEST, ClientLeft, unless_client_leaves
from reins.engine.chat import (
    ChatRequestError,
    PrefixDecoder,
    ResponseRules,
    SampledTurns,
    Settled,
    extend_prompt,
    parse_tool_calls,
    prepare_messages,
    settle,
    shown_content,
    template_knows_tools,
)
from reins.engine.constraint import ConstraintError, format_grammar, response_grammar
from reins.engine.embedded import EmbeddedEngine, Token, WeightVersionError
from reins.engine.metrics import CONTENT_TYPE, engine_metrics, render
from reins.engine.sampling import Alternatives, SamplingParams
from reins.engine.scheduler import RequestFault, ShuttingDown
from reins.httpjson import JSONResponse

WEIGHT_VERSION_HEADER = "x-reins-weight-version"
TOKEN_REUSE_HEADER = "x-reins-token-reuse"
"""On a chat answer to a request with `reins_prefix_token_ids`: `reused` (the prompt starts with
those tokens) or `fallback` (the messages' rendering does not start with their text)."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    """vLLM's: tokens less likely than this times the most likely one are not sampled."""
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int | None = Field(default=None, ge=0)
    """vLLM's: end of sequence and the stop tokens are held back until this many tokens."""
    stop: str | list[str] | None = None
    include_stop_str_in_output: StrictBool = False
    """vLLM's: the answer goes on through the stop string that ended it (to the end of the
    token that completes it), where it stops before it by default."""
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    """What a generator's seed can be (negative ones count from 2**64)."""
    n: int = Field(default=1, ge=1, le=16)
    logit_bias: dict[str, float] | None = None
    """Token ID (as a string, JSON's keys) -> a bias from -100 to 100 added to its logit."""
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """vLLM's: the logits of the prompt's and the response's tokens are divided by it when
    positive, multiplied when not (above 1: repeating is less likely; 1: off)."""
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    response_format: Any = None
    """Structured output (`constraint.py`): `{"type": "json_object"}`, or `json_schema`."""
    structured_outputs: Any = None
    """vLLM's structured output field (`json`, `regex`, `choice`, `grammar`, `json_object`)."""

    return_tokens_as_token_ids: StrictBool = False
    """vLLM's: logprobs name each token `token_id:N` (its ID) instead of its text."""
    stop_token_ids: list[StrictInt] | None = None
    """vLLM's: more tokens that end the response when sampled (not shown in it, and named as
    its `stop_reason`), as the tokenizer's special tokens end it."""

    @model_validator(mode="before")
    @classmethod
    def _guided_is_structured_outputs(cls, body: Any) -> Any:
        """vLLM's older fields (`guided_json`, `guided_regex`, `guided_choice`,
        `guided_grammar`, `structural_tag`) are its `structured_outputs` of that kind: read as
        such (ignored, they left the answer unconstrained)."""
        if not isinstance(body, dict):
            return body
        given = [name for name in GUIDED if body.get(name) is not None]
        if not given:
            return body
        others = [name for name in ("structured_outputs", "response_format") if body.get(name)]
        if len(given) > 1 or others:
            named = [f"`{name}`" for name in [*given, *others]]
            raise ValueError(
                f"give one structured-output constraint, not {' and '.join(named)} together"
            )
        (name,) = given
        value = body[name]
        if name == "guided_json" and isinstance(value, str):  # vLLM takes the schema as text too
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"`guided_json` is not a JSON schema: {error}") from error
        return {
            **{key: item for key, item in body.items() if key != name},
            "structured_outputs": {GUIDED[name]: value},
        }

    @model_validator(mode="after")
    def _nothing_asked_that_is_not_done(self) -> Any:
        """A field of vLLM's or OpenAI's that would change the answer, which this engine does
        not implement, is refused, naming it: accepted and ignored, the client took the answer
        for one that honoured it (fields that change nothing, such as `user`, are taken)."""
        extra = self.model_extra or {}
        for name, why in NOT_IMPLEMENTED.items():
            value = extra.get(name)
            if value is None or value is False or value == [] or value == {}:
                continue
            if name == "best_of" and value in (1, self.n):  # as many sampled as returned
                continue
            if name == "modalities" and value == ["text"]:
                continue
            raise ValueError(f"`{name}` is not supported by this engine: {why}")
        if (self.stream_options or {}).get("continuous_usage_stats"):
            raise ValueError(
                "`stream_options.continuous_usage_stats` is not supported by this engine: "
                "usage comes once, in the last chunk (`include_usage`)"
            )
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Any:
        """As vLLM and OpenAI refuse them (an empty object passes, as in vLLM)."""
        if self.stream_options and not self.stream:
            raise ValueError("`stream_options` can only be set with `stream: true`")
        return self

    @field_validator("n", mode="before")
    @classmethod
    def _null_n_is_one(cls, value: Any) -> Any:
        """`n: null` is the default, one choice, as OpenAI and vLLM take it (the openai SDK
        sends `n=None` as null)."""
        return 1 if value is None else value


GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
}
"""vLLM's older structured-output fields, and the kind of `structured_outputs` each one is."""

NOT_IMPLEMENTED = {
    "best_of": "it returns every choice it samples (`n` of them) and cannot keep the best",
    "use_beam_search": "it samples, it does not search beams",
    "prompt_logprobs": "it scores only the tokens it samples, not the prompt's",
    "echo": "the answer does not repeat the prompt",
    "ignore_eos": "the end of sequence always ends the answer",
    "bad_words": "give the tokens to avoid as `logit_bias` (-100)",
    "allowed_token_ids": "give a constraint as `structured_outputs` or `response_format`",
    "logits_processors": "no processor of the request's own runs",
    "truncate_prompt_tokens": "the prompt is taken whole (a prompt too long is a 400)",
    "guided_whitespace_pattern": "JSON may hold any whitespace between its tokens",
    "prompt_embeds": "the prompt is text or token IDs",
    "documents": "the chat template gets the messages and tools only",
    "modalities": "it answers in text only",
    "audio": "it answers in text only",
    "web_search_options": "it searches nothing",
}
"""Request fields (vLLM's and OpenAI's) that would change the answer, and why each is refused:
a value that asks for something (not null, false or empty)."""


class ChatRequest(_Request):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    """False: one tool call at most (the first `</tool_call>` ends the answer), as OpenAI and
    vLLM answer; null or true: as many as the model writes."""
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    """The most likely tokens listed at each position, most likely first (OpenAI's bounds)."""
    add_generation_prompt: bool = True
    """vLLM's: the template's header of a new assistant turn ends the prompt."""
    continue_final_message: bool = False
    """vLLM's: the prompt ends inside the last message (an assistant's prefill), whose text the
    answer continues; it needs `add_generation_prompt: false`, as vLLM checks."""
    add_special_tokens: StrictBool = False
    """vLLM's: the tokenizer's special tokens (a BOS) added around the rendered prompt (the
    template writes its own, so false by default, as in vLLM)."""
    chat_template: Any = None
    """vLLM's template of the request's own: refused, as vLLM refuses it unless started with
    `--trust-request-chat-template` (taken and ignored, it rendered another prompt than asked)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: more variables for the chat template (`{"enable_thinking": false}` for Qwen3)."""
    reins_prefix_token_ids: list[StrictInt] | None = None
    """Token reuse (the gateway's `token_reuse`): an earlier call's prompt and response IDs; when
    the messages' rendering starts with their text, the prompt is those IDs + the tokens of the
    rest (`chat.extend_prompt`), else the rendering as usual."""

    @model_validator(mode="after")
    def _no_legacy_functions(self) -> ChatRequest:
        """OpenAI's deprecated `functions` / `function_call`: refused, not ignored (ignored, the
        model answered without the functions, in text, as if none were offered)."""
        legacy = [
            name for name in ("functions", "function_call") if name in (self.model_extra or {})
        ]
        if legacy:
            raise ValueError(
                f"{' and '.join(f'`{name}`' for name in legacy)} (OpenAI's deprecated fields) are "
                "not supported: give the functions as `tools` "
                '([{"type": "function", "function": {...}}]) and `function_call` as `tool_choice`'
            )
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs: true`")
        return self

    @model_validator(mode="after")
    def _one_way_to_end_the_prompt(self) -> ChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "`continue_final_message: true` needs `add_generation_prompt: false` (as vLLM "
                "checks): the prompt either continues the last message or opens a new turn"
            )
        return self

    @field_validator("chat_template")
    @classmethod
    def _no_template_of_its_own(cls, template: Any) -> Any:
        if template is not None:
            raise ValueError(
                "a chat template of the request's own is not taken (vLLM refuses one too unless "
                "started with --trust-request-chat-template): the engine renders with its "
                "model's template; give template variables in `chat_template_kwargs`"
            )
        return template

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, variables: dict[str, Any] | None) -> Any:
        """The template's own variables, not the renderer's arguments (`tokenize`, `tools`...),
        which the engine sets itself (two of them are fields of their own)."""
        for name in variables or {}:
            if name in RENDER_ARGUMENTS:
                raise ValueError(
                    f"`chat_template_kwargs` may not set {name!r}, which the engine sets itself"
                    + (" (give it as a field of the request)" if name in cls.model_fields else "")
                )
        return variables

    @field_validator("add_generation_prompt", "continue_final_message", mode="before")
    @classmethod
    def _json_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        """True or false only: pydantic's lax mode read `"no"` or `0` as a boolean."""
        if not isinstance(value, bool):
            raise ValueError(f"`{info.field_name}` must be true or false (a JSON boolean)")
        return value

    @field_validator("tools")
    @classmethod
    def _tools_are_functions(cls, tools: list[dict[str, Any]] | None) -> Any:
        """Each tool is `{"type": "function", "function": {"name": ...}}`, as OpenAI checks."""
        for index, tool in enumerate(tools or []):
            function = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(function, dict):
                raise ValueError(
                    f'tools[{index}] must be {{"type": "function", "function": {{...}}}}'
                )
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"tools[{index}].function needs a `name` (a non-empty string)")
        return tools


RENDER_ARGUMENTS = frozenset(
    {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt"}
    | {"continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation"}
    | {"max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask"}
    | {"tokenizer_kwargs"}
)
"""`apply_chat_template`'s own arguments (and `messages`, the conversation's name in the
template): a request's `chat_template_kwargs` cannot set them."""


class CompletionRequest(_Request):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    """Token IDs are integers only: pydantic's lax mode would read `true` or `1.0` as an ID."""
    logprobs: int | None = Field(default=None, ge=0, le=20)
    """The most likely tokens listed at each position, with the sampled one (OpenAI's legacy
    API: up to `logprobs + 1` of them)."""
    echo: bool | None = False
    suffix: str | None = None
    """OpenAI's text after the completion (insertion): refused, as vLLM refuses it (ignored,
    the answer was a plain continuation that never led into the suffix)."""
    add_special_tokens: StrictBool = True
    """vLLM's: a text prompt gets the tokenizer's special tokens (a BOS, for tokenizers that add
    one), true by default as in vLLM; token-ID prompts are taken as they are."""

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> Any:
        if suffix is not None:
            raise ValueError("`suffix` is not supported (as in vLLM): the answer only continues")
        return suffix


class EngineError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "BadRequestError", code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


def create_engine_app(engine: EmbeddedEngine) -> Starlette:
    """The HTTP API of `engine`. A server of `reins.serving` aborts the engine's requests when
    it starts to shut down (`app.state.before_shutdown`), so that it does not wait for them."""
    api = _Api(engine)
    app = Starlette(
        routes=[
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/health", api.health, methods=["GET"]),
            Route("/metrics", api.metrics, methods=["GET"]),
            Route("/tokenize", api.tokenize, methods=["POST"]),
            Route("/reins/load_weights", api.load_weights, methods=["POST"]),
        ]
    )
    app.state.before_shutdown = engine.abort_all
    return app


def _error(
    status: int, message: str, kind: str = "BadRequestError", code: str | None = None
) -> JSONResponse:
    """vLLM's error shape (its code is the status), or OpenAI's `code` where one is known."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code or status}}
    return JSONResponse(body, status_code=status)


def _failure_kind(error: str) -> tuple[int, str]:
    """A failed generation's status and error type: 400 when the request caused it (its grammar
    cannot be followed: `RequestFault`), else 500."""
    if isinstance(error, RequestFault):
        return 400, "BadRequestError"
    if isinstance(error, ShuttingDown):
        return 503, "ServiceUnavailableError"
    return 500, "InternalServerError"


def _failed(error: str) -> JSONResponse:
    status, kind = _failure_kind(error)
    return _error(status, error, kind)


def _refused(error: EngineError | ChatRequestError | ConstraintError) -> JSONResponse:
    """A request refused: its status and error type (a chat that cannot be rendered is 400)."""
    if isinstance(error, EngineError):
        return _error(error.status, error.message, error.kind, error.code)
    return _error(400, str(error))


class _Api:
    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self.native_tools = template_knows_tools(getattr(engine.tokenizer, "chat_template", None))
        self.sampled = SampledTurns()
        """Tool-call answers, rendered as sampled when a harness sends them back (`chat.py`)."""
        self.stop_token_ids = frozenset(_special_token_ids(engine.tokenizer) - engine.eos_token_ids)
        """Special tokens that end a response when sampled, outside it (`chat.settle`)."""
        self.registry = engine_metrics(engine)

    async def load_weights(self, request: Request) -> Response:
        """`{"path": MODEL_FOLDER, "version": N}`: loads those weights in place, served as
        version N (optional, default the next; never lower than the current one): the trainer
        numbers a fleet's versions alike (`ReloadPublisher`)."""
        try:
            body = await _json(request)
            path = body.get("path") if isinstance(body, dict) else None
            if not isinstance(path, str) or not path:
                raise EngineError(400, 'the body must be {"path": "<a saved model folder>"}')
            version = body.get("version")
            if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
                raise EngineError(400, '"version" must be an integer')
            if version is not None and version < self.engine.weight_version:
                raise EngineError(
                    409,
                    f"weight versions only go up: this engine serves version "
                    f"{self.engine.weight_version}, asked to serve {version}",
                    "ConflictError",
                )
            version = await asyncio.to_thread(self.engine.load_weights, path, version)
        except EngineError as error:
            return _refused(error)
        except WeightVersionError as error:  # a higher version came in while this one read
            return _error(409, str(error), "ConflictError")
        except (OSError, ValueError) as error:
            return _error(400, f"cannot load weights from that folder: {error}")
        except Exception as error:  # the reason in the API's error shape, not a bare 500
            return _error(500, f"loading the weights failed: {error!r}", "InternalServerError")
        return JSONResponse({"weight_version": version})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's `/tokenize`: `{"prompt": TEXT}` or chat `{"messages", "tools"}` rendered as a
        chat call would be; answers `{"count", "max_model_len", "tokens"}`."""
        try:
            body = await _json(request)
            if not isinstance(body, dict):
                raise EngineError(400, "the body must be a JSON object")
            if "messages" in body:
                chat = ChatRequest.model_validate(body)
                tools = chat.tools if chat.tool_choice != "none" else None
                messages = prepare_messages(
                    chat.messages, tools, native_tools=self.native_tools, sampled=self.sampled
                )
                text = self._render_text(messages, tools, chat)
                tokens = self._tokens(text, special=chat.add_special_tokens)
            elif isinstance(body.get("prompt"), str):
                special = body.get("add_special_tokens", True)
                if not isinstance(special, bool):
                    raise EngineError(
                        400, "`add_special_tokens` must be true or false (a JSON boolean)"
                    )
                tokens = self._completion_prompt(body["prompt"], special=special)
            else:
                raise EngineError(400, "send `messages` (a chat) or `prompt` (a string)")
        except ValidationError as error:
            return _error(400, _validation_message(error))
        except (EngineError, ChatRequestError) as error:
            return _refused(error)
        return JSONResponse(
            {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}
        )

    async def health(self, _: Request) -> Response:
        return Response(status_code=200)

    async def metrics(self, _: Request) -> Response:
        """Prometheus text: prompts, prefix-cache hits and reused tokens, batch (`metrics.py`)."""
        return Response(render(self.registry), media_type=CONTENT_TYPE)

    async def models(self, _: Request) -> Response:
        card = {
            "id": self.engine.name,
            "object": "model",
            "created": 0,
            "owned_by": "reins",
            "max_model_len": self.engine.max_model_len,
        }
        # The version too: a trainer starting a run reads which weights a fleet serves.
        headers = {WEIGHT_VERSION_HEADER: str(self.engine.weight_version)}
        return JSONResponse({"object": "list", "data": [card]}, headers=headers)

    async def chat(self, request: Request) -> Response:
        try:
            body = ChatRequest.model_validate(await _json(request))
            self._check_model(body)
            tools = body.tools if body.tool_choice != "none" else None
            messages = prepare_messages(
                body.messages, tools, native_tools=self.native_tools, sampled=self.sampled
            )
            text = self._render_text(messages, tools, body)
            prompt_ids = self._reuse(body.reins_prefix_token_ids, text)
            reused = prompt_ids is not None
            if prompt_ids is None:
                prompt_ids = self._tokens(text, special=body.add_special_tokens)
            parallel = body.parallel_tool_calls is not False
            grammar = response_grammar(
                body.response_format,
                tools,
                body.tool_choice,
                parallel_tool_calls=parallel,
                structured_outputs=body.structured_outputs,
            )
            await self._check(grammar)
            params = self._params(
                body,
                len(prompt_ids),
                tool_calls=bool(tools),
                parallel_tool_calls=parallel,
                grammar=grammar,
            )
        except ValidationError as error:
            return _error(400, _validation_message(error))
        except (EngineError, ChatRequestError, ConstraintError) as error:
            return _refused(error)
        call = _Call(self.engine, "chat", body, prompt_ids, params[0], self.sampled)
        headers = {WEIGHT_VERSION_HEADER: str(call.weight_version)}
        if body.reins_prefix_token_ids is not None:
            headers[TOKEN_REUSE_HEADER] = "reused" if reused else "fallback"
        if body.stream:
            return _ClosingStream(call, call.stream(params), headers)
        return await _unless_client_leaves(request, call.answer(params, headers))

    async def completions(self, request: Request) -> Response:
        try:
            body = CompletionRequest.model_validate(await _json(request))
            self._check_model(body)
            if body.echo:
                raise EngineError(400, "`echo` is not supported by the embedded engine")
            prompt_ids = self._completion_prompt(body.prompt, special=body.add_special_tokens)
            grammar = format_grammar(body.response_format, body.structured_outputs)
            await self._check(grammar)
            params = self._params(body, len(prompt_ids), grammar=grammar)
        except ValidationError as error:
            return _error(400, _validation_message(error))
        except (EngineError, ConstraintError) as error:
            return _refused(error)
        call = _Call(self.engine, "completions", body, prompt_ids, params[0], self.sampled)
        headers = {WEIGHT_VERSION_HEADER: str(call.weight_version)}
        if body.stream:
            return _ClosingStream(call, call.stream(params), headers)
        return await _unless_client_leaves(request, call.answer(params, headers))

    async def _check(self, grammar: str | None) -> None:
        """Raises ConstraintError when `grammar` does not compile (off the event loop: the
        first one builds the tokenizer's index, about a second)."""
        if grammar is not None:
            await asyncio.to_thread(self.engine.grammars.check, grammar)

    def _check_model(self, body: _Request) -> None:
        if body.model is not None and body.model != self.engine.name:
            raise EngineError(
                404,
                f"The model `{body.model}` does not exist; this engine serves "
                f"`{self.engine.name}`.",
                "NotFoundError",
            )

    def _render_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, body: ChatRequest
    ) -> str:
        """The chat template's prompt: ending with a new assistant turn's header, or inside the
        last message (`continue_final_message`, vLLM's prefill), or after it."""
        try:
            return str(
                self.engine.tokenizer.apply_chat_template(
                    messages,
                    tools=tools if self.native_tools else None,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    tokenize=False,
                    **(body.chat_template_kwargs or {}),
                )
            )
        except Exception as error:  # the template's own error (jinja) says what is wrong
            message = f"the chat template cannot render these messages: {error}"
            raise EngineError(400, message) from error

    def _tokens(self, text: str, *, special: bool = False) -> list[int]:
        """`text`'s tokens; with `special`, the tokenizer's special tokens around them (a BOS)."""
        # No unpaired surrogate reaches here (`_json` refuses the body): the tokenizer failed
        # on one with a TypeError (a 500).
        return list(self.engine.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _reuse(self, prefix_ids: list[int] | None, text: str) -> list[int] | None:
        """The prompt continuing `prefix_ids` (token reuse), or None: none asked, or the
        rendered `text` does not start with their text."""
        if prefix_ids is None:
            return None
        vocab = len(self.engine.tokenizer)
        if any(not 0 <= item < vocab for item in prefix_ids):
            raise EngineError(400, f"reins_prefix_token_ids must be in [0, {vocab})")

        def decode(ids: list[int]) -> str:
            return str(
                self.engine.tokenizer.decode(
                    ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
            )

        return extend_prompt(prefix_ids, text, decode, self._tokens)

    def _completion_prompt(
        self, prompt: str | list[int] | list[str] | list[list[int]], *, special: bool
    ) -> list[int]:
        if isinstance(prompt, str):
            return self._tokens(prompt, special=special)
        if prompt and all(isinstance(item, int) for item in prompt):
            vocab = len(self.engine.tokenizer)
            if any(not 0 <= item < vocab for item in prompt):  # type: ignore[operator]
                raise EngineError(400, f"prompt token IDs must be in [0, {vocab})")
            return list(prompt)  # type: ignore[arg-type]
        if isinstance(prompt, list) and len(prompt) == 1:
            return self._completion_prompt(prompt[0], special=special)  # type: ignore[arg-type]
        raise EngineError(400, "`prompt` must be one string or one list of token IDs (no batches)")

    def _params(
        self,
        body: _Request,
        prompt_length: int,
        *,
        tool_calls: bool = False,
        parallel_tool_calls: bool = True,
        grammar: str | None = None,
    ) -> list[SamplingParams]:
        if prompt_length < 1:
            raise EngineError(400, "the prompt is empty: it needs at least one token")
        room = self.engine.max_model_len - prompt_length
        if room < 1:
            raise EngineError(
                400,
                f"This model's maximum context length is {self.engine.max_model_len} tokens; "
                f"the prompt has {prompt_length}.",
                code="context_length_exceeded",  # OpenAI's code: clients compact on it
            )
        # More than the context has room for is served up to the context's end (finish_reason
        # `length`): coding-agent CLIs send max_tokens of 32k-64k whatever the model.
        asked = body.max_completion_tokens or body.max_tokens
        min_tokens = body.min_tokens or 0
        if asked is not None and min_tokens > asked:
            raise EngineError(
                400, f"min_tokens ({min_tokens}) must not be more than max_tokens ({asked})"
            )
        if asked is not None:
            asked = min(asked, room)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        logit_bias = self._logit_bias(body.logit_bias)
        stop_token_ids = self.stop_token_ids | self._stop_token_ids(body.stop_token_ids)
        return [
            SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=max(body.top_k or 0, 0),
                min_p=body.min_p or 0.0,
                max_tokens=asked or room,
                stop=tuple(s for s in stop if s),
                stop_token_ids=stop_token_ids,
                tool_calls=tool_calls,
                parallel_tool_calls=parallel_tool_calls,
                # Wrapped, as the generator wraps negative seeds: the last seed's n choices fit.
                seed=None if body.seed is None else (body.seed + index) % 2**64,
                logit_bias=logit_bias,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if body.repetition_penalty is None else body.repetition_penalty
                ),
                grammar=grammar,
                min_tokens=min_tokens,
                end_token_ids=frozenset(self.engine.eos_token_ids) | stop_token_ids,
                top_logprobs=_alternatives_asked(body),
            )
            for index in range(body.n)
        ]

    def _stop_token_ids(self, ids: list[int] | None) -> frozenset[int]:
        vocab = len(self.engine.tokenizer)
        if any(not 0 <= item < vocab for item in ids or ()):
            raise EngineError(400, f"stop_token_ids must be in [0, {vocab})")
        return frozenset(ids or ())

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's `logit_bias` checked as it checks it: token IDs of the vocabulary, biases
        from -100 to 100."""
        vocab = len(self.engine.tokenizer)
        pairs = []
        for key, value in (bias or {}).items():
            # ASCII digits only: `isdigit` is true of "²", which `int` refuses (a bare 500), and
            # of other scripts' digits, which `int` reads as another token's ID.
            if not (key.isascii() and key.isdigit()) or int(key) >= vocab:
                raise EngineError(
                    400, f"logit_bias: {key!r} is no token ID of this model (0 to {vocab - 1})"
                )
            if not -100 <= value <= 100:
                raise EngineError(400, f"logit_bias: the bias of {key} must be from -100 to 100")
            pairs.append((int(key), value))
        return tuple(pairs)


class _Choice:
    """What one choice has produced so far, and the text it may show."""

    def __init__(self, index: int, decode: Callable[[list[int]], str]) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[Alternatives] = []
        self.text_offsets: list[int] = [0]
        """Completions' `text_offset`: where each token's text starts in `text` (one more: the
        end). A token holding part of a character starts where that character does."""
        self.characters = codecs.getincrementaldecoder("utf-8")(errors="replace")
        """The tokens' bytes so far as characters, for the offsets."""
        self.shown = ""
        self.sent = 0
        """Tokens a stream has sent."""
        self.decode = PrefixDecoder(decode)
        self.finish_reason: str | None = None
        self.cached_tokens = 0


class _Call:
    """One request's choices: collected for an answer, or turned into SSE chunks."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        kind: Literal["chat", "completions"],
        body: ChatRequest | CompletionRequest,
        prompt_ids: list[int],
        params: SamplingParams,
        sampled: SampledTurns,
    ) -> None:
        self.engine = engine
        self.kind = kind
        self.body = body
        self.prompt_ids = prompt_ids
        self.parse_tools = params.tool_calls
        self.rules = ResponseRules(
            params.stop,
            params.stop_token_ids,
            params.tool_calls,
            params.parallel_tool_calls,
            include_stops=body.include_stop_str_in_output,
        )
        self.sampled = sampled
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.arrived_on = engine.weight_version
        self.started_on: dict[int, int] = {}
        """Per choice, the weight version its first token was sampled with."""

    @property
    def weight_version(self) -> int:
        """The `x-reins-weight-version` of the answer: the oldest weights any choice started on
        (its prefill's, not those served when the request arrived: a request that waited for a
        batch slot across a weight update is sampled with the newer ones); until a choice has
        sampled, the version served when the request arrived."""
        return min(self.started_on.values(), default=self.arrived_on)

    def _started(self, token: Token) -> None:
        self.started_on.setdefault(token.index, token.weight_version)

    def settled(self, choice: _Choice, *, final: bool) -> Settled:
        """The choice's response so far: the sampled tokens that are the response, and the text
        they show (`chat.settle`: a stop string, a special token or the end of a tool-call turn
        ends it)."""
        return settle(choice.token_ids, choice.decode, self.rules, final=final)

    def _message(
        self, settled: Settled, finish_reason: str | None
    ) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """A finished chat choice's content, tool calls and finish reason; a tool-call answer
        is remembered so that it is rendered as sampled when the harness sends it back."""
        if not self.parse_tools:
            return settled.text, [], finish_reason
        content, calls = parse_tool_calls(settled.text)
        if not calls:
            return content, [], finish_reason
        self.sampled.remember(settled.text, content, calls)
        # Cut by `max_tokens`, the turn did not end with its calls (a next one may be cut short
        # in the text): `length`, as OpenAI says, so a harness does not take it as finished.
        return content, calls, "length" if finish_reason == "length" else "tool_calls"

    async def answer(self, params: list[SamplingParams], headers: dict[str, str]) -> Response:
        choices = [_Choice(i, self.engine.decode) for i in range(len(params))]
        # Closed on any exit (a cancelled answer, a stream the client left): the generator's
        # `finally` cancels the sequences still running, at once rather than when collected.
        async with contextlib.aclosing(self.engine.generate(self.prompt_ids, params)) as items:
            async for item in items:
                choice = choices[item.index]
                if isinstance(item, Token):
                    self._started(item)
                    choice.token_ids.append(item.token_id)
                    choice.logprobs.append(item.logprob)
                    choice.tops.append(item.top)
                elif item.error is not None:
                    return _failed(item.error)
                else:
                    choice.finish_reason, choice.cached_tokens = item.reason, item.cached_tokens
        usage = self._usage(choices)
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
        return JSONResponse(
            payload, headers={**headers, WEIGHT_VERSION_HEADER: str(self.weight_version)}
        )

    def _usage(self, choices: list[_Choice]) -> dict[str, Any]:
        """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens that every
        choice took from the prefix cache (as OpenAI and vLLM report them). The completion
        tokens are those the choices return, not those sampled past a stop string."""
        completion_tokens = sum(self.settled(c, final=True).count for c in choices)
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(self.prompt_ids) + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": min(c.cached_tokens for c in choices)},
        }

    def _chat_choice(self, choice: _Choice) -> dict[str, Any]:
        settled = self.settled(choice, final=True)
        content, calls, finish_reason = self._message(settled, choice.finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        tokens = choice.token_ids[: settled.count]
        return {
            "index": choice.index,
            "message": message,
            "logprobs": {"content": self._chat_logprobs(choice, 0, settled.count)},
            "finish_reason": finish_reason,
            "stop_reason": settled.stop_reason,
            "token_ids": tokens,
        }

    def _completion_choice(self, choice: _Choice) -> dict[str, Any]:
        settled = self.settled(choice, final=True)
        tokens = choice.token_ids[: settled.count]
        return {
            "index": choice.index,
            "text": settled.text,
            "logprobs": self._completion_logprobs(choice, 0, settled.count),
            "finish_reason": choice.finish_reason,
            "stop_reason": settled.stop_reason,
            "token_ids": tokens,
            "prompt_token_ids": self.prompt_ids,
        }

    def _token_name(self, token: int, text: str) -> str:
        """How logprobs name a token: its text, or `token_id:N` when the request asked
        `return_tokens_as_token_ids` (vLLM's form)."""
        return f"token_id:{token}" if self.body.return_tokens_as_token_ids else text

    def _chat_logprobs(self, choice: _Choice, start: int, end: int) -> list[dict[str, Any]]:
        """Chat's logprobs of the choice's tokens `start:end`, each with its alternatives."""
        texts = self.engine.token_texts
        entries = []
        for token, logprob, top in zip(
            choice.token_ids[start:end],
            choice.logprobs[start:end],
            choice.tops[start:end],
            strict=True,
        ):
            text, raw = texts(token)
            text = self._token_name(token, text)
            alternatives = [
                {
                    "token": self._token_name(other, texts.text(other)),
                    "logprob": value,
                    "bytes": texts(other)[1],
                }
                for other, value in top
            ]
            entries.append(
                {"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives}
            )
        return entries

    def _completion_logprobs(self, choice: _Choice, start: int, end: int) -> dict[str, Any]:
        """The legacy API's parallel lists for the choice's tokens `start:end`; `top_logprobs`
        (when asked) maps the most likely tokens' texts, and the sampled one's, to logprobs."""
        texts = self.engine.token_texts
        tokens = [self._token_name(t, texts.text(t)) for t in choice.token_ids[start:end]]
        offsets = choice.text_offsets
        while len(offsets) <= end:
            raw = texts(choice.token_ids[len(offsets) - 1])[1]
            offsets.append(offsets[-1] + len(choice.characters.decode(bytes(raw))))
        top: list[dict[str, float]] | None = None
        if isinstance(self.body, CompletionRequest) and self.body.logprobs is not None:
            top = [
                {self._token_name(other, texts.text(other)): value for other, value in alternatives}
                | {text: logprob}
                for text, logprob, alternatives in zip(
                    tokens, choice.logprobs[start:end], choice.tops[start:end], strict=True
                )
            ]
        return {
            "tokens": tokens,
            "token_logprobs": choice.logprobs[start:end],
            "top_logprobs": top,
            "text_offset": offsets[start:end],
        }

    async def stream(self, params: list[SamplingParams]) -> AsyncGenerator[bytes, None]:
        """The answer's SSE chunks. Nothing is yielded before every choice has sampled its first
        token (or ended): the response's headers go out with the first chunk
        (`_ClosingStream`), and their weight version is the oldest the choices started on."""
        choices = [_Choice(i, self.engine.decode) for i in range(len(params))]
        started: set[int] = set()
        unstarted = set(range(len(params)))
        held: list[bytes] = []
        # Closed on any exit (a cancelled answer, a stream the client left): the generator's
        # `finally` cancels the sequences still running, at once rather than when collected.
        async with contextlib.aclosing(self.engine.generate(self.prompt_ids, params)) as items:
            async for item in items:
                choice = choices[item.index]
                unstarted.discard(item.index)
                chunk: bytes | None
                if isinstance(item, Token):
                    self._started(item)
                    choice.token_ids.append(item.token_id)
                    choice.logprobs.append(item.logprob)
                    choice.tops.append(item.top)
                    chunk = self._progress(choice, started)
                elif item.error is not None:
                    status, kind = _failure_kind(item.error)
                    error = {"error": {"message": item.error, "type": kind, "code": status}}
                    yield b"".join([*held, f"data: {json.dumps(error)}\n\n".encode()])
                    yield b"data: [DONE]\n\n"  # as vLLM ends a stream after its error
                    return
                else:
                    choice.finish_reason, choice.cached_tokens = item.reason, item.cached_tokens
                    chunk = self._last_chunk(choice, started)
                if chunk is not None:
                    held.append(chunk)
                if held and not unstarted:
                    yield b"".join(held)
                    held.clear()
        options = self.body.stream_options or {}
        if options.get("include_usage"):
            yield _sse({**self._envelope(), "choices": [], "usage": self._usage(choices)})
        yield b"data: [DONE]\n\n"

    def _progress(self, choice: _Choice, started: set[int]) -> bytes | None:
        """A chunk with what a choice can show and return now, whatever it samples next (the
        tokens and text that may still be cut off, or become a tool call, are held back); None
        when nothing new is settled."""
        settled = self.settled(choice, final=False)
        text = settled.text
        if self.kind == "chat":
            text = shown_content(text, tools=self.parse_tools, final=False) or ""
        delta = self._release(choice, text)
        start = choice.sent
        if settled.count <= start and not delta:
            return None
        choice.sent = max(start, settled.count)
        return self._chunk(choice, delta, start, started)

    def _release(self, choice: _Choice, text: str) -> str:
        """What of `text` (all the choice has shown so far, and more) was not sent yet."""
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
        start: int,
        started: set[int],
    ) -> bytes:
        """The choice's text `delta` and its tokens from `start` to those sent so far."""
        token_ids = choice.token_ids[start : choice.sent]
        first = choice.index not in started
        started.add(choice.index)
        if self.kind == "chat":
            delta_body: dict[str, Any] = {"content": delta}
            if first:
                delta_body["role"] = "assistant"
            entry: dict[str, Any] = {
                "index": choice.index,
                "delta": delta_body,
                "logprobs": {"content": self._chat_logprobs(choice, start, choice.sent)},
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
                "logprobs": self._completion_logprobs(choice, start, choice.sent),
                "finish_reason": None,
                "token_ids": token_ids,
            }
            if first:
                entry["prompt_token_ids"] = self.prompt_ids
            chunk = {**self._envelope(), "choices": [entry]}
        return _sse(chunk)

    def _last_chunk(self, choice: _Choice, started: set[int]) -> bytes:
        """The rest of the choice: the tokens and text held back, its tool calls, why it ended."""
        settled = self.settled(choice, final=True)
        start = choice.sent
        end = max(start, settled.count)
        tokens = choice.token_ids[start:end]
        choice.sent = end
        first = choice.index not in started
        started.add(choice.index)
        if self.kind != "chat":
            entry: dict[str, Any] = {
                "index": choice.index,
                "text": self._release(choice, settled.text),
                "logprobs": self._completion_logprobs(choice, start, end) if tokens else None,
                "finish_reason": choice.finish_reason,
                "stop_reason": settled.stop_reason,
                "token_ids": tokens,
            }
            if first:
                entry["prompt_token_ids"] = self.prompt_ids
            return _sse({**self._envelope(), "choices": [entry]})
        content, calls, finish_reason = self._message(settled, choice.finish_reason)
        delta: dict[str, Any] = {"content": self._release(choice, content or "")}
        if calls:
            # The content was streamed already (but for text beside the calls that is not
            # whitespace between it and them); the calls come whole.
            delta = {
                "content": delta["content"] or None,
                "tool_calls": [{"index": i, **call} for i, call in enumerate(calls)],
            }
        if first:
            delta["role"] = "assistant"
        entry = {
            "index": choice.index,
            "delta": delta,
            "logprobs": {"content": self._chat_logprobs(choice, start, end)} if tokens else None,
            "finish_reason": finish_reason,
            "stop_reason": settled.stop_reason,
            "token_ids": tokens,
        }
        chunk = {**self._envelope(), "choices": [entry]}
        if first:
            chunk["prompt_token_ids"] = self.prompt_ids
        return _sse(chunk)


async def _unless_client_leaves(
    request: Request, answer: Coroutine[Any, Any, Response]
) -> Response:
    """A non-streamed answer, cancelled (its sequences with it) when the client hangs up first:
    uvicorn does not stop a handler whose client left, and generating on for nobody holds a
    batch slot for up to `max_tokens` steps."""
    result = await unless_client_leaves(request.receive, answer)
    if isinstance(result, ClientLeft):
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it
    return result


class _ClosingStream(StreamingResponse):
    """A streamed answer whose generator is closed however the response ends, so a client that
    left cancels its sequences at once (Starlette cancels the stream's task, which may leave the
    generator suspended at a `yield` until it is collected).

    Its headers go out with its first chunk, once the call knows the weight version its choices
    were sampled with (`_Call.weight_version`); a client that leaves before then (its request
    waiting for a batch slot) cancels it too."""

    def __init__(
        self, call: _Call, content: AsyncGenerator[bytes, None], headers: dict[str, str]
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._call = call
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            first = await unless_client_leaves(receive, anext(self._content, b""))
            if isinstance(first, ClientLeft):
                return
            self.headers[WEIGHT_VERSION_HEADER] = str(self._call.weight_version)
            self.body_iterator = _after(first, self._content)
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()


async def _after(first: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """`first`, then what `rest` yields."""
    yield first
    async for chunk in rest:
        yield chunk


def _special_token_ids(tokenizer: Any) -> set[int]:
    """The tokens the tokenizer marks special (the ones decoding drops from the text)."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(index for index, token in added.items() if getattr(token, "special", False))
    return ids


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def _json(request: Request) -> Any:
    """The body by a strict reader: Python's own read `NaN`, `"\\ud800"` (a string with no UTF-8
    form, a 500 once it reached a stop string's check) and recursed past its stack on ~1,000
    nested brackets (a bare 500); each of those is a 400 here, before any field is looked at."""
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as error:
        raise EngineError(
            400,
            f"the request body is not JSON this engine reads ({error}); it refuses NaN, "
            'Infinity, a string with an unpaired UTF-16 surrogate ("\\ud800", which has no UTF-8 '
            "form) and nesting past 1,024 levels",
        ) from error


def _alternatives_asked(body: _Request) -> int:
    """How many most likely tokens each position lists: chat's `top_logprobs`, completions'
    `logprobs` (an integer there)."""
    if isinstance(body, ChatRequest):
        return body.top_logprobs or 0
    if isinstance(body, CompletionRequest):
        return body.logprobs or 0
    return 0


def _validation_message(error: ValidationError) -> str:
    problems = [
        f"{'.'.join(str(p) for p in item['loc']) or 'body'}: {item['msg']}"
        for item in error.errors()
    ]
    return "invalid request: " + "; ".join(problems)
