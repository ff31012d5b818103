"""Token reuse with a real vLLM engine (docs/proxy.md, `src/reins/gateway/reuse_vllm.py`): the proxy
renders a call that extends an earlier one with vLLM, prompts vLLM with the earlier call's prompt
+ response IDs + the tokens of only what was added, and answers the harness through vLLM's
derender (its tool parser), streamed or not.

The session's vLLM server (tests/engine/conftest.py: `--enable-scale-out`, the routes reuse
needs, and `HERMES_TEMPLATE`, which renders tools and tool calls). The harnesses are the real
`openai` SDK (chat: a 4-call conversation with the weather tool at temperature 1,
`tests/harness/conversations.py`; Responses) and the `anthropic` SDK (Messages).

The chat conversations carry a `seed`: a sampled answer then depends on the request alone, not on
what the shared server sampled before, so each test sees the same answers in any order. Unseeded,
~1 conversation in 10 had its first answer cut by `max_tokens` inside a tool call: vLLM's
streaming parser then gives the harness an empty or half-formed call, whose history does not
re-render to the sampled tokens, and the proxy falls back (correctly, docs/proxy.md) where these
tests expect reuse. `SEED`'s first answer is a whole tool call (seeds 7 and 10 are cut).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from reins.gateway import GatewaySettings
from reins.samples import Call, dedup_calls, merge_calls
from tests.conftest import ADMIN_KEY, serve
from tests.embedded_support import FEW_SHOT_TOOL_USE, WEATHER_TOOL
from tests.harness.conversations import ask, weather_conversation
from tests.vllm_support import VllmServer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SEED = 9  # the chat calls' sampling seed (see above)


@dataclass
class Gateway:
    url: str
    engine: VllmServer

    def rollout(self, mode: str = "train") -> Rollout:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        rollout_id = f"vllm-reuse-{uuid.uuid4().hex[:10]}"
        httpx.post(
            f"{self.url}/api/rollouts", json=[{"rollout_id": rollout_id}], headers=admin
        ).raise_for_status()
        attempt = httpx.post(f"{self.url}/api/rollouts/{rollout_id}/attempts", headers=admin)
        attempt.raise_for_status()
        return Rollout(self.url, rollout_id, attempt.json()["token"], mode)


@dataclass
class Rollout:
    gateway_url: str
    rollout_id: str
    token: str
    mode: str

    @property
    def attempt_url(self) -> str:
        return f"{self.gateway_url}/proxy/rollout/{self.rollout_id}/attempt/1/mode/{self.mode}"

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.attempt_url}/openai/v1", api_key=self.token, timeout=600
        )

    def calls(self) -> list[dict[str, Any]]:
        response = httpx.get(
            f"{self.gateway_url}/api/rollouts/{self.rollout_id}/events",
            params={"type": "model_request"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
        response.raise_for_status()
        return [event["data"] for event in response.json()]


def gateway(engine: VllmServer, tmp_path: Path, *, reuse: bool) -> Iterator[Gateway]:
    settings = GatewaySettings(
        database_url=str(tmp_path / f"gateway-{reuse}.db"), api_key=ADMIN_KEY, token_reuse=reuse
    )
    with serve(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        httpx.post(
            f"{url}/api/models",
            json={"model": engine.served_model_name, "endpoint": engine.base_url, "engine": "vllm"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        ).raise_for_status()
        yield Gateway(url, engine)


@pytest.fixture
def reusing(vllm_server: VllmServer, tmp_path: Path) -> Iterator[Gateway]:
    yield from gateway(vllm_server, tmp_path, reuse=True)


def sequences(calls: list[dict[str, Any]], tokenizer: Any) -> tuple[int, list[str]]:
    """Training sequences the sample adapter makes of the recorded calls, and split reasons."""
    kept = [
        Call(c["prompt_token_ids"], c["response_token_ids"], seq=number)
        for number, c in enumerate(calls)
        if c["status"] == 200 and c["response_token_ids"]
    ]

    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens, skip_special_tokens=False))

    merged, splits = merge_calls(dedup_calls(kept), decode=decode)
    return len(merged), [split.reason for split in splits]


def consumed_by_vllm(engine: VllmServer, call: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own generation from the recorded prompt IDs, at the call's seed: what it samples
    from exactly that prompt (greedy here, so that it is deterministic)."""
    body = {
        "token_ids": call["prompt_token_ids"],
        "sampling_params": {"temperature": 0.0, "max_tokens": 4, "logprobs": 0},
        "return_token_ids": True,
    }
    response = httpx.post(f"{engine.url}/inference/v1/generate", json=body, timeout=120)
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return answer


def assert_first_answer_whole(calls: list[dict[str, Any]]) -> None:
    """The premise of the reuse tests: an answer cut inside a tool call falls back by design."""
    assert calls[0]["finish_reason"] == "tool_calls", (
        f"SEED's first answer is no whole tool call ({calls[0]['finish_reason']}): pick another"
    )


