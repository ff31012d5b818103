"""Capture fidelity (issue #13): the token IDs an answer returns (what the proxy records) decode to
exactly what the harness was shown, and the harness's next prompt, rendered from what it was shown,
starts with the recorded prompt + response, so the rollout merges into one training sequence.

Fast tests use a tiny random Llama with the default model's real tokenizer and chat template, made
to say a script: at each step its real logits get a large bonus on the next scripted token (then
end-of-turn), so what it samples is known while the engine runs for real (scheduler, sampler,
stop detection, API, streaming). The slow tests use the real default model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from reins.engine.api import create_engine_app
from reins.engine.chat import SampledTurns, parse_tool_calls
from reins.engine.embedded import EmbeddedEngine
from reins.gateway.capture import CallFacts, answer_and_records
from reins.samples import Call, merge_calls
from reins.serving import BackgroundServer
from tests.embedded_support import FEW_SHOT_TOOL_USE, WEATHER_TOOL, ServedEngine
from tests.tiny_model import default_tokenizer, tiny_llama

SCRIPT_BONUS = 1e4
"""Added to the scripted token's logit: greedy decoding picks it, and its logprob is ~0."""
REACT_STOPS = ["Observation:", "\n\n"]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


class ScriptedLlama(LlamaForCausalLM):
    """A Llama whose next token is dictated by `script`: `(prompt length, token IDs)`. The step of
    a row is read from its position (`position - prompt length + 1`); past the script it ends its
    turn (EOS)."""

    script: tuple[int, list[int]] | None = None
    end_token: int = 2

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        out = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        if self.script is not None and position_ids is not None:
            length, tokens = self.script
            for row, position in enumerate(position_ids[:, -1].tolist()):
                step = position + 1 - length
                token = tokens[step] if 0 <= step < len(tokens) else self.end_token
                out.logits[row, -1, token] += SCRIPT_BONUS
        return out


@pytest.fixture(scope="module")
def scripted() -> Iterator[ServedEngine]:
    tokenizer = default_tokenizer()
    model = tiny_llama(tokenizer, model_class=ScriptedLlama).eval()
    model.end_token = tokenizer.eos_token_id
    engine = EmbeddedEngine(model, tokenizer, name="scripted", prefix_cache_gb=0)
    server = BackgroundServer(create_engine_app(engine)).start()
    try:
        yield ServedEngine(engine, server)
    finally:
        server.stop()
        engine.close()


# -- helpers ----------------------------------------------------------------------------------


def ids(served: ServedEngine, text: str) -> list[int]:
    return list(served.tokenizer(text, add_special_tokens=False)["input_ids"])


