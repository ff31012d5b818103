"""A mode's sampling policy against what harnesses send, through the openai SDK, with the stub
engine (tests/stub_engine.py: the model is stubbed; the requests it gets are compared)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from reins.gateway import GatewaySettings
from reins.gateway.capture import SamplingPolicy
from tests.conftest import ADMIN_KEY, Gateway
from tests.stub_engine import StubEngine

GREEDY = SamplingPolicy(
    set={"temperature": 0.0, "max_tokens": 9}, keep_harness=["temperature", "max_tokens"]
)
"""The docs' example `val` policy: greedy unless the harness says otherwise, and a default
length."""


@pytest.fixture
def gateway_settings(database_url: str) -> GatewaySettings:
    return GatewaySettings(database_url=database_url, api_key=ADMIN_KEY, val_sampling=GREEDY)


@pytest.fixture
def client(gateway: Gateway, stub: StubEngine) -> openai.OpenAI:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "v", "mode": "val"}])
    token = gateway.http.post("/api/rollouts/v/attempts").json()["token"]
    base = f"{gateway.url}/proxy/rollout/v/attempt/1/mode/val/openai/v1"
    return openai.OpenAI(base_url=base, api_key=token, max_retries=0)


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_null_the_harness_sends_is_no_value_of_its_own(
    client: openai.OpenAI, stub: StubEngine, kind: str
) -> None:
    """`keep_harness` fields are set when the harness sent no value of its own (docs/proxy.md):
    the SDK sends `temperature=None` as `null`, which is none, so the mode's value applies (the
    engine would otherwise sample at its default temperature, 1, and up to the context's end);
    a value the harness did send is kept."""

    def sent(**sampling: Any) -> dict[str, Any]:
        if kind == "chat":
            messages: Any = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(model="x", messages=messages, **sampling)
        else:
            client.completions.create(model="x", prompt="hi", **sampling)
        return {name: stub.requests[-1].get(name) for name in ("temperature", "max_tokens")}

    assert sent(temperature=None, max_tokens=None) == {"temperature": 0.0, "max_tokens": 9}
    assert sent() == {"temperature": 0.0, "max_tokens": 9}
    assert sent(temperature=0.3, max_tokens=4) == {"temperature": 0.3, "max_tokens": 4}