def assert_chained(calls: list[dict[str, Any]]) -> None:
    """Each reused call's recorded prompt starts with the previous call's prompt + response."""
    for earlier, later in itertools.pairwise(calls):
        assert later["token_reuse"] == "reused", later
        head = earlier["prompt_token_ids"] + earlier["response_token_ids"]
        assert later["prompt_token_ids"][: len(head)] == head
        assert len(later["prompt_token_ids"]) > len(head)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_tool_conversation_is_one_sequence_with_reuse(
    reusing: Gateway, tokenizer: Any, stream: bool
) -> None:
    rollout = reusing.rollout()
    received = weather_conversation(
        rollout.sdk(), reusing.engine.served_model_name, stream=stream, seed=SEED
    )
    calls = rollout.calls()
    assert len(calls) == 4
    assert_first_answer_whole(calls)
    assert [c["token_reuse"] for c in calls] == ["none", "reused", "reused", "reused"]
    assert all(c["status"] == 200 for c in calls)
    for call in calls:
        assert len(call["response_logprobs"]) == len(call["response_token_ids"])
    assert_chained(calls)
    assert sequences(calls, tokenizer) == (1, [])
    # What the harness was shown is the text of the recorded tokens, as vLLM's chat route shows
    # it: the end-of-turn token that ended an answer is not shown.
    for call, message in zip(calls, received, strict=True):
        shown = tokenizer.decode(call["response_token_ids"], skip_special_tokens=False)
        if message.get("tool_calls"):
            assert call["finish_reason"] == "tool_calls"
            assert "<tool_call>" in shown
        else:
            assert shown.removesuffix("<|im_end|>") == message["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_reused_prompt_is_what_vllm_consumed(
    reusing: Gateway, vllm_server: VllmServer, stream: bool
) -> None:
    """The recorded prompt IDs are the IDs vLLM reports it consumed, and its text is the
    template's rendering of the messages (the reuse check)."""
    rollout = reusing.rollout()
    weather_conversation(
        rollout.sdk(), reusing.engine.served_model_name, stream=stream, turns=2, seed=SEED
    )
    first, second = rollout.calls()
    assert_first_answer_whole([first])
    assert second["token_reuse"] == "reused"
    direct = consumed_by_vllm(vllm_server, second)
    assert direct["prompt_token_ids"] == second["prompt_token_ids"]
    rendered = httpx.post(
        f"{vllm_server.url}/v1/chat/completions/render",
        json={
            "model": vllm_server.served_model_name,
            "messages": second["request"]["messages"],
            "tools": second["request"]["tools"],
        },
        timeout=120,
    ).json()["token_ids"]
    text = httpx.post(
        f"{vllm_server.url}/detokenize",
        json={"model": vllm_server.served_model_name, "tokens": second["prompt_token_ids"]},
    ).json()["prompt"]
    expected = httpx.post(
        f"{vllm_server.url}/detokenize",
        json={"model": vllm_server.served_model_name, "tokens": rendered},
    ).json()["prompt"]
    assert text == expected


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_edited_history_falls_back_and_is_answered(reusing: Gateway, stream: bool) -> None:
    rollout = reusing.rollout()
    sdk = rollout.sdk()
    model = reusing.engine.served_model_name
    messages: list[dict[str, Any]] = [dict(m) for m in FEW_SHOT_TOOL_USE]
    answer = ask(sdk, model, messages, stream=stream, tools=[WEATHER_TOOL], seed=SEED)
    edited = {"role": "assistant", "content": "Something else entirely."}
    follow_up = [*messages, edited, {"role": "user", "content": "And tomorrow?"}]
    second = ask(sdk, model, follow_up, stream=stream, tools=[WEATHER_TOOL], seed=SEED)
    assert second["role"] == "assistant"
    first_call, second_call = rollout.calls()
    assert answer != edited
    assert first_call["token_reuse"] == "none"
    assert second_call["token_reuse"] == "fallback"
    assert second_call["status"] == 200
    assert second_call["response_token_ids"]
    assert len(second_call["response_logprobs"]) == len(second_call["response_token_ids"])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_reused_tool_call_is_what_vllm_chat_shows(
    reusing: Gateway, vllm_server: VllmServer, stream: bool
) -> None:
    """`val` mode keeps temperature 0: the reused call's answer (tool calls parsed by vLLM's
    derender) equals vLLM's chat route's answer to the same messages, token for token."""
    rollout = reusing.rollout(mode="val")
    model = vllm_server.served_model_name
    history: list[dict[str, Any]] = [dict(m) for m in FEW_SHOT_TOOL_USE[:3]]
    first = ask(rollout.sdk(), model, history, stream=stream, tools=[WEATHER_TOOL], temperature=0)
    assert [c["function"]["name"] for c in first["tool_calls"]] == ["get_weather"]
    # As in the few-shot history: the next question follows the call (greedy: another call).
    history += [first, {"role": "user", "content": "Weather in Paris?"}]
    second = ask(rollout.sdk(), model, history, stream=stream, tools=[WEATHER_TOOL], temperature=0)
    recorded = rollout.calls()[1]
    assert recorded["token_reuse"] == "reused"
    direct = httpx.post(
        f"{vllm_server.base_url}/chat/completions",
        json={
            "model": model,
            "messages": history,
            "tools": [WEATHER_TOOL],
            "temperature": 0,
            "max_tokens": 32,
            "return_token_ids": True,
        },
        timeout=120,
    ).json()
    (expected,) = direct["choices"]
    assert direct["prompt_token_ids"] == recorded["prompt_token_ids"]
    assert expected["token_ids"] == recorded["response_token_ids"]
    assert recorded["finish_reason"] == expected["finish_reason"] == "tool_calls"
    shown = [(c["function"]["name"], c["function"]["arguments"]) for c in second["tool_calls"]]
    wanted = [
        (c["function"]["name"], c["function"]["arguments"])
        for c in expected["message"]["tool_calls"]
    ]
    assert shown == wanted
    assert (second.get("content") or "") == (expected["message"]["content"] or "")


