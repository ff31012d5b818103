"""Anthropic's `count_tokens` under a mode's sampling policy that sets a prompt field: the count
is the prompt the call itself is sent. The engine is real (the embedded engine, a tiny random
Llama with the default model's tokenizer and Qwen3's thinking switch as its chat template); the
harness is the real `anthropic` SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from reins.gateway import GatewaySettings
from reins.gateway.capture import SamplingPolicy
from tests.conftest import ADMIN_KEY, Gateway
from tests.embedded_support import ServedEngine, serving, tiny_engine

THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
)
"""Qwen3's switch, as its chat template reads it: `enable_thinking: false` opens the answer with
an empty thought (nine more prompt tokens with this tokenizer)."""

NO_THINKING = SamplingPolicy(
    set={"max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}}
)
"""Thinking off, whatever the harness asks; one token an answer (a random model's answers are
over quickly)."""
MESSAGES: Any = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def thinking() -> Iterator[ServedEngine]:
    engine = tiny_engine()
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    with serving(engine) as served:
        yield served


@pytest.fixture
def gateway_settings(database_url: str) -> GatewaySettings:
    return GatewaySettings(database_url=database_url, api_key=ADMIN_KEY, train_sampling=NO_THINKING)


@pytest.mark.parametrize("asked", [None, {"type": "enabled", "budget_tokens": 1024}])
def test_a_policys_template_variables_are_counted_as_the_call_sends_them(
    gateway: Gateway, thinking: ServedEngine, asked: dict[str, Any] | None
) -> None:
    """A train policy that sets `chat_template_kwargs` (thinking off) was applied to the call
    but not to its `count_tokens`: the count was the prompt without the policy's variables, 9
    tokens fewer than the call consumed, whether or not the harness asked for thinking."""
    gateway.http.post("/api/models", json={"model": "m", "endpoint": thinking.base_url})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    base = f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train/anthropic"
    sdk = anthropic.Anthropic(base_url=base, api_key=gateway.api_key, max_retries=0)
    extra: dict[str, Any] = {} if asked is None else {"thinking": asked}
    counted = sdk.messages.count_tokens(model="m", messages=MESSAGES, **extra)
    sdk.messages.create(model="m", max_tokens=1100, messages=MESSAGES, **extra)
    events = gateway.http.get("/api/rollouts/r/events", params={"type": "model_request"}).json()
    prompt = events[-1]["data"]["prompt_token_ids"]
    assert thinking.tokenizer.decode(prompt).endswith("<think>\n\n</think>\n\n")
    assert counted.input_tokens == len(prompt)
