"""The proxy in front of a real vLLM server: what it records is exactly what vLLM sampled.

vLLM with the same seed samples the same tokens, so a direct call and a call through the proxy
(with the proxy's train sampling, temperature 1 and top_p 1) can be compared token for token.
The harness is the real `openai` SDK.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from reins.gateway import GatewaySettings
from tests.conftest import ADMIN_KEY, serve
from tests.vllm_support import VllmServer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

QUESTION = [{"role": "user", "content": "Name three colours."}]
SEED = 4321
TRAIN_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 24, "seed": SEED}


@dataclass
class Proxied:
    gateway_url: str
    admin: httpx.Client
    token: str

    @property
    def base_url(self) -> str:
        return f"{self.gateway_url}/proxy/rollout/r/attempt/1/mode/train/openai/v1"

    def calls(self) -> list[dict[str, Any]]:
        events = self.admin.get("/api/rollouts/r/events", params={"type": "model_request"})
        return [event["data"] for event in events.json()]


@pytest.fixture
def proxied(vllm_server: VllmServer, tmp_path: Path) -> Iterator[Proxied]:
    settings = GatewaySettings(database_url=str(tmp_path / "gateway.db"), api_key=ADMIN_KEY)
    with serve(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
        ) as admin:
            admin.post(
                "/api/models",
                json={
                    "model": vllm_server.served_model_name,
                    "endpoint": vllm_server.base_url,
                    "engine": "vllm",
                },
            ).raise_for_status()
            admin.post("/api/rollouts", json=[{"rollout_id": "r"}]).raise_for_status()
            token = admin.post("/api/rollouts/r/attempts").json()["token"]
            yield Proxied(url, admin, token)


def direct_chat(vllm_server: VllmServer) -> dict[str, Any]:
    response = httpx.post(
        f"{vllm_server.base_url}/chat/completions",
        json={
            "model": vllm_server.served_model_name,
            "messages": QUESTION,
            "return_token_ids": True,
            "logprobs": True,
            **TRAIN_SAMPLING,
        },
        timeout=120,
    )
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def test_recorded_call_is_what_vllm_sampled(
    vllm_server: VllmServer, proxied: Proxied, tokenizer: Any
) -> None:
    direct = direct_chat(vllm_server)
    client = openai.OpenAI(base_url=proxied.base_url, api_key=proxied.token, timeout=120)
    completion = client.chat.completions.create(
        model="whatever-the-harness-says",
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=24,
        seed=SEED,
    )
    (call,) = proxied.calls()
    expected = direct["choices"][0]
    assert call["prompt_token_ids"] == direct["prompt_token_ids"]
    assert call["response_token_ids"] == expected["token_ids"]
    assert call["response_logprobs"] == [c["logprob"] for c in expected["logprobs"]["content"]]
    text = completion.choices[0].message.content
    assert tokenizer.decode(call["response_token_ids"], skip_special_tokens=True) == text
    assert call["endpoint"] == vllm_server.base_url
    assert call["finish_reason"] == completion.choices[0].finish_reason


def test_recorded_stream_is_what_vllm_sampled(
    vllm_server: VllmServer, proxied: Proxied, tokenizer: Any
) -> None:
    direct = direct_chat(vllm_server)
    client = openai.OpenAI(base_url=proxied.base_url, api_key=proxied.token, timeout=120)
    pieces = []
    for chunk in client.chat.completions.create(
        model="x",
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=24,
        seed=SEED,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    (call,) = proxied.calls()
    expected = direct["choices"][0]
    assert call["stream"] is True
    assert call["prompt_token_ids"] == direct["prompt_token_ids"]
    assert call["response_token_ids"] == expected["token_ids"]
    assert call["response_logprobs"] == [c["logprob"] for c in expected["logprobs"]["content"]]
    streamed = "".join(pieces)
    assert tokenizer.decode(call["response_token_ids"], skip_special_tokens=True) == streamed
    assert call["response"]["choices"][0]["message"]["content"] == streamed


def test_completions_with_token_ids_through_the_proxy(
    vllm_server: VllmServer, proxied: Proxied, tokenizer: Any
) -> None:
    prompt = tokenizer("The sky is", add_special_tokens=False)["input_ids"]
    client = openai.OpenAI(base_url=proxied.base_url, api_key=proxied.token, timeout=120)
    completion = client.completions.create(model="x", prompt=prompt, max_tokens=8, seed=SEED)
    (call,) = proxied.calls()
    assert call["prompt_token_ids"] == prompt
    assert len(call["response_logprobs"]) == len(call["response_token_ids"])
    decoded = tokenizer.decode(call["response_token_ids"], skip_special_tokens=True)
    assert decoded == completion.choices[0].text
