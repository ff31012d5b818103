"""Request fields of vLLM's or OpenAI's that change the answer are honoured or refused by name:
the engine accepted and ignored them, and a client took an unconstrained or unscored answer
for one that followed them."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.embedded_support import FEW_SHOT_TOOL_USE, WEATHER_TOOL, ServedEngine
from tests.engine.test_embedded import assert_openai_error, chat, complete, post, stream_chunks

HI = [{"role": "user", "content": "Say hi."}]

REFUSED = [
    ({"best_of": 3}, "`best_of` is not supported"),
    ({"use_beam_search": True}, "`use_beam_search` is not supported"),
    ({"prompt_logprobs": 0}, "`prompt_logprobs` is not supported"),
    ({"ignore_eos": True}, "`ignore_eos` is not supported"),
    ({"bad_words": ["no"]}, "`bad_words` is not supported"),
    ({"allowed_token_ids": [1, 2]}, "`allowed_token_ids` is not supported"),
    ({"logits_processors": ["my.Processor"]}, "`logits_processors` is not supported"),
    ({"truncate_prompt_tokens": 2}, "`truncate_prompt_tokens` is not supported"),
    ({"guided_whitespace_pattern": " "}, "`guided_whitespace_pattern` is not supported"),
    ({"prompt_embeds": "AAAA"}, "`prompt_embeds` is not supported"),
    ({"documents": [{"text": "x"}]}, "`documents` is not supported"),
    ({"modalities": ["text", "audio"]}, "`modalities` is not supported"),
    ({"web_search_options": {}}, None),  # an empty object asks for nothing
    ({"web_search_options": {"search_context_size": "low"}}, "`web_search_options` is not"),
    (
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
        "`stream_options.continuous_usage_stats` is not supported",
    ),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "not `guided_json` and `guided_"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "`structured_outputs` together"),
]


@pytest.mark.parametrize("route", ["/chat/completions", "/completions"])
@pytest.mark.parametrize(("fields", "says"), REFUSED, ids=[str(f) for f, _ in REFUSED])
def test_a_field_that_would_change_the_answer_is_400_naming_it(
    embedded: ServedEngine, route: str, fields: dict[str, Any], says: str | None
) -> None:
    prompt = {"messages": HI} if route == "/chat/completions" else {"prompt": "Hi"}
    body = {"model": embedded.name, **prompt, "max_tokens": 2, **fields}
    response = post(embedded, route, body)
    if says is None:
        assert response.status_code == 200, response.text
    else:
        assert_openai_error(response, 400, says)


def test_chat_echo_is_400_naming_it(embedded: ServedEngine) -> None:
    body = {"model": embedded.name, "messages": HI, "max_tokens": 2, "echo": True}
    assert_openai_error(post(embedded, "/chat/completions", body), 400, "`echo` is not supported")


def test_fields_that_change_nothing_are_taken(embedded: ServedEngine) -> None:
    """What a client sends about itself, or asks in a form that changes nothing, is served."""
    fields = {
        "user": "u-1",
        "metadata": {"run": "a"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "best_of": 2,
        "n": 2,  # best_of as many as n: every one sampled is returned
        "modalities": ["text"],
        "skip_special_tokens": True,
        "guided_decoding_backend": "llguidance",
        "echo": False,
    }
    plain = chat(embedded, HI, max_tokens=4, temperature=0, n=2)
    taken = chat(embedded, HI, max_tokens=4, temperature=0, **fields)
    assert [c["token_ids"] for c in taken["choices"]] == [c["token_ids"] for c in plain["choices"]]


GUIDED = [
    ("guided_choice", ["sunny", "rainy"], {"choice": ["sunny", "rainy"]}),
    ("guided_regex", "[0-9]{3}-[a-z]{2}", {"regex": "[0-9]{3}-[a-z]{2}"}),
    (
        "guided_json",
        json.dumps(
            {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            }
        ),
        {
            "json": {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            }
        },
    ),
    ("guided_grammar", 'start: "yes" | "no"', {"grammar": 'start: "yes" | "no"'}),
]


@pytest.mark.parametrize(("name", "value", "structured"), GUIDED, ids=[g[0] for g in GUIDED])
def test_vllms_guided_fields_constrain_as_structured_outputs(
    embedded: ServedEngine, name: str, value: Any, structured: dict[str, Any]
) -> None:
    """vLLM's older `guided_*` fields were ignored: the answer was free text."""
    question = [{"role": "user", "content": "What is the weather? Answer briefly."}]
    for route in ("chat", "completions"):
        if route == "chat":
            guided = chat(embedded, question, max_tokens=40, seed=5, **{name: value})
            same = chat(embedded, question, max_tokens=40, seed=5, structured_outputs=structured)
            text = guided["choices"][0]["message"]["content"]
        else:
            guided = complete(embedded, "Weather:", max_tokens=40, seed=5, **{name: value})
            same = complete(
                embedded, "Weather:", max_tokens=40, seed=5, structured_outputs=structured
            )
            text = guided["choices"][0]["text"]
        assert guided["choices"][0]["token_ids"] == same["choices"][0]["token_ids"]
        if name == "guided_json":  # JSON may hold any whitespace: the tiny model writes much
            assert text.lstrip().startswith("{"), text
            continue
        assert guided["choices"][0]["finish_reason"] == "stop", text
        if name == "guided_choice":
            assert text in value
        elif name == "guided_regex":
            assert re.fullmatch(value, text), text
        else:
            assert text in ("yes", "no")


