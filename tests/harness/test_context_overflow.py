"""A prompt too long for the engine's context, said in each wire API's own words, to the real
`openai`, `anthropic` and `litellm` clients. STUBBED: the engine, a Starlette app on loopback
whose chat completions refuse with vLLM's own 400 texts (the embedded engine's refusal is
tested with the real engine in tests/harness/test_anthropic_sdk.py)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator

import anthropic
import litellm
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from reins.gateway.wire.overflow import Overflow, anthropic_message, read_overflow
from reins.serving import BackgroundServer
from tests.conftest import Gateway

# vLLM's refusals (its serving layer), as it words them.
PROMPT_TOO_LONG = (
    "This model's maximum context length is 4096 tokens. However, your request has 5000 input "
    "tokens. Please reduce the length of the input messages."
)
ANSWER_TOO_LONG = (
    "'max_tokens' or 'max_completion_tokens' is too large: 32000. This model's maximum context "
    "length is 4096 tokens and your request has 1200 input tokens (32000 > 4096 - 1200)."
)
OLDER_VLLM = (
    "This model's maximum context length is 4096 tokens. However, you requested 33200 tokens "
    "(1200 in the messages, 32000 in the completion). Please reduce the length of the messages "
    "or completion."
)
EMBEDDED = "This model's maximum context length is 8192 tokens; the prompt has 9000."

# Claude Code 2.1.197 reads these (from its binary): it compacts on the first, and retries with
# a smaller max_tokens on the second.
CLAUDE_PROMPT = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", re.IGNORECASE)
CLAUDE_MAX_TOKENS = re.compile(
    r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)"
)


def _vllm_error(message: str) -> str:
    return json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    )


@pytest.mark.parametrize(
    ("status", "text", "expected"),
    [
        (400, _vllm_error(PROMPT_TOO_LONG), Overflow(PROMPT_TOO_LONG, 4096, 5000)),
        (400, _vllm_error(ANSWER_TOO_LONG), Overflow(ANSWER_TOO_LONG, 4096, 1200, 32000)),
        (400, _vllm_error(OLDER_VLLM), Overflow(OLDER_VLLM, 4096, 1200, 32000)),
        (
            400,
            json.dumps({"error": {"message": EMBEDDED, "code": "context_length_exceeded"}}),
            Overflow(EMBEDDED, 8192, 9000),
        ),
        (
            400,
            json.dumps({"error": {"message": "too big", "code": "context_length_exceeded"}}),
            Overflow("too big", None, None),
        ),
        (400, "The decoder prompt (length 5000) is longer than the maximum model length of 4096.",
         Overflow("The decoder prompt (length 5000) is longer than the maximum model length of "
                  "4096.", 4096, 5000)),
        (400, _vllm_error("roles must alternate"), None),
        (500, _vllm_error(PROMPT_TOO_LONG), None),
    ],
)  # fmt: skip
def test_an_engines_refusal_is_read_as_an_overflow_or_not(
    status: int, text: str, expected: Overflow | None
) -> None:
    assert read_overflow(status, text) == expected


def test_anthropics_words_carry_the_numbers_claude_code_reads() -> None:
    prompt = anthropic_message(Overflow(PROMPT_TOO_LONG, 4096, 5000))
    match = CLAUDE_PROMPT.search(prompt)
    assert match is not None and match.groups() == ("5000", "4096")
    answer = anthropic_message(Overflow(ANSWER_TOO_LONG, 4096, 1200, 32000))
    match = CLAUDE_MAX_TOKENS.search(answer)
    assert match is not None and match.groups() == ("1200", "32000", "4096")
    unknown = anthropic_message(Overflow("too big", None, None))
    assert unknown.startswith("prompt is too long") and CLAUDE_PROMPT.search(unknown) is None


@contextlib.contextmanager
def engine_refusing(gateway: Gateway, message: str) -> Iterator[str]:
    """An engine registered as model `m` whose chat completions refuse with vLLM's 400 and
    `message`; yields the token of rollout `r`'s first attempt."""

    async def refuse(_: Request) -> Response:
        return Response(_vllm_error(message), 400, media_type="application/json")

    engine = BackgroundServer(
        Starlette(routes=[Route("/v1/chat/completions", refuse, methods=["POST"])])
    ).start()
    try:
        gateway.http.post("/api/models", json={"model": "m", "endpoint": f"{engine.url}/v1"})
        gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
        yield str(gateway.http.post("/api/rollouts/r/attempts").json()["token"])
    finally:
        engine.stop()


def _proxy(gateway: Gateway) -> str:
    return f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train"


MESSAGES = [{"role": "user", "content": "hi"}]


def test_anthropic_clients_get_anthropics_words(gateway: Gateway) -> None:
    with engine_refusing(gateway, PROMPT_TOO_LONG) as token:
        sdk = anthropic.Anthropic(base_url=f"{_proxy(gateway)}/anthropic", api_key=token)
        with pytest.raises(anthropic.BadRequestError) as raised:
            sdk.messages.create(model="m", max_tokens=16000, messages=MESSAGES)  # type: ignore[arg-type]
    error = raised.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("prompt is too long: 5000 tokens > 4096 maximum")
    assert PROMPT_TOO_LONG in error["message"]  # the engine's own words follow


def test_an_answer_without_room_is_said_so_claude_code_lowers_max_tokens(gateway: Gateway) -> None:
    with engine_refusing(gateway, ANSWER_TOO_LONG) as token:
        sdk = anthropic.Anthropic(base_url=f"{_proxy(gateway)}/anthropic", api_key=token)
        with pytest.raises(anthropic.BadRequestError) as raised:
            sdk.messages.create(model="m", max_tokens=16000, messages=MESSAGES)  # type: ignore[arg-type]
    match = CLAUDE_MAX_TOKENS.search(str(raised.value))
    assert match is not None and match.groups() == ("1200", "32000", "4096")


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_clients_get_the_context_length_exceeded_code(gateway: Gateway, api: str) -> None:
    with engine_refusing(gateway, PROMPT_TOO_LONG) as token:
        sdk = openai.OpenAI(base_url=f"{_proxy(gateway)}/openai/v1", api_key=token, max_retries=0)
        with pytest.raises(openai.BadRequestError) as raised:
            if api == "chat":
                sdk.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
            else:
                sdk.responses.create(model="m", input="hi")
    assert raised.value.code == "context_length_exceeded"
    assert raised.value.param == ("messages" if api == "chat" else "input")
    assert raised.value.body["message"] == PROMPT_TOO_LONG  # type: ignore[index]


def test_litellm_raises_its_context_window_error(gateway: Gateway) -> None:
    with (
        engine_refusing(gateway, PROMPT_TOO_LONG) as token,
        pytest.raises(litellm.ContextWindowExceededError),
    ):
        litellm.completion(
            model="openai/m",
            api_base=f"{_proxy(gateway)}/openai/v1",
            api_key=token,
            messages=MESSAGES,
            num_retries=0,
        )
