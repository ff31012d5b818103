"""Structured output on the embedded engine (`reins.engine.constraint`): `response_format` and a
forced `tool_choice` are enforced, as vLLM enforces them; the openai SDK is the client."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

import httpx
import pytest
import torch
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field

from reins.engine.constraint import format_grammar
from tests.embedded_support import FEW_SHOT_TOOL_USE, WEATHER_TOOL, ServedEngine
from tests.engine.test_embedded import complete

TRIP_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
JSON_QUESTION = 'Give the answer as JSON with a key "answer". What is 2+2?'
"""A question the default model answers with a short JSON object (seed 3)."""
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


STRICT_WEATHER_TOOL = {
    "type": "function",
    "function": {
        **WEATHER_TOOL["function"],
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
"""`get_weather` with a second required argument the few-shot history never shows."""


class Trip(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def client(served: ServedEngine) -> OpenAI:
    return OpenAI(base_url=served.base_url, api_key="unused", timeout=300, max_retries=0)


def test_a_json_schema_answer_follows_the_schema(embedded: ServedEngine) -> None:
    """The SDK's `parse` sends the model's schema (strict) and validates the answer with it."""
    answer = client(embedded).chat.completions.parse(
        model=embedded.name,
        messages=[{"role": "user", "content": "Plan a trip."}],
        response_format=Trip,
        max_tokens=80,
        n=4,
        seed=3,
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        trip = choice.message.parsed
        assert trip is not None and trip.city in {"Paris", "Rome", "Oslo"} and 1 <= trip.days <= 7
        assert json.loads(choice.message.content or "") == trip.model_dump()


def test_a_json_object_answer_is_one_json_object(embedded: ServedEngine) -> None:
    answer = client(embedded).chat.completions.create(
        model=embedded.name,
        messages=[{"role": "user", "content": JSON_QUESTION}],
        response_format={"type": "json_object"},
        max_tokens=80,
        n=4,
        seed=3,
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content or ""), dict)


def test_completions_take_a_response_format_too(embedded: ServedEngine) -> None:
    form = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP_SCHEMA}}
    answer = complete(embedded, "Trip:", max_tokens=80, seed=3, response_format=form)
    trip = Trip.model_validate_json(answer["choices"][0]["text"])
    assert answer["choices"][0]["finish_reason"] == "stop" and 1 <= trip.days <= 7


@pytest.mark.parametrize(
    ("structured", "follows"),
    [
        ({"choice": ["positive", "negative"]}, lambda text: text in {"positive", "negative"}),
        ({"regex": "[0-9]{3}-[0-9]{4}"}, lambda text: re.fullmatch("[0-9]{3}-[0-9]{4}", text)),
        ({"grammar": 'root ::= "yes" | "no"'}, lambda text: text in {"yes", "no"}),  # GBNF
        ({"grammar": 'start: "yes" | "no"'}, lambda text: text in {"yes", "no"}),  # Lark
        (
            {"json": TRIP_SCHEMA, "disable_any_whitespace": True},
            lambda text: (
                json.dumps(Trip.model_validate_json(text).model_dump(), separators=(",", ":"))
                == text
            ),
        ),
        ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
    ],
    ids=["choice", "regex", "gbnf", "lark", "json-compact", "json-object"],
)
def test_vllms_structured_outputs_field_is_followed(
    embedded: ServedEngine, structured: dict[str, Any], follows: Any
) -> None:
    """vLLM's own request field, as a client written for vLLM sends it."""
    answer = client(embedded).chat.completions.create(
        model=embedded.name,
        messages=[{"role": "user", "content": JSON_QUESTION}],
        max_tokens=80,
        seed=3,
        n=2,
        extra_body={"structured_outputs": structured},
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop" and follows(choice.message.content)
    prompt = f"{JSON_QUESTION}\nAnswer: "
    completion = complete(embedded, prompt, max_tokens=80, seed=3, structured_outputs=structured)
    assert completion["choices"][0]["finish_reason"] == "stop"
    assert follows(completion["choices"][0]["text"])


def test_a_named_tool_choice_is_one_call_of_that_tool(embedded: ServedEngine) -> None:
    answer = client(embedded).chat.completions.create(
        model=embedded.name,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        n=3,
        seed=2,
    )
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls or []
        assert [call.function.name for call in calls] == ["get_weather"]  # type: ignore[union-attr]
        arguments = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
        assert isinstance(arguments["city"], str)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_required_tool_choice_without_parallel_calls_is_one_call(
    embedded: ServedEngine, stream: bool
) -> None:
    body: dict[str, Any] = {
        "model": embedded.name,
        "messages": [{"role": "user", "content": "Hello"}],
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 80,
        "seed": 5,
    }
    openai = client(embedded)
    if stream:
        chunks = list(openai.chat.completions.create(**body, stream=True))
        names = [
            call.function.name
            for chunk in chunks
            for call in chunk.choices[0].delta.tool_calls or []
            if call.function and call.function.name
        ]
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = openai.chat.completions.create(**body).choices[0]
        names = [call.function.name for call in choice.message.tool_calls or []]  # type: ignore[union-attr]
        finish = choice.finish_reason
    assert finish == "tool_calls" and len(names) == 1 and names[0] in {"get_weather", "get_time"}


def test_with_tool_choice_auto_a_strict_tools_call_follows_its_schema(
    embedded: ServedEngine,
) -> None:
    """As vLLM does with a `strict` tool: the text is free, but a call the model opens must fit
    the schema. The few-shot history makes the model call `get_weather` with a city alone."""
    openai = client(embedded)

    def arguments(tool: dict[str, Any]) -> dict[str, Any]:
        answer = openai.chat.completions.create(
            model=embedded.name,
            messages=FEW_SHOT_TOOL_USE,  # type: ignore[arg-type]
            tools=[tool],  # type: ignore[list-item]
            max_tokens=60,
            temperature=0,
        )
        calls = answer.choices[0].message.tool_calls or []
        assert [call.function.name for call in calls] == ["get_weather"]  # type: ignore[union-attr]
        parsed: dict[str, Any] = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
        return parsed

    assert arguments(WEATHER_TOOL) == {"city": "Paris"}  # not strict: not constrained
    strict = arguments(STRICT_WEATHER_TOOL)
    assert strict["city"] == "Paris" and strict["unit"] in {"C", "F"} and len(strict) == 2

    # Text that opens no call is left as the model writes it: the chat answer is the greedy
    # completion of the same prompt, unconstrained.
    question = [{"role": "user", "content": "Tell me a joke."}]
    chat = openai.chat.completions.create(
        model=embedded.name,
        messages=question,  # type: ignore[arg-type]
        tools=[STRICT_WEATHER_TOOL],  # type: ignore[list-item]
        max_tokens=24,
        temperature=0,
    )
    rendered = httpx.post(
        f"{embedded.server.url}/tokenize",
        json={"messages": question, "tools": [STRICT_WEATHER_TOOL]},
        timeout=60,
    )
    free = complete(embedded, rendered.json()["tokens"], max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == free["choices"][0]["text"]


def test_the_reported_logprob_is_the_policys_own_not_the_masked_one(
    embedded: ServedEngine,
) -> None:
    """The grammar reshapes the draw; the logprob the trainer gets stays the policy's (as
    `logit_bias` leaves it: the same token forced that way reports the same number)."""
    constrained = complete(
        embedded,
        "The sea is",
        max_tokens=1,
        logprobs=0,
        seed=1,
        response_format={"type": "json_object"},
    )["choices"][0]
    token = constrained["token_ids"][0]
    logprob = constrained["logprobs"]["token_logprobs"][0]
    forced = complete(
        embedded, "The sea is", max_tokens=1, logprobs=0, logit_bias={str(token): 100}
    )["choices"][0]
    assert forced["token_ids"] == [token]
    # Under the mask the token would be likely (few tokens may open a JSON object).
    assert logprob < math.log(0.5)
    assert logprob == pytest.approx(forced["logprobs"]["token_logprobs"][0], abs=1e-4)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (
            {"response_format": {"type": "yaml"}},
            "text, json_object, json_schema or structural_tag, not 'yaml'",
        ),
        ({"response_format": {"type": "json_schema"}}, "json_schema` must be an object"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nosuchtype"}},
                }
            },
            "cannot be compiled",
        ),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "names the function 'f', which is not in `tools`",
        ),
        ({"tool_choice": "required"}, "`required` but no tool is given"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"function": "f"}}, "`tool_choice` must be"),
        (
            {"extra_body": {"structured_outputs": {"choice": ["a"], "regex": "b"}}},
            "takes exactly one of json, regex, choice, grammar, json_object, structural_tag; "
            "got regex, choice",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "("}}}, "unclosed group"),
        (
            {
                "response_format": {"type": "json_object"},
                "extra_body": {"structured_outputs": {"json_object": True}},
            },
            "`response_format` or `structured_outputs`, not both",
        ),
        *(
            ({"response_format": {"type": "structural_tag", **tag}}, says)
            for tag, says in [
                ({"format": {"type": "const_string", "value": "x"}}, "`format` form"),
                (
                    {"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<b"]},
                    "starts with none of the triggers",
                ),
                ({"structures": [], "triggers": ["<a"]}, "format.structures` must be a non-empty"),
                (
                    {"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": []},
                    "triggers` must",
                ),
            ]
        ),
    ],
    ids=[
        "unknown-type",
        "no-schema",
        "bad-schema",
        "unknown-function",
        "required-no-tools",
        "function-not-an-object",
        "two-kinds",
        "bad-regex",
        "both-fields",
        "tag-format-form",
        "tag-begin-without-trigger",
        "tag-no-structures",
        "tag-no-triggers",
    ],
)
def test_structured_output_that_cannot_be_followed_is_400(
    embedded: ServedEngine, fields: dict[str, Any], says: str
) -> None:
    with pytest.raises(BadRequestError) as refused:
        client(embedded).chat.completions.create(
            model=embedded.name,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            **fields,
        )
    assert says in str(refused.value)


TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "e", "schema": {"enum": [1, 2, 3]}, "end": "!"}],
    "triggers": ["e"],
}
"""After the answer's first "e": one of 1, 2, 3, then "!" (an English answer has an "e")."""


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": TAG},
        {"extra_body": {"structured_outputs": {"structural_tag": json.dumps(TAG)}}},
    ],
    ids=["response-format", "vllm-structured-outputs"],
)
def test_a_structural_tag_constrains_what_follows_its_trigger(
    embedded: ServedEngine, fields: dict[str, Any]
) -> None:
    """vLLM's structural tags (xgrammar's `structures` and `triggers`): free text until a
    trigger, then the structure it begins; free text again after its end."""

    def describe(**more: Any) -> str:
        answer = client(embedded).chat.completions.create(
            model=embedded.name,
            messages=[{"role": "user", "content": "Describe the weather in Paris in spring."}],
            max_tokens=40,
            temperature=0,
            **more,
        )
        return answer.choices[0].message.content or ""

    text, free = describe(**fields), describe()
    assert "e" in text, text
    assert re.match("e[123]!", text[text.index("e") :]), text
    assert free[: free.index("e")] == text[: text.index("e")]  # untouched up to the trigger


def test_a_structural_tag_holds_each_trigger_to_the_structures_it_begins(
    embedded: ServedEngine,
) -> None:
    """Two triggers, two structures behind one of them; any text between the tags."""
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tag = {
        "structures": [
            {"begin": "<function=get_weather>", "schema": weather, "end": "</function>"},
            {"begin": "<function=get_time>", "schema": {"type": "object"}, "end": "</function>"},
            {"begin": "<note>", "end": "</note>"},  # no schema: any JSON value
        ],
        "triggers": ["<function=", "<note>"],
    }
    grammar = format_grammar({"type": "structural_tag", **tag})
    assert grammar is not None
    tokenizer = embedded.engine.tokenizer

    def follows(text: str) -> bool:
        matcher = embedded.engine.grammars.matcher(grammar)
        for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
            if not bool(matcher.allowed(len(tokenizer))[token]):
                return False
            matcher.advance(token)
        return True

    assert follows('Sure. <function=get_weather>{"city": "Paris"}</function> and <note>[1]</note>.')
    assert follows("plain text only, no trigger")
    assert not follows('<function=get_weather>{"town": "Paris"}')  # the schema
    assert not follows("<function=get_date>{}")  # no structure begins so
    assert not follows('<function=get_time>{"a": 1}</fun>')  # the end


def test_responses_of_one_grammar_advance_apart(embedded: ServedEngine) -> None:
    """The compiled grammar is kept and copied: one response's tokens never move another."""
    grammars = embedded.engine.grammars
    grammar = format_grammar({"type": "json_object"})
    assert grammar is not None
    first, second = grammars.matcher(grammar), grammars.matcher(grammar)
    width = len(embedded.engine.tokenizer)
    opening = embedded.engine.tokenizer("{", add_special_tokens=False)["input_ids"]
    start = first.allowed(width)
    assert bool(start[opening[0]])
    first.advance(opening[0])
    assert torch.equal(second.allowed(width), start)
    assert not torch.equal(first.allowed(width), start)
    assert torch.equal(grammars.matcher(grammar).allowed(width), start)