QUESTIONS = ["Name a colour.", "And another one?", "Which one do you like best?"]


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_wire_api_conversations_reuse_their_tokens(
    reusing: Gateway, tokenizer: Any, api: str
) -> None:
    """Responses (openai SDK) and Messages (anthropic SDK, streamed) calls go through the chat
    path, so they are reused too."""
    rollout = reusing.rollout()
    history: list[dict[str, Any]] = []
    for question in QUESTIONS:
        history.append({"role": "user", "content": question})
        if api == "responses":
            response = rollout.sdk().responses.create(
                model="x",
                input=history,
                max_output_tokens=24,
                store=False,  # type: ignore[arg-type]
            )
            history += [item.model_dump(exclude_none=True) for item in response.output]
            continue
        import anthropic

        sdk = anthropic.Anthropic(
            base_url=f"{rollout.attempt_url}/anthropic", api_key=rollout.token, timeout=600
        )
        with sdk.messages.stream(
            model="x",
            max_tokens=24,
            messages=history,  # type: ignore[arg-type]
        ) as events:
            answer = events.get_final_message()
        text = "".join(block.text for block in answer.content if block.type == "text")
        history.append({"role": "assistant", "content": text})
    calls = rollout.calls()
    assert [call["kind"] for call in calls] == [api] * 3
    assert [call["token_reuse"] for call in calls] == ["none", "reused", "reused"]
    assert_chained(calls)
    assert sequences(calls, tokenizer) == (1, [])


@pytest.mark.parametrize("blank", [False, True], ids=["answer", "blank"])
def test_reused_logprobs_are_what_vllm_chat_shows(
    reusing: Gateway, vllm_server: VllmServer, tokenizer: Any, blank: bool
) -> None:
    """A reused call that asks for `top_logprobs` is shown the logprob entries vLLM's chat
    route shows for the same request: each token's text and its alternatives. `blank`: the
    end-of-turn token is biased up so that the answer is only that token, which the proxy shows
    no text of (derender is not asked to parse it)."""
    rollout = reusing.rollout(mode="val")
    model = vllm_server.served_model_name
    history: list[dict[str, Any]] = [{"role": "user", "content": QUESTIONS[0]}]
    first = ask(rollout.sdk(), model, history, stream=False, temperature=0)
    history += [first, {"role": "user", "content": QUESTIONS[1]}]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    asked: dict[str, Any] = {
        "temperature": 0,
        "max_tokens": 8,
        "logprobs": True,
        "top_logprobs": 2,
        **({"logit_bias": {str(end): 100}} if blank else {}),
    }
    answer = rollout.sdk().chat.completions.create(model=model, messages=history, **asked)
    recorded = rollout.calls()[1]
    assert recorded["token_reuse"] == "reused"
    direct = httpx.post(
        f"{vllm_server.base_url}/chat/completions",
        json={"model": model, "messages": history, "return_token_ids": True, **asked},
        timeout=120,
    ).json()
    (expected,) = direct["choices"]
    assert expected["token_ids"] == recorded["response_token_ids"]
    if blank:
        assert expected["token_ids"] == [end] and expected["message"]["content"] == ""
    (choice,) = answer.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    shown = [
        (entry.token, entry.bytes, [(top.token, top.bytes) for top in entry.top_logprobs])
        for entry in choice.logprobs.content
    ]
    wanted = [
        (
            entry["token"],
            entry["bytes"],
            [(top["token"], top["bytes"]) for top in entry["top_logprobs"]],
        )
        for entry in expected["logprobs"]["content"]
    ]
    assert shown == wanted
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    for entry, want in zip(choice.logprobs.content, expected["logprobs"]["content"], strict=True):
        assert entry.logprob == pytest.approx(want["logprob"], abs=1e-4)
