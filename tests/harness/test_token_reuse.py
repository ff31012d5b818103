"""Token reuse through the gateway (`GatewaySettings.token_reuse`, docs/proxy.md): the `openai` SDK
holds a streamed multi-turn conversation with a tool at temperature 1; every call after the first
is prompted with the previous call's prompt + response token IDs + the template's tokens of only
the new messages, so the rollout is one training sequence. An edited history falls back to the
template's rendering, and the split says why."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from reins.gateway import GatewaySettings
from tests.conftest import ADMIN_KEY
from tests.embedded_support import ServedEngine
from tests.harness.conftest import Rollout, gateway_for, open_rollout, training_sequences
from tests.harness.conversations import ask, weather_conversation

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reuse_gateway_url(
    embedded: ServedEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A gateway with token reuse on, in front of the session's engine."""
    database = tmp_path_factory.mktemp("reuse-gateway") / "gateway.db"
    settings = GatewaySettings(database_url=str(database), api_key=ADMIN_KEY, token_reuse=True)
    with gateway_for(settings, embedded) as (url, _):
        yield url


@pytest.fixture
def reuse_rollout(reuse_gateway_url: str, embedded: ServedEngine) -> Rollout:
    return open_rollout(reuse_gateway_url, embedded)


@pytest.fixture(scope="module")
def plain_gateway_url(
    embedded: ServedEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A gateway with token reuse turned off, in front of the session's engine."""
    database = tmp_path_factory.mktemp("plain-gateway") / "gateway.db"
    settings = GatewaySettings(database_url=str(database), api_key=ADMIN_KEY, token_reuse=False)
    with gateway_for(settings, embedded) as (url, _):
        yield url


def client(rollout: Rollout) -> openai.OpenAI:
    return openai.OpenAI(base_url=rollout.base_url, api_key=rollout.token, timeout=300)


def template_text(engine: ServedEngine, request: dict[str, Any]) -> str:
    """The text of the prompt the engine renders for a recorded chat request (its /tokenize)."""
    body = {k: request[k] for k in ("messages", "tools", "tool_choice") if k in request}
    answer = httpx.post(
        f"{engine.server.url}/tokenize", json={"model": engine.name, **body}, timeout=60
    )
    answer.raise_for_status()
    return str(engine.tokenizer.decode(answer.json()["tokens"], skip_special_tokens=False))


def assert_each_prompt_extends_the_last_call(rollout: Rollout, calls: list[dict[str, Any]]) -> None:
    """Call after call: prompt == previous prompt + previous response + the tokens of the rest of
    the template's text, exactly."""
    tokenizer = rollout.engine.tokenizer
    for number, (before, call) in enumerate(itertools.pairwise(calls), start=2):
        assert call["token_reuse"] == "reused", f"call {number}: {call['token_reuse']}"
        head = before["prompt_token_ids"] + before["response_token_ids"]
        prompt = call["prompt_token_ids"]
        assert prompt[: len(head)] == head, f"call {number}"
        text = template_text(rollout.engine, call["request"])
        head_text = tokenizer.decode(head, skip_special_tokens=False)
        assert text.startswith(head_text), f"call {number}"
        rest = tokenizer(text[len(head_text) :], add_special_tokens=False)["input_ids"]
        assert prompt[len(head) :] == rest, f"call {number}"


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
def test_a_conversation_with_a_tool_is_one_training_sequence(
    reuse_rollout: Rollout, stream: bool
) -> None:
    received = weather_conversation(client(reuse_rollout), reuse_rollout.model, stream=stream)
    calls = reuse_rollout.calls()
    assert len(calls) == len(received) == 4
    assert all(call["status"] == 200 for call in calls), [c.get("error") for c in calls]
    assert calls[0]["token_reuse"] == "none"
    assert_each_prompt_extends_the_last_call(reuse_rollout, calls)
    assert training_sequences(calls, reuse_rollout.engine) == (1, [])


def test_an_edited_history_falls_back_and_the_split_says_why(reuse_rollout: Rollout) -> None:
    sdk = client(reuse_rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Name a colour."}]
    answer = ask(sdk, reuse_rollout.model, messages, stream=True)
    # The harness rewrites the answer before sending it back (as a repairing harness does).
    edited = {"role": "assistant", "content": "The colour I name is: " + answer["content"]}
    messages += [edited, {"role": "user", "content": "And another one?"}]
    ask(sdk, reuse_rollout.model, messages, stream=True)
    calls = reuse_rollout.calls()
    assert [call["token_reuse"] for call in calls] == ["none", "fallback"]
    assert template_text(reuse_rollout.engine, calls[1]["request"]) == (
        reuse_rollout.engine.tokenizer.decode(calls[1]["prompt_token_ids"])
    )
    assert training_sequences(calls, reuse_rollout.engine) == (2, ["transformed"])


def test_without_reuse_the_calls_record_no_reuse(
    plain_gateway_url: str, embedded: ServedEngine
) -> None:
    """A gateway with reuse off renders every prompt from the template."""
    rollout = open_rollout(plain_gateway_url, embedded)
    weather_conversation(client(rollout), rollout.model, stream=True, turns=2)
    calls = rollout.calls()
    assert all("token_reuse" not in call for call in calls)
    for call in calls:
        text = template_text(rollout.engine, call["request"])
        tokens = rollout.engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert call["prompt_token_ids"] == tokens


def test_a_messages_api_conversation_reuses_its_tokens(reuse_rollout: Rollout) -> None:
    """The Anthropic SDK (Messages API, translated to chat at the proxy) gets reuse too."""
    import anthropic

    sdk = anthropic.Anthropic(
        base_url=reuse_rollout.anthropic_base_url, api_key=reuse_rollout.token, timeout=300
    )
    messages: list[dict[str, Any]] = []
    for question in ["Name a colour.", "And another one?", "Which one do you like best?"]:
        messages.append({"role": "user", "content": question})
        answer = sdk.messages.create(
            model=reuse_rollout.model,
            max_tokens=24,
            messages=messages,  # type: ignore[arg-type]
        )
        text = "".join(block.text for block in answer.content if block.type == "text")
        messages.append({"role": "assistant", "content": text})
    calls = reuse_rollout.calls()
    assert [call["kind"] for call in calls] == ["messages"] * 3
    assert [call["token_reuse"] for call in calls] == ["none", "reused", "reused"]
    for before, call in itertools.pairwise(calls):
        head = before["prompt_token_ids"] + before["response_token_ids"]
        assert call["prompt_token_ids"][: len(head)] == head
    assert training_sequences(calls, reuse_rollout.engine) == (1, [])


def test_the_default_gateway_reuses_tokens(rollout: Rollout) -> None:
    """Reuse is on by default (`GatewaySettings.token_reuse`): a gateway made with no setting
    prompts the second call with the first call's tokens."""
    weather_conversation(client(rollout), rollout.model, stream=False, turns=2)
    calls = rollout.calls()
    assert [call["token_reuse"] for call in calls] == ["none", "reused"]
    assert_each_prompt_extends_the_last_call(rollout, calls)