def test_a_guided_json_that_is_not_json_is_400(embedded: ServedEngine) -> None:
    body = {"model": embedded.name, "messages": HI, "guided_json": "{not json"}
    assert_openai_error(post(embedded, "/chat/completions", body), 400, "`guided_json` is not a")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_end_the_answer(embedded: ServedEngine, stream: bool) -> None:
    """vLLM's `stop_token_ids` were ignored: the answer went on past them."""
    free = complete(embedded, "The sea is", max_tokens=8, temperature=0)["choices"][0]
    stop = free["token_ids"][3]
    first = free["token_ids"].index(stop)
    body = {
        "model": embedded.name,
        "prompt": "The sea is",
        "max_tokens": 8,
        "temperature": 0,
        "stop_token_ids": [stop],
    }
    if stream:
        chunks = stream_chunks(embedded, "/completions", {**body, "stream": True})
        ids = [i for c in chunks for i in c["choices"][0]["token_ids"]]
        last = chunks[-1]["choices"][0]
        text = "".join(c["choices"][0]["text"] for c in chunks)
    else:
        last = complete(embedded, **{k: v for k, v in body.items() if k != "model"})["choices"][0]
        ids, text = last["token_ids"], last["text"]
    assert ids == free["token_ids"][:first]
    assert text == embedded.engine.decode(free["token_ids"][:first])
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    too_big = {**body, "stop_token_ids": [len(embedded.tokenizer)]}
    assert_openai_error(post(embedded, "/completions", too_big), 400, "stop_token_ids must be in")


@pytest.mark.slow
def test_a_tool_call_cut_before_its_end_is_no_tool_call(embedded: ServedEngine) -> None:
    """Cut by `max_tokens` one token before its `</tool_call>`, the call is not answered as a
    call (its JSON may be whole): the text stays content, finish `length`, streamed or not."""
    whole = chat(embedded, FEW_SHOT_TOOL_USE, tools=[WEATHER_TOOL], temperature=0, max_tokens=32)
    ids = whole["choices"][0]["token_ids"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    closed = next(
        n for n in range(1, len(ids) + 1) if "</tool_call>" in embedded.engine.decode(ids[:n])
    )
    cut_text = embedded.engine.decode(ids[: closed - 1])
    body = {"tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": closed - 1}
    choice = chat(embedded, FEW_SHOT_TOOL_USE, **body)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == cut_text
    request = {"model": embedded.name, "messages": FEW_SHOT_TOOL_USE, **body, "stream": True}
    chunks = stream_chunks(embedded, "/chat/completions", request)
    assert not [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == cut_text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_return_tokens_as_token_ids_names_each_token_by_its_id(embedded: ServedEngine) -> None:
    """vLLM's `return_tokens_as_token_ids` was ignored: tokens were named by their text, which
    does not say which token it was (two tokens may show the same text)."""
    fields = {"max_tokens": 4, "temperature": 0, "return_tokens_as_token_ids": True}
    answer = chat(embedded, HI, logprobs=True, top_logprobs=2, **fields)["choices"][0]
    entries = answer["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in answer["token_ids"]]
    assert all(a["token"].startswith("token_id:") for e in entries for a in e["top_logprobs"])
    completion = complete(embedded, "The sea is", logprobs=2, **fields)["choices"][0]
    named = [f"token_id:{t}" for t in completion["token_ids"]]
    assert completion["logprobs"]["tokens"] == named
    assert all(
        name in top for name, top in zip(named, completion["logprobs"]["top_logprobs"], strict=True)
    )
    plain = complete(embedded, "The sea is", logprobs=0, max_tokens=4, temperature=0)["choices"][0]
    assert plain["logprobs"]["tokens"][0] == embedded.engine.token_texts.text(plain["token_ids"][0])
