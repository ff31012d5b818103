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
CAPPED = SamplingPolicy(set={"temperature": 1.0, "top_p": 1.0, "max_tokens": 5})
"""A `train` policy that caps every call's length, whatever the harness asks."""


@pytest.fixture
def gateway_settings(database_url: str) -> GatewaySettings:
    return GatewaySettings(
        database_url=database_url, api_key=ADMIN_KEY, val_sampling=GREEDY, train_sampling=CAPPED
    )


def open_client(gateway: Gateway, stub: StubEngine, mode: str) -> openai.OpenAI:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub.base_url})
    gateway.http.post("/api/rollouts", json=[{"rollout_id": mode, "mode": mode}])
    token = gateway.http.post(f"/api/rollouts/{mode}/attempts").json()["token"]
    base = f"{gateway.url}/proxy/rollout/{mode}/attempt/1/mode/{mode}/openai/v1"
    return openai.OpenAI(base_url=base, api_key=token, max_retries=0)


@pytest.fixture
def client(gateway: Gateway, stub: StubEngine) -> openai.OpenAI:
    return open_client(gateway, stub, "val")


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


def test_a_length_the_mode_sets_applies_under_either_name(
    gateway: Gateway, stub: StubEngine
) -> None:
    """`max_completion_tokens` is chat's newer name for `max_tokens` (the openai SDK's, which
    vLLM and the embedded engine take first): a policy that sets the length sets it whichever
    name the harness used, and one that keeps the harness's keeps it under either name."""

    def length(client: openai.OpenAI, **asked: Any) -> int | None:
        messages: Any = [{"role": "user", "content": "hi"}]
        client.chat.completions.create(model="x", messages=messages, **asked)
        sent = stub.requests[-1]
        # What the engines generate up to (vLLM and the embedded engine alike).
        return sent.get("max_completion_tokens") or sent.get("max_tokens")

    train = open_client(gateway, stub, "train")
    assert length(train, max_completion_tokens=500) == 5
    assert length(train, max_tokens=500, max_completion_tokens=400) == 5
    assert length(train, max_tokens=500) == 5
    val = open_client(gateway, stub, "val")
    assert length(val, max_completion_tokens=500) == 500
    assert length(val, max_completion_tokens=None) == 9
    assert length(val) == 9


def test_a_null_distribution_field_is_no_change_to_note(gateway: Gateway, stub: StubEngine) -> None:
    """Train mode removes the fields that change the sampled distribution and notes each in the
    call's record; a `null` one (the SDK sends `presence_penalty=None` as null) changed nothing
    and is not noted as dropped, while one with a value is."""
    train = open_client(gateway, stub, "train")
    messages: Any = [{"role": "user", "content": "hi"}]
    train.chat.completions.create(
        model="x", messages=messages, presence_penalty=None, logit_bias=None, top_p=None
    )
    train.chat.completions.create(
        model="x", messages=messages, presence_penalty=0.5, frequency_penalty=None
    )
    assert not {"presence_penalty", "logit_bias", "frequency_penalty"} & set(stub.requests[-1])
    events = gateway.http.get("/api/rollouts/train/events").json()
    notes = [event["data"].get("notes") for event in events if event["type"] == "model_request"]
    assert notes == [
        None,
        ["presence_penalty dropped: train mode samples from the policy's own distribution"],
    ]


@pytest.mark.parametrize("mode", ["train", "val"])
@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1), ("temperature", 2.5), ("top_p", 5), ("frequency_penalty", 3)],
)
def test_sampling_values_openai_refuses_are_400s_in_every_mode(
    gateway: Gateway, stub: StubEngine, mode: str, field: str, value: float
) -> None:
    """Train mode replaces these fields with its policy's, so the engine never saw a harness's
    `temperature=-1` and the call was answered: a harness met the error only once deployed."""
    client = open_client(gateway, stub, mode)
    sent = len(stub.requests)
    messages: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match=field):
        client.chat.completions.create(model="x", messages=messages, **{field: value})
    with pytest.raises(openai.BadRequestError, match=field):
        client.completions.create(model="x", prompt="hi", **{field: value})
    assert len(stub.requests) == sent  # refused before the engine
    client.chat.completions.create(model="x", messages=messages, **{field: 1})  # in range
