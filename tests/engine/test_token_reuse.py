"""Token reuse at the engine (`reins_prefix_token_ids`, docs/proxy.md): a chat prompt continues an
earlier call's prompt + response token IDs exactly when the messages' rendering starts with their
text, and is rendered as usual otherwise.

The scripted engine (tests/engine/test_fidelity.py: the default model's real tokenizer and
template, a tiny model made to say a script) samples ` b|ros|per`, which the tokenizer re-encodes
as ` bro|s|per`: the case that splits a rollout as `retokenized` without reuse.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from reins.engine.api import TOKEN_REUSE_HEADER
from reins.engine.chat import extend_prompt
from reins.engine.prepare import prepare_default_model
from tests.embedded_support import ServedEngine
from tests.engine.test_fidelity import QUESTION, ids, rendered, say, scripted, split_reasons

__all__ = ["scripted"]  # the fixture, imported for this module's tests

SAMPLED = [278, 4066, 456]
"""` b`, `ros`, `per`: ` brosper`, which the tokenizer encodes as ` bro`, `s`, `per`."""


def script(served: ServedEngine) -> list[int]:
    return ids(served, "A") + SAMPLED


def post(served: ServedEngine, messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    body = {"model": served.name, "messages": messages, "temperature": 0, **fields}
    return httpx.post(f"{served.base_url}/chat/completions", json=body, timeout=120)


def answered(response: httpx.Response) -> tuple[list[int], list[int], str]:
    """(prompt IDs, response IDs, content) of a chat answer."""
    assert response.status_code == 200, response.text
    payload = response.json()
    (choice,) = payload["choices"]
    return payload["prompt_token_ids"], choice["token_ids"], choice["message"]["content"]


def first_turn(served: ServedEngine) -> tuple[list[int], list[int], list[dict[str, Any]]]:
    """The first call (answered ` brosper`), and the history of the next one."""
    say(served, QUESTION, script(served))
    prompt, response, content = answered(post(served, QUESTION))
    assert response[: len(SAMPLED) + 1] == script(served)
    history = [
        *QUESTION,
        {"role": "assistant", "content": content},
        {"role": "user", "content": "And then?"},
    ]
    return prompt, response, history


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(prepare_default_model())


def template(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def test_extend_prompt_keeps_the_prefix_and_tokenizes_only_the_rest(tokenizer: Any) -> None:
    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens, skip_special_tokens=False))

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    head = encode(template(tokenizer, QUESTION)) + SAMPLED + [tokenizer.eos_token_id]
    history = [*QUESTION, {"role": "assistant", "content": " brosper"}]
    text = template(tokenizer, [*history, {"role": "user", "content": "And then?"}])
    extended = extend_prompt(head, text, decode, encode)
    assert extended is not None
    assert extended[: len(head)] == head
    assert decode(extended) == text
    assert extended[len(head) :] == encode(text[len(decode(head)) :])
    assert encode(text) != extended  # the template's own tokens re-encode ` brosper`


def test_extend_prompt_refuses_a_text_that_does_not_start_with_the_prefix(tokenizer: Any) -> None:
    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens, skip_special_tokens=False))

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    head = encode(template(tokenizer, QUESTION)) + SAMPLED
    edited = [*QUESTION, {"role": "assistant", "content": " brother"}]
    text = template(tokenizer, [*edited, {"role": "user", "content": "And then?"}])
    assert extend_prompt(head, text, decode, encode) is None
    assert extend_prompt([], text, decode, encode) is None


def test_without_reuse_the_next_turn_splits_as_retokenized(scripted: ServedEngine) -> None:
    prompt, response, history = first_turn(scripted)
    response_headers = post(scripted, history).headers
    assert TOKEN_REUSE_HEADER not in response_headers
    assert split_reasons(
        scripted, {"prompt_token_ids": prompt, "token_ids": response}, rendered(scripted, history)
    ) == ["retokenized"]


def test_a_prefix_the_rendering_continues_is_kept_token_for_token(scripted: ServedEngine) -> None:
    prompt, response, history = first_turn(scripted)
    answer = post(scripted, history, reins_prefix_token_ids=prompt + response)
    assert answer.headers[TOKEN_REUSE_HEADER] == "reused"
    next_prompt, _, _ = answered(answer)
    assert next_prompt[: len(prompt) + len(response)] == prompt + response
    text = scripted.tokenizer.decode(next_prompt, skip_special_tokens=False)
    assert text == template(scripted.tokenizer, history)
    assert next_prompt != rendered(scripted, history)
    assert (
        split_reasons(scripted, {"prompt_token_ids": prompt, "token_ids": response}, next_prompt)
        == []
    )


def test_a_changed_history_falls_back_to_the_rendering(scripted: ServedEngine) -> None:
    prompt, response, history = first_turn(scripted)
    history[1] = {"role": "assistant", "content": "A brother"}  # the harness edited the answer
    answer = post(scripted, history, reins_prefix_token_ids=prompt + response)
    assert answer.headers[TOKEN_REUSE_HEADER] == "fallback"
    assert answered(answer)[0] == rendered(scripted, history)


def test_an_answer_cut_by_max_tokens_is_continued_after_its_last_sampled_token(
    scripted: ServedEngine,
) -> None:
    say(scripted, QUESTION, script(scripted))
    payload = post(scripted, QUESTION, max_tokens=3).json()
    prompt, response = payload["prompt_token_ids"], payload["choices"][0]["token_ids"]
    assert payload["choices"][0]["finish_reason"] == "length"
    assert response == script(scripted)[:3]  # no end-of-turn sampled
    content = payload["choices"][0]["message"]["content"]
    history = [
        *QUESTION,
        {"role": "assistant", "content": content},
        {"role": "user", "content": "Go on."},
    ]
    answer = post(scripted, history, reins_prefix_token_ids=prompt + response)
    assert answer.headers[TOKEN_REUSE_HEADER] == "reused"
    next_prompt = answered(answer)[0]
    head = len(prompt) + len(response)
    assert next_prompt[:head] == prompt + response
    assert next_prompt[head] == scripted.tokenizer.eos_token_id  # the template's end of turn
    text = scripted.tokenizer.decode(next_prompt, skip_special_tokens=False)
    assert text == template(scripted.tokenizer, history)


def test_prefix_token_ids_outside_the_vocabulary_are_refused(scripted: ServedEngine) -> None:
    answer = post(scripted, QUESTION, reins_prefix_token_ids=[1, 10**9])
    assert answer.status_code == 400
    assert "reins_prefix_token_ids" in answer.json()["error"]["message"]
