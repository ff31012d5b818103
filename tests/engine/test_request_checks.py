"""Requests OpenAI or vLLM refuse are refused here too (400, saying what is wrong), and vLLM's
`min_tokens` is honoured (it was accepted and ignored)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.embedded_support import ServedEngine
from tests.engine.test_embedded import assert_openai_error, chat, post

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
    ],
    ids=["top-logprobs-21", "top-logprobs-alone", "role", "no-function", "no-name", "min-over-max"],
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
