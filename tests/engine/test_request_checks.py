"""Requests OpenAI or vLLM refuse are refused here too (400, saying what is wrong), and vLLM's
`min_tokens` is honoured (it was accepted and ignored)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.embedded_support import ServedEngine
from tests.engine.test_embedded import assert_openai_error, chat, complete, post

HI = [{"role": "user", "content": "Say hi."}]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "`top_logprobs` needs `logprobs: true`"),
        ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role is 'robot'"),
        ({"tools": [{"type": "function"}]}, 'tools[0] must be {"type": "function"'),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function needs a `name`"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens (5) must not be more than max_tokens (4)"),
        ({"stream_options": {"include_usage": True}}, "`stream_options` can only be set with"),
        # OpenAI's deprecated fields were ignored: the model answered as if offered no function.
        ({"functions": [{"name": "f"}]}, "`functions` (OpenAI's deprecated fields) are not"),
        ({"function_call": "auto"}, "give the functions as `tools`"),
        ({"repetition_penalty": 0}, "repetition_penalty"),  # vLLM: must be greater than zero
    ],
    ids=[
        *("top-logprobs-21", "top-logprobs-alone", "role", "no-function", "no-name"),
        *("min-over-max", "stream-options-alone", "functions", "function-call"),
        "repetition-penalty-0",
    ],
)
def test_a_request_openai_refuses_is_400(
    embedded: ServedEngine, fields: dict[str, Any], says: str
) -> None:
    body = {"model": embedded.name, "messages": HI, "max_tokens": 4, **fields}
    assert_openai_error(post(embedded, "/chat/completions", body), 400, says)


def test_top_logprobs_with_logprobs_is_served(embedded: ServedEngine) -> None:
    answer = chat(embedded, HI, max_tokens=3, logprobs=True, top_logprobs=2)
    assert len(answer["choices"][0]["logprobs"]["content"]) == len(
        answer["choices"][0]["token_ids"]
    )


def test_min_tokens_holds_the_end_back(embedded: ServedEngine) -> None:
    free = chat(embedded, HI, max_tokens=64, temperature=0)["choices"][0]
    assert free["finish_reason"] == "stop"
    ends = embedded.engine.eos_token_ids
    assert free["token_ids"][-1] in ends
    least = len(free["token_ids"]) + 4
    held = chat(embedded, HI, max_tokens=64, temperature=0, min_tokens=least)["choices"][0]
    assert len(held["token_ids"]) >= least
    assert not set(held["token_ids"][: least - 1]) & ends
    # The tokens before the first end are the greedy answer's, unchanged.
    assert held["token_ids"][: len(free["token_ids"]) - 1] == free["token_ids"][:-1]


def test_the_legacy_function_role_reads_as_a_tool_result(embedded: ServedEngine) -> None:
    def rendered(role: str) -> list[int]:
        messages = [*HI, {"role": "assistant", "content": "Hi"}, {"role": role, "content": "42"}]
        response = httpx.post(
            f"{embedded.server.url}/tokenize", json={"messages": messages}, timeout=60
        )
        assert response.status_code == 200, response.text
        tokens: list[int] = response.json()["tokens"]
        return tokens

    assert rendered("function") == rendered("tool")


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"prompt": "hi", "max_tokens": 2, "stop": "\\ud800"}', "no low surrogate"),
        (b'{"prompt": "hi", "max_tokens": 2, "x": ' + b"[" * 1500 + b"]" * 1500 + b"}", "depth"),
        (b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', "expected a JSON value"),
    ],
    ids=["surrogate-stop", "deep", "nan"],
)
def test_a_body_python_reads_but_no_answer_can_carry_is_400(
    embedded: ServedEngine, raw: bytes, says: str
) -> None:
    """A lone surrogate in a stop string was a 500 for every request prefilled with it (the
    stop check encodes it); ~1,000 nested brackets were a bare 500 (Python's reader recursed)."""
    response = httpx.post(
        f"{embedded.base_url}/completions",
        content=raw.replace(b"{", b'{"model": "' + embedded.name.encode() + b'", ', 1),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert_openai_error(response, 400, says)
    assert complete(embedded, "hi", max_tokens=1)["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("key", ["²", "١٢", "-1", "x"])
def test_a_logit_bias_key_that_is_not_an_ascii_token_id_is_400(
    embedded: ServedEngine, key: str
) -> None:
    """`str.isdigit` is true of "²" (then `int` failed: a bare 500) and of other scripts' digits
    ("١٢" was read as token 12)."""
    body = {"model": embedded.name, "prompt": "Hi", "max_tokens": 2, "logit_bias": {key: 1}}
    assert_openai_error(post(embedded, "/completions", body), 400, f"logit_bias: {key!r}")


def test_a_text_part_without_text_is_400(embedded: ServedEngine) -> None:
    """`str(None)` put "None" into the prompt."""
    content = [{"type": "text", "text": "Hi"}, {"type": "text", "text": None}]
    body = {"model": embedded.name, "messages": [{"role": "user", "content": content}]}
    assert_openai_error(post(embedded, "/chat/completions", {**body, "max_tokens": 2}), 400, "text")


def test_a_grammar_that_ends_before_min_tokens_fails_only_its_request(
    embedded: ServedEngine,
) -> None:
    """Once the grammar allows only the end, `min_tokens` masked that too: every token masked,
    the sampler indexed past the vocabulary and the whole batch failed (500); greedy, token 0
    was taken and the grammar refused it (500). Now that request alone is a 400."""
    for temperature in (1.0, 0.0):
        bad = {
            "model": embedded.name,
            "prompt": "Pick:",
            "max_tokens": 6,
            "min_tokens": 4,
            "temperature": temperature,
            "structured_outputs": {"choice": ["a"]},
        }
        normal = {"model": embedded.name, "prompt": "Once upon a time", "max_tokens": 24}
        normal["temperature"] = 0
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(post, embedded, "/completions", normal)
            refused = post(embedded, "/completions", bad)
            kept = running.result()
        assert_openai_error(refused, 400, "no token may come next")
        assert "min_tokens (4)" in refused.json()["error"]["message"]
        assert kept.status_code == 200, kept.text


def test_a_grammar_that_cannot_be_followed_is_400(embedded: ServedEngine) -> None:
    body = {"model": embedded.name, "prompt": "x", "max_tokens": 4}
    response = post(
        embedded, "/completions", {**body, "structured_outputs": {"grammar": "start: start"}}
    )
    assert_openai_error(response, 400, "structured output failed")


def test_a_stream_whose_grammar_fails_ends_in_a_400_error_then_done(embedded: ServedEngine) -> None:
    """As vLLM ends a stream that failed: its error event, then `[DONE]`."""
    body = {
        "model": embedded.name,
        "prompt": "x",
        "max_tokens": 4,
        "stream": True,
        "structured_outputs": {"grammar": "start: start"},
    }
    with httpx.stream("POST", f"{embedded.base_url}/completions", json=body, timeout=60) as answer:
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == (400, "BadRequestError")
    assert "structured output failed" in error["message"]


def test_repetition_penalty_decodes_as_transformers_generate(embedded: ServedEngine) -> None:
    """vLLM's `repetition_penalty` over the prompt and the response (it was accepted and
    ignored): greedy, the answer is transformers' `generate` with the same penalty; the logprobs
    reported are the policy's own, as for the other penalties."""
    import torch

    prompt = embedded.tokenizer("the cat sat on the mat and the cat sat on the")["input_ids"]
    answer = complete(
        embedded, prompt, max_tokens=12, temperature=0, repetition_penalty=1.8, logprobs=0
    )
    tokens = answer["choices"][0]["token_ids"]
    free = complete(embedded, prompt, max_tokens=12, temperature=0)["choices"][0]["token_ids"]
    assert tokens != free  # the penalty changed the answer
    model = embedded.engine.model
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            repetition_penalty=1.8,
            max_new_tokens=12,
        )[0, len(prompt) :].tolist()
        policy = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    assert tokens == expected[: len(tokens)] and len(tokens) > 0
    reported = answer["choices"][0]["logprobs"]["token_logprobs"]
    for position, (token, logprob) in enumerate(zip(tokens, reported, strict=True)):
        assert logprob == pytest.approx(float(policy[len(prompt) + position - 1, token]), abs=1e-3)


def test_a_completion_suffix_is_400(embedded: ServedEngine) -> None:
    """OpenAI's insertion `suffix` was ignored (a plain continuation answered it); vLLM
    refuses it."""
    body = {"model": embedded.name, "prompt": "def f(", "suffix": "\n    return x", "max_tokens": 4}
    assert_openai_error(post(embedded, "/completions", body), 400, "`suffix` is not supported")
