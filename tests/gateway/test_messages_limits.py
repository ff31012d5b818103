"""A Messages answer the engine ended for its length, through the gateway with the real
`anthropic` SDK: the context's end or `max_tokens`, read against the limit the engine got (a
mode's own limit may be lower than the harness's). STUBBED: the engine (the `engine` fixture: a
scripted answer to each chat completion)."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from reins.gateway import GatewaySettings
from reins.gateway.capture import SamplingPolicy
from tests.conftest import ADMIN_KEY, Gateway
from tests.gateway.conftest import Engine

MODE_LIMIT = 5
HARNESS_LIMIT = 64000
"""What Claude Code asks for, whatever the model's context."""


@pytest.fixture
def gateway_settings(database_url: str) -> GatewaySettings:
    capped = SamplingPolicy(set={"temperature": 1.0, "top_p": 1.0, "max_tokens": MODE_LIMIT})
    return GatewaySettings(database_url=database_url, api_key=ADMIN_KEY, train_sampling=capped)


def cut_answer(engine: Engine, made: int) -> None:
    """The engine's answer of `made` tokens ended with `length`, plain and streamed."""
    usage = {"prompt_tokens": 3, "completion_tokens": made, "total_tokens": 3 + made}
    message = {"role": "assistant", "content": "a long answ"}
    engine.answer = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
        "usage": usage,
    }
    engine.chunks = [
        {"id": "c", "choices": [{"index": 0, "delta": message, "finish_reason": None}]},
        {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {"id": "c", "choices": [], "usage": usage},
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize(
    ("mode", "made", "stop_reason"),
    [
        ("val", MODE_LIMIT, "model_context_window_exceeded"),  # 5 of 64,000: the context's end
        ("train", MODE_LIMIT, "max_tokens"),  # the mode's limit of 5, which the engine got
        ("val", HARNESS_LIMIT, "max_tokens"),
    ],
)
def test_a_length_finish_is_the_context_windows_end_only_short_of_the_engines_limit(
    gateway: Gateway, engine: Engine, stream: bool, mode: str, made: int, stop_reason: str
) -> None:
    """Claude Code asks for 64k tokens whatever the model: an answer the embedded engine ends at
    its context's end said `max_tokens`, and Claude Code then reported an answer longer than 64k
    tokens. Anthropic's newer models say `model_context_window_exceeded` there (Claude Code: "The
    model has reached its context window limit"); a mode's lower limit met is still
    `max_tokens`."""
    cut_answer(engine, made)
    base = f"{gateway.url}/proxy/rollout/r/attempt/1/mode/{mode}/anthropic"
    # A timeout of its own: the SDK refuses a plain call of 64k tokens on its default one.
    client = anthropic.Anthropic(
        base_url=base, api_key=gateway.api_key, max_retries=0, timeout=60.0
    )
    messages: Any = [{"role": "user", "content": "hi"}]
    if stream:
        with client.messages.stream(
            model="m", max_tokens=HARNESS_LIMIT, messages=messages
        ) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(model="m", max_tokens=HARNESS_LIMIT, messages=messages)
    sent_limit = engine.requests[-1]["max_tokens"]
    assert sent_limit == (MODE_LIMIT if mode == "train" else HARNESS_LIMIT)
    assert (message.stop_reason, message.usage.output_tokens) == (stop_reason, made)