def rendered(served: ServedEngine, messages: list[dict[str, Any]], **fields: Any) -> list[int]:
    """The prompt token IDs a chat call with these messages consumes (the engine's /tokenize)."""
    body = {"model": served.name, "messages": messages, **fields}
    response = httpx.post(f"{served.server.url}/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


def say(
    served: ServedEngine, messages: list[dict[str, Any]], script: list[int], **fields: Any
) -> None:
    """Makes the scripted model answer these messages with `script`."""
    tools = {"tools": fields["tools"]} if "tools" in fields else {}
    prompt = rendered(served, messages, **tools)
    served.engine.model.script = (len(prompt), script)


def chat(served: ServedEngine, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """A non-streamed greedy chat answer, as `{content, tool_calls, token_ids, logprobs,
    finish_reason, stop_reason, prompt_token_ids, usage}`."""
    body = {"model": served.name, "messages": messages, "temperature": 0, **fields}
    response = httpx.post(f"{served.base_url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    (choice,) = answer["choices"]
    return {
        "content": choice["message"]["content"],
        "tool_calls": choice["message"].get("tool_calls") or [],
        "token_ids": choice["token_ids"],
        "logprobs": [item["logprob"] for item in choice["logprobs"]["content"]],
        "finish_reason": choice["finish_reason"],
        "stop_reason": choice.get("stop_reason"),
        "prompt_token_ids": answer["prompt_token_ids"],
        "usage": answer["usage"],
    }


def streamed_chat(
    served: ServedEngine, messages: list[dict[str, Any]], **fields: Any
) -> dict[str, Any]:
    """The same answer streamed, its chunks assembled as a harness would."""
    body = {
        "model": served.name,
        "messages": messages,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **fields,
    }
    out: dict[str, Any] = {"content": "", "tool_calls": [], "token_ids": [], "logprobs": []}
    url = f"{served.base_url}/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "prompt_token_ids" in chunk:
                out["prompt_token_ids"] = chunk["prompt_token_ids"]
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                delta = choice["delta"]
                out["content"] += delta.get("content") or ""
                out["tool_calls"] += delta.get("tool_calls") or []
                out["token_ids"] += choice.get("token_ids") or []
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                out["logprobs"] += [item["logprob"] for item in logprobs]
                if choice.get("finish_reason"):
                    out["finish_reason"] = choice["finish_reason"]
                    out["stop_reason"] = choice.get("stop_reason")
    out["content"] = out["content"] or None
    return out


def calls_of(answer: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in answer["tool_calls"]
    ]


def split_reasons(
    served: ServedEngine, answer: dict[str, Any], next_prompt: list[int]
) -> list[str]:
    """Why the next call would not merge with this answer's call ([] when it merges)."""
    first = Call(prompt=answer["prompt_token_ids"], response=answer["token_ids"], seq=1)
    second = Call(prompt=next_prompt, response=[served.tokenizer.eos_token_id], seq=2)
    decode = served.tokenizer.decode
    _, splits = merge_calls([first, second], decode=lambda tokens: decode(tokens.tolist()))
    return [split.reason for split in splits]


def tool_turn(answer: dict[str, Any], result: str) -> list[dict[str, Any]]:
    """The assistant message a harness builds from a tool-call answer, then the tool's result."""
    assistant = {
        "role": "assistant",
        "content": answer["content"],
        "tool_calls": [
            {"id": c["id"], "type": "function", "function": c["function"]}
            for c in answer["tool_calls"]
        ],
    }
    results = [
        {"role": "tool", "tool_call_id": c["id"], "content": result} for c in answer["tool_calls"]
    ]
    return [assistant, *results]


# -- 1. stop strings --------------------------------------------------------------------------

REACT = "Thought: I need the weather.\nAction: get_weather[Paris]\nObservation: sunny\n\nDone."


def test_a_stop_string_ends_the_response_in_text_and_token_ids(scripted: ServedEngine) -> None:
    say(scripted, QUESTION, ids(scripted, REACT))
    answer = chat(scripted, QUESTION, stop=REACT_STOPS)
    shown = "Thought: I need the weather.\nAction: get_weather[Paris]\n"
    assert answer["content"] == shown
    assert scripted.engine.decode(answer["token_ids"]) == shown
    assert answer["token_ids"] == ids(scripted, REACT)[: len(answer["token_ids"])]
    assert len(answer["logprobs"]) == len(answer["token_ids"])
    assert (answer["finish_reason"], answer["stop_reason"]) == ("stop", "Observation:")


def test_the_turn_after_a_stop_string_merges(scripted: ServedEngine) -> None:
    say(scripted, QUESTION, ids(scripted, REACT))
    answer = chat(scripted, QUESTION, stop=REACT_STOPS)
    history = [
        *QUESTION,
        {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": "Observation: sunny"},
    ]
    assert split_reasons(scripted, answer, rendered(scripted, history)) == []


def test_a_stop_string_that_starts_inside_a_token_ends_before_that_token(
    scripted: ServedEngine,
) -> None:
    # `Observation` is sampled as `Obs` + `ervation`: the stop `bservation:` starts inside `Obs`,
    # so the text ends where the last token before the stop ends (vLLM would show the `O`).
    say(scripted, QUESTION, ids(scripted, REACT))
    answer = chat(scripted, QUESTION, stop=["bservation:"])
    assert answer["content"] == "Thought: I need the weather.\nAction: get_weather[Paris]\n"
    assert scripted.engine.decode(answer["token_ids"]) == answer["content"]
    assert answer["stop_reason"] == "bservation:"


def test_a_streamed_stop_answer_equals_the_non_streamed_one(scripted: ServedEngine) -> None:
    say(scripted, QUESTION, ids(scripted, REACT))
    answer = chat(scripted, QUESTION, stop=REACT_STOPS)
    streamed = streamed_chat(scripted, QUESTION, stop=REACT_STOPS)
    for key in ("content", "token_ids", "logprobs", "finish_reason", "stop_reason"):
        assert streamed[key] == answer[key], key


def test_a_stop_string_in_a_completion_ends_text_and_token_ids(scripted: ServedEngine) -> None:
    prompt = ids(scripted, "Question: the weather in Paris?\n")
    scripted.engine.model.script = (len(prompt), ids(scripted, REACT))
    body = {"model": scripted.name, "prompt": prompt, "temperature": 0, "stop": REACT_STOPS}
    response = httpx.post(f"{scripted.base_url}/completions", json=body, timeout=120)
    (choice,) = response.json()["choices"]
    assert choice["text"] == "Thought: I need the weather.\nAction: get_weather[Paris]\n"
    assert scripted.engine.decode(choice["token_ids"]) == choice["text"]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])


# -- 4. special tokens sampled mid-answer -------------------------------------------------------


def special_script(served: ServedEngine) -> list[int]:
    im_start = served.tokenizer.convert_tokens_to_ids("<|im_start|>")
    return [*ids(served, "It is sunny."), im_start, *ids(served, "user\nThanks")]


def test_a_special_token_mid_answer_ends_the_response(scripted: ServedEngine) -> None:
    say(scripted, QUESTION, special_script(scripted))
    answer = chat(scripted, QUESTION)
    assert answer["content"] == "It is sunny."
    assert answer["token_ids"] == ids(scripted, "It is sunny.")
    assert (answer["finish_reason"], answer["stop_reason"]) == ("stop", 1)
    streamed = streamed_chat(scripted, QUESTION)
    assert (streamed["content"], streamed["token_ids"]) == (answer["content"], answer["token_ids"])


def test_the_turn_after_a_special_token_merges(scripted: ServedEngine) -> None:
    say(scripted, QUESTION, special_script(scripted))
    answer = chat(scripted, QUESTION)
    history = [
        *QUESTION,
        {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": "Thanks"},
    ]
    assert split_reasons(scripted, answer, rendered(scripted, history)) == []


# -- 2. tool calls ------------------------------------------------------------------------------

TOOL_ANSWER = f"I will check the weather.\n<tool_call>\n{CALL_JSON}\n</tool_call>"


def test_streamed_and_non_streamed_tool_call_answers_are_the_same(scripted: ServedEngine) -> None:
    eos = scripted.tokenizer.eos_token_id
    say(scripted, QUESTION, [*ids(scripted, TOOL_ANSWER), eos], tools=[WEATHER_TOOL])
    answer = chat(scripted, QUESTION, tools=[WEATHER_TOOL])
    streamed = streamed_chat(scripted, QUESTION, tools=[WEATHER_TOOL])
    assert answer["content"] == streamed["content"] == "I will check the weather."
    assert calls_of(answer) == calls_of(streamed) == [("get_weather", {"city": "Paris"})]
    assert answer["token_ids"] == streamed["token_ids"] == [*ids(scripted, TOOL_ANSWER), eos]
    assert answer["finish_reason"] == streamed["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize(
    "sampled",
    [
        TOOL_ANSWER,
        f"<tool_call>\n\n{CALL_JSON}\n</tool_call>",  # a blank line
        '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',  # compact
        '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',
    ],
    ids=["engine-format", "blank-line", "compact-json", "arguments-first"],
)
def test_a_tool_call_turn_sent_back_by_the_harness_merges(
    scripted: ServedEngine, sampled: str, stream: bool
) -> None:
    eos = scripted.tokenizer.eos_token_id
    say(scripted, QUESTION, [*ids(scripted, sampled), eos], tools=[WEATHER_TOOL])
    answer = (streamed_chat if stream else chat)(scripted, QUESTION, tools=[WEATHER_TOOL])
    assert calls_of(answer) == [("get_weather", {"city": "Paris"})]
    history = [*QUESTION, *tool_turn(answer, "sunny, 21 C")]
    next_prompt = rendered(scripted, history, tools=[WEATHER_TOOL])
    assert split_reasons(scripted, answer, next_prompt) == []


def test_a_harness_that_reserializes_the_arguments_still_merges(scripted: ServedEngine) -> None:
    eos = scripted.tokenizer.eos_token_id
    say(scripted, QUESTION, [*ids(scripted, TOOL_ANSWER), eos], tools=[WEATHER_TOOL])
    answer = chat(scripted, QUESTION, tools=[WEATHER_TOOL])
    for call in answer["tool_calls"]:  # e.g. a framework that parsed and re-dumped them
        arguments = json.loads(call["function"]["arguments"])
        call["function"]["arguments"] = json.dumps(arguments, separators=(",", ":"))
    history = [*QUESTION, *tool_turn(answer, "sunny")]
    assert split_reasons(scripted, answer, rendered(scripted, history, tools=[WEATHER_TOOL])) == []


def test_a_changed_tool_call_is_rendered_as_the_harness_sent_it(scripted: ServedEngine) -> None:
    eos = scripted.tokenizer.eos_token_id
    say(scripted, QUESTION, [*ids(scripted, TOOL_ANSWER), eos], tools=[WEATHER_TOOL])
    answer = chat(scripted, QUESTION, tools=[WEATHER_TOOL])
    answer["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "Lyon"})
    history = [*QUESTION, *tool_turn(answer, "rain")]
    prompt = scripted.tokenizer.decode(rendered(scripted, history, tools=[WEATHER_TOOL]))
    assert '"city": "Lyon"' in prompt and "Paris" not in prompt.split("<|im_start|>assistant")[1]


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_text_after_the_last_tool_call_ends_the_turn(scripted: ServedEngine, stream: bool) -> None:
    sampled = f"<tool_call>\n{CALL_JSON}\n</tool_call>"
    script = ids(scripted, sampled + "\nIt will be sunny, I think. Let me know.")
    say(scripted, QUESTION, script, tools=[WEATHER_TOOL])
    answer = (streamed_chat if stream else chat)(scripted, QUESTION, tools=[WEATHER_TOOL])
    assert scripted.engine.decode(answer["token_ids"]) == sampled
    assert answer["content"] is None
    assert calls_of(answer) == [("get_weather", {"city": "Paris"})]
    assert answer["finish_reason"] == "tool_calls"
    # Generation ended there: the rest of the script was never sampled.
    assert answer["usage"]["completion_tokens"] < len(script)


def test_parallel_tool_calls_stay_one_turn(scripted: ServedEngine) -> None:
    eos = scripted.tokenizer.eos_token_id
    lyon = CALL_JSON.replace("Paris", "Lyon")
    sampled = f"<tool_call>\n{CALL_JSON}\n</tool_call>\n<tool_call>\n{lyon}\n</tool_call>"
    say(scripted, QUESTION, [*ids(scripted, sampled), eos], tools=[WEATHER_TOOL])
    answer = chat(scripted, QUESTION, tools=[WEATHER_TOOL])
    assert calls_of(answer) == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Lyon"}),
    ]
    assert answer["token_ids"] == [*ids(scripted, sampled), eos]


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_parallel_tool_calls_false_ends_the_turn_at_the_first_call(
    scripted: ServedEngine, stream: bool
) -> None:
    """OpenAI and vLLM answer `parallel_tool_calls: false` with one call at most (langchain's
    `with_structured_output(method="function_calling")` sends it): the first `</tool_call>`
    ends the response, in what is shown and in the token IDs the proxy records."""
    eos = scripted.tokenizer.eos_token_id
    first = f"<tool_call>\n{CALL_JSON}\n</tool_call>"
    lyon = CALL_JSON.replace("Paris", "Lyon")
    script = [*ids(scripted, f"{first}\n<tool_call>\n{lyon}\n</tool_call>"), eos]
    say(scripted, QUESTION, script, tools=[WEATHER_TOOL])
    fields = {"tools": [WEATHER_TOOL], "parallel_tool_calls": False}
    answer = (streamed_chat if stream else chat)(scripted, QUESTION, **fields)
    assert calls_of(answer) == [("get_weather", {"city": "Paris"})]
    assert scripted.engine.decode(answer["token_ids"]) == first
    assert (answer["finish_reason"], answer["stop_reason"]) == ("tool_calls", "</tool_call>")
    # Generation ended there: the second call was never sampled.
    assert answer["usage"]["completion_tokens"] < len(script)


def test_tool_call_content_leaves_out_only_the_whitespace_around_the_calls() -> None:
    content, calls = parse_tool_calls(f"  Let me see.\n\n<tool_call>\n{CALL_JSON}\n</tool_call>\n")
    assert (content, len(calls)) == ("  Let me see.", 1)
    assert parse_tool_calls(f"<tool_call>{CALL_JSON}</tool_call>")[0] is None


def test_sampled_turns_forget_the_least_recently_used_answer() -> None:
    turns = SampledTurns(capacity=2)
    answers = []
    for city in ("Paris", "Lyon", "Nice"):
        text = f"<tool_call>{CALL_JSON.replace('Paris', city)}</tool_call>"
        content, calls = parse_tool_calls(text)
        turns.remember(text, content, calls)
        answers.append((text, {"role": "assistant", "content": content, "tool_calls": calls}))
        if city == "Lyon":  # Paris is used again: Lyon is now the oldest
            assert turns.recall(answers[0][1]) == answers[0][0]
    assert [turns.recall(message) for _, message in answers] == [answers[0][0], None, answers[2][0]]


def test_sampled_turns_do_not_recall_an_answer_with_other_content() -> None:
    turns = SampledTurns()
    text = f"I will check.\n<tool_call>{CALL_JSON}</tool_call>"
    content, calls = parse_tool_calls(text)
    turns.remember(text, content, calls)
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    assert turns.recall({**message, "content": f"  {content}\n"}) == text
    assert turns.recall({**message, "content": None}) is None


# -- what is recorded ---------------------------------------------------------------------------


def test_the_record_keeps_the_stop_reason(scripted: ServedEngine) -> None:
    say(scripted, QUESTION, ids(scripted, REACT))
    body = {"model": scripted.name, "messages": QUESTION, "temperature": 0, "stop": REACT_STOPS}
    payload = httpx.post(f"{scripted.base_url}/chat/completions", json=body, timeout=120).json()
    facts = CallFacts(
        kind="chat",
        mode="train",
        request=body,
        model=scripted.name,
        endpoint=scripted.base_url,
        model_version=0,
        latency_s=0.1,
        stream=False,
    )
    _, (record,) = answer_and_records(facts, payload)
    assert record.finish_reason == "stop"
    assert record.model_dump()["stop_reason"] == "Observation:"
    content = record.response["choices"][0]["message"]["content"]
    assert scripted.engine.decode(record.response_token_ids) == content


# -- the real default model (slow) ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_a_real_tool_call_turn_merges(embedded: ServedEngine, stream: bool) -> None:
    answer = (streamed_chat if stream else chat)(
        embedded, FEW_SHOT_TOOL_USE, tools=[WEATHER_TOOL], max_tokens=40
    )
    assert calls_of(answer) == [("get_weather", {"city": "Paris"})]
    content, _ = parse_tool_calls(embedded.engine.decode(answer["token_ids"]))
    assert content == answer["content"]
    history = [*FEW_SHOT_TOOL_USE, *tool_turn(answer, "sunny")]
    next_prompt = rendered(embedded, history, tools=[WEATHER_TOOL])
    assert split_reasons(embedded, answer, next_prompt) == []


@pytest.mark.slow
def test_a_real_stop_string_turn_merges(embedded: ServedEngine) -> None:
    question = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    unstopped = chat(embedded, question, max_tokens=30)
    text = unstopped["content"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # two characters from the middle
    assert stop and stop.strip(), text
    answer = chat(embedded, question, max_tokens=30, stop=[stop])
    assert embedded.engine.decode(answer["token_ids"]) == answer["content"]
    assert text.startswith(answer["content"]) and stop not in answer["content"]
    history = [
        *question,
        {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": "Go on."},
    ]
    assert split_reasons(embedded, answer, rendered(embedded, history)) == []
    assert np.array_equal(unstopped["token_ids"][: len(answer["token_ids"])], answer["token_ids"])
