"""The embedded engine (the real default model, SmolLM2-135M-Instruct, in float32) behind its
OpenAI API: batching never changes what is sampled, logprobs are the policy's own, sampling
settings, streaming, tools, weight updates and errors. Nothing is stubbed.

Generations are kept short (a few to a few dozen tokens); the tests that take more than a few
seconds on two cores (several generations, long few-shot prompts, a second engine) are marked
`slow` and run with `make test`.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from reins.engine.api import WEIGHT_VERSION_HEADER, create_engine_app
from reins.engine.chat import (
    TOOL_CALL_OPEN,
    parse_tool_calls,
    prepare_messages,
    template_knows_tools,
)
from reins.engine.embedded import EmbeddedEngine, Token
from reins.engine.prepare import prepare_default_model
from reins.engine.sampling import SamplingParams
from reins.engine.scheduler import Sequence
from reins.serving import BackgroundServer
from tests.embedded_support import (
    FEW_SHOT_TOOL_USE,
    WEATHER_TOOL,
    ServedEngine,
    served_engine,
    weather_call,
)

COUNTING = "Counting: 1, 2, 3,"
"""Greedy decoding continues it with ` 4, 5, 6, 7, ...` and does not end early."""
PROMPTS = [
    COUNTING,
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
]
OPEN_QUESTION = [{"role": "user", "content": "Write a short poem about the sea."}]

# -- helpers ----------------------------------------------------------------------------------


def post(served: ServedEngine, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{served.base_url}{route}", json=body, timeout=300)


def complete(served: ServedEngine, prompt: str | list[int], **fields: Any) -> dict[str, Any]:
    response = post(served, "/completions", {"model": served.name, "prompt": prompt, **fields})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def chat(served: ServedEngine, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    body = {"model": served.name, "messages": messages, **fields}
    response = post(served, "/chat/completions", body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def stream_chunks(served: ServedEngine, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"{served.base_url}{route}", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def ids(served: ServedEngine, text: str) -> list[int]:
    return list(served.tokenizer(text, add_special_tokens=False)["input_ids"])


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


async def generate_tokens(
    engine: EmbeddedEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    tokens: list[int] = []
    async for item in engine.generate(prompt_ids, [params]):
        if isinstance(item, Token):
            tokens.append(item.token_id)
            if on_token is not None:
                on_token(len(tokens))
    return tokens


def recomputed_logits(engine: EmbeddedEngine, prompt: list[int], response: list[int]) -> Any:
    """Logits that predicted each response token, from one plain forward pass (no cache)."""
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt + response[:-1]])).logits[0].float()
    return logits[len(prompt) - 1 :]


def wait_until(condition: Callable[[], bool], timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# -- batching ---------------------------------------------------------------------------------


@pytest.mark.slow
async def test_batched_greedy_output_equals_one_at_a_time(embedded: ServedEngine) -> None:
    engine = embedded.engine
    prompts = [ids(embedded, text) for text in PROMPTS]
    alone = [await generate_tokens(engine, prompt, greedy(10)) for prompt in prompts]
    steps_before = engine.scheduler.steps
    together = await asyncio.gather(*(generate_tokens(engine, p, greedy(10)) for p in prompts))
    assert list(together) == alone
    # They shared decode steps: one at a time would take one step per token after the first.
    assert engine.scheduler.steps - steps_before < sum(len(t) - 1 for t in alone)


@pytest.mark.slow
async def test_a_request_joining_a_running_batch_gets_its_one_at_a_time_output(
    embedded: ServedEngine,
) -> None:
    engine = embedded.engine
    first, second = ids(embedded, PROMPTS[0]), ids(embedded, PROMPTS[2])
    first_alone = await generate_tokens(engine, first, greedy(16))
    second_alone = await generate_tokens(engine, second, greedy(8))

    running = asyncio.Event()
    first_task = asyncio.create_task(
        generate_tokens(engine, first, greedy(16), lambda n: n == 4 and running.set())
    )
    await running.wait()
    assert engine.scheduler.load()[0] == 1  # the first request is mid-generation
    second_joined = await generate_tokens(engine, second, greedy(8))
    assert await first_task == first_alone
    assert second_joined == second_alone


def test_a_prefill_that_fails_fails_only_its_own_request(embedded: ServedEngine) -> None:
    """A sequence that cannot be prefilled (an empty prompt: the API refuses one, the scheduler
    cannot run it) ends with an error; the batch it tried to join goes on as if it never came."""
    scheduler = embedded.engine.scheduler
    prompt = ids(embedded, PROMPTS[0])
    ends: dict[str, tuple[str | None, str | None]] = {}
    done = {"running": threading.Event(), "broken": threading.Event()}

    def finish(name: str) -> Callable[[str | None, str | None], None]:
        def on_finish(reason: str | None, error: str | None) -> None:
            ends[name] = (reason, error)
            done[name].set()

        return on_finish

    broken = Sequence([], greedy(4), lambda *_: None, finish("broken"))
    alone = asyncio.run(generate_tokens(embedded.engine, prompt, greedy(16)))
    tokens: list[int] = []

    def on_token(token: int, *_: object) -> None:
        tokens.append(token)
        if len(tokens) == 4:  # on the engine's thread, mid-generation: it joins at the next step
            scheduler.submit(broken)

    scheduler.submit(Sequence(prompt, greedy(16), on_token, finish("running")))
    assert all(event.wait(60) for event in done.values())
    assert ends["running"] == ("length", None)
    assert tokens == alone
    reason, error = ends["broken"]
    assert reason is None and error is not None and "prefill failed" in error


def test_a_row_whose_logits_are_nan_fails_alone(embedded: ServedEngine) -> None:
    scheduler = embedded.engine.scheduler
    ended: list[tuple[str | None, str | None]] = []
    sequences = [
        Sequence([1, 2], greedy(4), lambda *_: None, lambda *end: ended.append(end))
        for _ in range(2)
    ]
    logits = torch.zeros(2, 100)
    logits[0, 3] = float("nan")
    logits[1, 42] = 5.0
    scheduler._sample(sequences, logits)
    assert sequences[0].finish_reason == "error" and sequences[0].output_ids == []
    assert "NaN or infinite" in (sequences[0].error or "")
    assert sequences[1].output_ids == [42] and sequences[1].finish_reason is None


def test_an_empty_prompt_is_400(embedded: ServedEngine) -> None:
    for prompt in ("", [""]):
        response = post(embedded, "/completions", {"model": embedded.name, "prompt": prompt})
        assert_openai_error(response, 400, "the prompt is empty")


@pytest.mark.parametrize("prompt", [[True, 2], [1.0, 2], [[1, False]], [[1, 2.5]]])
def test_token_ids_that_are_not_integers_are_400(embedded: ServedEngine, prompt: Any) -> None:
    """Not read as IDs 1, 0, 2 (pydantic's lax mode would)."""
    response = post(embedded, "/completions", {"model": embedded.name, "prompt": prompt})
    assert_openai_error(response, 400, "prompt")


@pytest.mark.parametrize("value", ["false", 0, None])
def test_tokenize_takes_add_generation_prompt_as_a_boolean_only(
    embedded: ServedEngine, value: Any
) -> None:
    body = {"messages": OPEN_QUESTION, "add_generation_prompt": value}
    response = httpx.post(f"{embedded.server.url}/tokenize", json=body, timeout=60)
    assert_openai_error(response, 400, "`add_generation_prompt` must be true or false")
    without = {"messages": OPEN_QUESTION, "add_generation_prompt": False}
    with_prompt = {"messages": OPEN_QUESTION, "add_generation_prompt": True}
    counts = [
        httpx.post(f"{embedded.server.url}/tokenize", json=b, timeout=60).json()["count"]
        for b in (without, with_prompt)
    ]
    assert counts[0] < counts[1]


def test_a_temperature_too_small_to_divide_by_is_greedy(embedded: ServedEngine) -> None:
    prompt = ids(embedded, "The capital of France is")
    tiny = complete(embedded, prompt, temperature=1e-45, max_tokens=6, logprobs=0)
    zero = complete(embedded, prompt, temperature=0, max_tokens=6, logprobs=0)
    assert tiny["choices"][0]["token_ids"] == zero["choices"][0]["token_ids"]
    assert tiny["choices"][0]["logprobs"] == zero["choices"][0]["logprobs"]


# -- logprobs and sampling --------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_models_logits_at_temperature_1(
    embedded: ServedEngine,
) -> None:
    prompt = ids(embedded, "The weather today is")
    answer = complete(embedded, prompt, temperature=1.0, seed=11, max_tokens=8, logprobs=0)
    choice = answer["choices"][0]
    logits = recomputed_logits(embedded.engine, prompt, choice["token_ids"])
    expected = torch.log_softmax(logits, dim=-1)[
        range(len(choice["token_ids"])), choice["token_ids"]
    ]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected.tolist(), abs=1e-4)


def test_logprobs_at_a_temperature_are_untruncated_by_top_p(embedded: ServedEngine) -> None:
    prompt = ids(embedded, "Once upon a time")
    temperature, top_p = 0.7, 0.5
    answer = complete(
        embedded,
        prompt,
        temperature=temperature,
        top_p=top_p,
        seed=5,
        max_tokens=12,
        logprobs=0,
    )
    choice = answer["choices"][0]
    tokens, reported = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    logprobs = torch.log_softmax(
        recomputed_logits(embedded.engine, prompt, tokens) / temperature, -1
    )
    positions = range(len(tokens))
    assert reported == pytest.approx(logprobs[positions, tokens].tolist(), abs=1e-4)

    # Each token was drawn from the nucleus, whose renormalised logprob is not what is reported.
    sorted_probs, order = logprobs.exp().sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    truncated = []
    for row, token in enumerate(tokens):
        nucleus = order[row][mass_before[row] < top_p].tolist()
        assert token in nucleus
        kept_mass = float(logprobs[row, nucleus].exp().sum())
        truncated.append(float(logprobs[row, token]) - math.log(kept_mass))
    assert max(abs(a - b) for a, b in zip(reported, truncated, strict=True)) > 1e-3


def test_greedy_logprobs_are_those_of_temperature_1(embedded: ServedEngine) -> None:
    prompt = ids(embedded, COUNTING)
    choice = complete(embedded, prompt, temperature=0, max_tokens=6, logprobs=0)["choices"][0]
    logits = recomputed_logits(embedded.engine, prompt, choice["token_ids"])
    assert choice["token_ids"] == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)[range(6), choice["token_ids"]]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected.tolist(), abs=1e-4)


@pytest.mark.slow
def test_same_seed_samples_the_same_tokens(embedded: ServedEngine) -> None:
    def sample(seed: int) -> list[int]:
        answer = chat(embedded, OPEN_QUESTION, temperature=1.0, seed=seed, max_tokens=12)
        tokens: list[int] = answer["choices"][0]["token_ids"]
        return tokens

    first = sample(123)
    assert sample(123) == first
    assert sample(124) != first


@pytest.mark.slow
async def test_a_seeded_request_samples_the_same_tokens_in_a_batch(embedded: ServedEngine) -> None:
    engine = embedded.engine
    prompt = ids(embedded, PROMPTS[2])
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=99)
    alone = await generate_tokens(engine, prompt, seeded)
    unseeded = SamplingParams(temperature=1.0, max_tokens=12)
    in_batch, *_ = await asyncio.gather(
        generate_tokens(engine, prompt, seeded),
        *(generate_tokens(engine, ids(embedded, text), unseeded) for text in PROMPTS[:3]),
    )
    assert in_batch == alone


def test_text_stops_before_a_stop_string(embedded: ServedEngine) -> None:
    unstopped = complete(embedded, COUNTING, temperature=0, max_tokens=20)["choices"][0]
    assert unstopped["text"].startswith(" 4, 5, 6, 7, 8,")
    choice = complete(embedded, COUNTING, temperature=0, max_tokens=20, stop=["7,", "never"])
    stopped = choice["choices"][0]
    assert stopped["text"] == " 4, 5, 6, "
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", "7,")
    # The response's token IDs are those of the text shown: the stop string's are left out.
    assert embedded.engine.decode(stopped["token_ids"]) == " 4, 5, 6, "
    assert stopped["token_ids"] == unstopped["token_ids"][: len(stopped["token_ids"])]


STARS = "★★★★★★★★"
"""Greedy decoding continues it with `☆☆☆...`: 3 UTF-8 bytes and 3 tokens per star."""


def test_a_stop_string_of_multi_byte_characters_ends_generation(embedded: ServedEngine) -> None:
    assert len(ids(embedded, "☆☆")) > len("☆☆") + 2  # more tokens than characters
    answer = complete(embedded, STARS, temperature=0, max_tokens=24, stop=["☆☆"])
    choice = answer["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("", "stop", "☆☆")


def test_usage_counts_the_tokens_returned_not_those_sampled_past_a_stop(
    embedded: ServedEngine,
) -> None:
    body = {
        "model": embedded.name,
        "prompt": STARS,
        "temperature": 0,
        "max_tokens": 24,
        "stop": ["☆☆", "7,"],
        "n": 2,
    }
    for prompt in (STARS, COUNTING):
        answer = complete(embedded, **{**body, "prompt": prompt})
        returned = sum(len(c["token_ids"]) for c in answer["choices"])
        assert answer["usage"]["completion_tokens"] == returned
        assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] + returned
        stream = {**body, "prompt": prompt, "stream": True}
        chunks = stream_chunks(
            embedded, "/completions", {**stream, "stream_options": {"include_usage": True}}
        )
        streamed = sum(len(c["token_ids"]) for chunk in chunks for c in chunk["choices"])
        assert streamed == returned and chunks[-1]["usage"]["completion_tokens"] == returned
        # A stream holds back a character that may start the stop string, multi-byte ones too.
        texts = [
            "".join(c["text"] for ch in chunks for c in ch["choices"] if c["index"] == i)
            for i in range(2)
        ]
        assert texts == [c["text"] for c in answer["choices"]]


def test_max_tokens_ends_with_finish_reason_length(embedded: ServedEngine) -> None:
    answer = complete(embedded, COUNTING, temperature=0, max_tokens=5)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 5
    assert answer["usage"]["completion_tokens"] == 5


# -- streaming --------------------------------------------------------------------------------


def test_streamed_chat_equals_the_non_streamed_answer(embedded: ServedEngine) -> None:
    body = {
        "model": embedded.name,
        "messages": OPEN_QUESTION,
        "temperature": 1.0,
        "seed": 77,
        "max_tokens": 16,
        "logprobs": True,
    }
    response = post(embedded, "/chat/completions", body)
    assert response.status_code == 200
    whole = response.json()
    chunks = stream_chunks(
        embedded,
        "/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    expected = whole["choices"][0]
    with_choices = [c for c in chunks if c["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in with_choices)
    token_ids = [t for c in with_choices for t in c["choices"][0]["token_ids"]]
    logprobs = [
        item["logprob"]
        for c in with_choices
        if c["choices"][0]["logprobs"]
        for item in c["choices"][0]["logprobs"]["content"]
    ]
    assert text == expected["message"]["content"]
    assert token_ids == expected["token_ids"]
    # Equal within float32 noise: the streamed call reuses the first one's KV (prefix cache).
    expected_logprobs = [item["logprob"] for item in expected["logprobs"]["content"]]
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert with_choices[-1]["choices"][0]["finish_reason"] == expected["finish_reason"]
    # The streamed call may reuse the first one's KV (prefix cache): all else in usage is equal.
    details = "prompt_tokens_details"
    assert {**chunks[-1]["usage"], details: None} == {**whole["usage"], details: None}


def test_streamed_text_never_shows_the_stop_string(embedded: ServedEngine) -> None:
    body = {"model": embedded.name, "prompt": COUNTING, "temperature": 0, "max_tokens": 20}
    chunks = stream_chunks(embedded, "/completions", {**body, "stop": "7,", "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == " 4, 5, 6, "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# -- prompts ----------------------------------------------------------------------------------


def test_completions_take_a_token_id_prompt(embedded: ServedEngine) -> None:
    prompt = ids(embedded, "The capital of France is")
    choice = complete(embedded, prompt, temperature=0, max_tokens=4)["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert choice["text"] == embedded.engine.decode(choice["token_ids"])
    assert (
        choice["text"]
        == complete(embedded, "The capital of France is", temperature=0, max_tokens=4)["choices"][
            0
        ]["text"]
    )


def test_chat_prompt_is_the_models_own_chat_template(embedded: ServedEngine) -> None:
    answer = chat(embedded, OPEN_QUESTION, temperature=0, max_tokens=2)
    rendered = embedded.tokenizer.apply_chat_template(
        OPEN_QUESTION, add_generation_prompt=True, tokenize=False
    )
    assert answer["prompt_token_ids"] == ids(embedded, rendered)
    assert rendered.endswith("<|im_start|>assistant\n")


PREFILLED = [
    {"role": "user", "content": "Name a fruit."},
    {"role": "assistant", "content": "The fruit I name is"},
]


def test_continue_final_message_continues_the_assistants_prefill(embedded: ServedEngine) -> None:
    """vLLM's `continue_final_message` (with `add_generation_prompt: false`) was ignored: the
    prefill was closed and a new assistant turn answered after it."""
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    answer = chat(embedded, PREFILLED, temperature=0, max_tokens=3, **fields)
    rendered = (
        "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\nThe fruit I name is"
    )
    assert embedded.tokenizer.decode(answer["prompt_token_ids"]).endswith(rendered)
    counted = httpx.post(
        f"{embedded.server.url}/tokenize", json={"messages": PREFILLED, **fields}, timeout=60
    )
    assert counted.json()["tokens"] == answer["prompt_token_ids"]
    closed = chat(embedded, PREFILLED, temperature=0, max_tokens=3, add_generation_prompt=False)
    assert embedded.tokenizer.decode(closed["prompt_token_ids"]).endswith(
        "The fruit I name is<|im_end|>\n"
    )
    both = post(
        embedded, "/chat/completions", {"messages": PREFILLED, "continue_final_message": True}
    )
    assert_openai_error(both, 400, "`continue_final_message: true` needs `add_generation_prompt")


THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
)
"""Qwen3's switch, as its chat template reads it: `enable_thinking: false` opens the answer with
an empty thought."""


@pytest.fixture(scope="module")
def thinking() -> Iterator[ServedEngine]:
    """A tiny random Llama whose tokenizer has `THINKING_TEMPLATE` as its chat template and
    adds a BOS (`<|endoftext|>`) when asked for special tokens, as Llama's tokenizers do."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.bos_token = "<|endoftext|>"
    tokenizer.add_bos_token = True
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    engine = EmbeddedEngine(LlamaForCausalLM(config).eval(), tokenizer, name="thinking")
    server = BackgroundServer(create_engine_app(engine)).start()
    yield ServedEngine(engine, server)
    server.stop()
    engine.close()


def test_chat_template_kwargs_reach_the_chat_template(thinking: ServedEngine) -> None:
    """vLLM's `chat_template_kwargs` (Qwen3's `enable_thinking: false`) was ignored: the model
    was prompted to think whatever the harness asked."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    answer = chat(thinking, OPEN_QUESTION, max_tokens=2, **off)
    text = thinking.tokenizer.decode(answer["prompt_token_ids"])
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    counted = httpx.post(
        f"{thinking.server.url}/tokenize", json={"messages": OPEN_QUESTION, **off}, timeout=60
    )
    assert counted.json()["tokens"] == answer["prompt_token_ids"]
    plain = chat(thinking, OPEN_QUESTION, max_tokens=2)
    assert thinking.tokenizer.decode(plain["prompt_token_ids"]).endswith("assistant\n")
    body = {"messages": OPEN_QUESTION, "chat_template_kwargs": {"tokenize": True}}
    refused = post(thinking, "/chat/completions", body)
    assert_openai_error(refused, 400, "`chat_template_kwargs` may not set 'tokenize'")
    # A template of the request's own was ignored too: refused, as vLLM refuses it by default.
    own = {"messages": OPEN_QUESTION, "chat_template": "{{ messages[0]['content'] }}"}
    assert_openai_error(post(thinking, "/chat/completions", own), 400, "not taken")


def test_a_text_prompt_gets_its_special_tokens_as_vllm_adds_them(thinking: ServedEngine) -> None:
    """vLLM's `add_special_tokens` (true by default for a text completion, false for a chat,
    whose template writes its own) was ignored: a text prompt never had its tokenizer's BOS."""
    bos, text = thinking.tokenizer.bos_token_id, ids(thinking, "Once upon a time")
    completed = complete(thinking, "Once upon a time", max_tokens=1)
    assert completed["choices"][0]["prompt_token_ids"] == [bos, *text]
    bare = complete(thinking, "Once upon a time", max_tokens=1, add_special_tokens=False)
    assert bare["choices"][0]["prompt_token_ids"] == text
    counted = httpx.post(
        f"{thinking.server.url}/tokenize", json={"prompt": "Once upon a time"}, timeout=60
    )
    assert counted.json()["tokens"] == [bos, *text]
    plain = chat(thinking, OPEN_QUESTION, max_tokens=1)["prompt_token_ids"]
    assert plain[0] != bos
    marked = chat(thinking, OPEN_QUESTION, max_tokens=1, add_special_tokens=True)
    assert marked["prompt_token_ids"] == [bos, *plain]


# -- tools ------------------------------------------------------------------------------------


def test_default_template_ignores_tools_so_the_engine_describes_them() -> None:
    template = (prepare_default_model() / "chat_template.jinja").read_text()
    assert not template_knows_tools(template)
    messages = prepare_messages(
        [{"role": "user", "content": "Weather in Paris?"}], [WEATHER_TOOL], native_tools=False
    )
    assert messages[0]["role"] == "system"
    assert "<tools>" in messages[0]["content"]
    assert json.dumps(WEATHER_TOOL) in messages[0]["content"]
    assert TOOL_CALL_OPEN in messages[0]["content"]


def test_tool_calls_and_results_in_the_history_are_written_in_the_hermes_form() -> None:
    messages = prepare_messages(
        [
            {"role": "user", "content": "Weather in Rome?"},
            weather_call("Rome", "call_1"),
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        ],
        [WEATHER_TOOL],
        native_tools=False,
    )
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        "</tool_call>",
    }
    assert messages[3] == {"role": "user", "content": "<tool_response>\nSunny\n</tool_response>"}


def test_a_tool_call_block_in_the_text_becomes_tool_calls() -> None:
    content, calls = parse_tool_calls(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>"
    )
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


def test_a_tool_call_block_that_is_not_json_stays_text() -> None:
    text = "<tool_call>get_weather(Paris)</tool_call>"
    assert parse_tool_calls(text) == (text, [])


def test_tools_are_described_in_the_rendered_prompt(embedded: ServedEngine) -> None:
    question = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = chat(embedded, question, tools=[WEATHER_TOOL], temperature=0, max_tokens=1)
    without = chat(embedded, question, temperature=0, max_tokens=1)
    prompt = embedded.tokenizer.decode(with_tools["prompt_token_ids"])
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert "<tools>" not in embedded.tokenizer.decode(without["prompt_token_ids"])


@pytest.mark.slow
def test_a_generated_tool_call_is_answered_as_tool_calls(embedded: ServedEngine) -> None:
    answer = chat(embedded, FEW_SHOT_TOOL_USE, tools=[WEATHER_TOOL], temperature=0, max_tokens=32)
    choice = answer["choices"][0]
    assert TOOL_CALL_OPEN in embedded.engine.decode(choice["token_ids"])
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.slow
def test_a_tool_call_answer_cut_by_max_tokens_finishes_with_length(embedded: ServedEngine) -> None:
    """The calls sampled before the limit are answered, but the turn is `length`, not
    `tool_calls`: it was cut (a second call may be cut short in the text), and the Responses and
    Messages translations then say `incomplete` and `max_tokens` (a probe with the anthropic SDK
    got `stop_reason: tool_use` with half a call as text)."""
    whole = chat(embedded, FEW_SHOT_TOOL_USE, tools=[WEATHER_TOOL], temperature=0, max_tokens=32)
    ids = whole["choices"][0]["token_ids"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    closed = next(
        n for n in range(1, len(ids) + 1) if "</tool_call>" in embedded.engine.decode(ids[:n])
    )
    for stream in (False, True):
        body = {"tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": closed}
        if stream:
            chunks = stream_chunks(
                embedded,
                "/chat/completions",
                {"model": embedded.name, "messages": FEW_SHOT_TOOL_USE, **body, "stream": True},
            )
            (last,) = [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
            assert last["choices"][0]["finish_reason"] == "length"
            (call,) = last["choices"][0]["delta"]["tool_calls"]
        else:
            choice = chat(embedded, FEW_SHOT_TOOL_USE, **body)["choices"][0]
            assert choice["token_ids"] == ids[:closed]
            assert choice["finish_reason"] == "length"
            (call,) = choice["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.slow
def test_a_streamed_tool_call_arrives_as_a_tool_calls_delta(embedded: ServedEngine) -> None:
    body = {
        "model": embedded.name,
        "messages": FEW_SHOT_TOOL_USE,
        "tools": [WEATHER_TOOL],
        "temperature": 0,
        "max_tokens": 32,
        "stream": True,
    }
    chunks = stream_chunks(embedded, "/chat/completions", body)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert TOOL_CALL_OPEN not in content
    (last,) = [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    (call,) = last["choices"][0]["delta"]["tool_calls"]
    assert call["index"] == 0
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert last["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_leaves_the_tools_out(embedded: ServedEngine) -> None:
    answer = chat(
        embedded,
        [{"role": "user", "content": "Hi"}],
        tools=[WEATHER_TOOL],
        tool_choice="none",
        temperature=0,
        max_tokens=1,
    )
    assert "<tools>" not in embedded.tokenizer.decode(answer["prompt_token_ids"])


# -- weight updates ---------------------------------------------------------------------------


@pytest.fixture
def own_engine() -> Iterator[ServedEngine]:
    """An engine of its own: these tests change its weights."""
    with served_engine(dtype="float32") as served:
        yield served


def greedy_answer(served: ServedEngine) -> tuple[int, list[int]]:
    """(weight version header, greedy token IDs) of one fixed completion."""
    response = post(
        served,
        "/completions",
        {"model": served.name, "prompt": COUNTING, "temperature": 0, "max_tokens": 6},
    )
    assert response.status_code == 200
    return int(response.headers[WEIGHT_VERSION_HEADER]), response.json()["choices"][0]["token_ids"]


def _resident_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_an_update_starts_with_the_memory_generation_freed_given_back(
    own_engine: ServedEngine,
) -> None:
    """A thread allocates 320 MB in 8 KB blocks (glibc serves them from that thread's arena, not
    by mmap) and frees every other one: 160 MB of holes between live blocks, which glibc keeps
    resident. Entering an update hands them back (`malloc_trim`), as generation's freed KV is
    before the update allocates its gradients elsewhere."""
    kept: list[bytearray] = []

    def fragment() -> None:
        blocks = [bytearray(8192) for _ in range(40_000)]  # bytearray() writes its pages: resident
        kept.extend(blocks[1::2])

    worker = threading.Thread(target=fragment)
    worker.start()
    worker.join()
    before = _resident_mb()
    with own_engine.engine.updating_weights():
        after = _resident_mb()
    assert before - after > 100, (before, after)
    assert len(kept) == 20_000


@pytest.mark.slow
def test_updating_weights_in_place_bumps_the_version_and_changes_outputs(
    own_engine: ServedEngine,
) -> None:
    engine = own_engine.engine
    version, before = greedy_answer(own_engine)
    assert version == engine.weight_version
    norm = engine.model.model.norm.weight
    with engine.updating_weights(), torch.no_grad():
        norm.mul_(-1)  # negates every logit: greedy picks other tokens
    assert greedy_answer(own_engine)[0] == version + 1
    assert greedy_answer(own_engine)[1] != before
    with engine.updating_weights(), torch.no_grad():
        norm.mul_(-1)
    assert greedy_answer(own_engine) == (version + 2, before)


@pytest.mark.slow
def test_update_weights_runs_the_update_on_the_engines_thread_with_generation_paused(
    own_engine: ServedEngine,
) -> None:
    """The trainer's update runs where generation runs (so each reuses the memory the other
    freed: docs/benchmarks.md, "Trainer memory"), between two steps, as `updating_weights`."""
    engine = own_engine.engine
    version, before = greedy_answer(own_engine)
    norm = engine.model.model.norm.weight
    seen: list[tuple[str, bool, bool]] = []

    def negate() -> str:
        # Gradients on: the engine's own steps run under inference mode, an update must not.
        seen.append(
            (
                threading.current_thread().name,
                engine._weights_lock.locked(),
                torch.is_grad_enabled(),
            )
        )
        with torch.no_grad():
            norm.mul_(-1)
        return "applied"

    caller = threading.current_thread().name
    assert engine.update_weights(negate) == "applied"
    assert seen == [("reins-engine", True, True)] and caller != "reins-engine"
    assert greedy_answer(own_engine)[0] == version + 1
    assert greedy_answer(own_engine)[1] != before

    def fail() -> None:
        with torch.no_grad():
            norm.mul_(-1)
        raise ValueError("the step failed")

    with pytest.raises(ValueError, match="the step failed"):
        engine.update_weights(fail)
    # A failed update is no new version (its weights are the caller's to mend), and the engine
    # still serves.
    assert greedy_answer(own_engine) == (version + 1, before)
    engine.close()
    with pytest.raises(RuntimeError, match="stopped"):
        engine.update_weights(lambda: None)


@pytest.mark.slow
def test_load_weights_from_a_folder_bumps_the_version_and_changes_outputs(
    own_engine: ServedEngine, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    engine = own_engine.engine
    version, before = greedy_answer(own_engine)
    changed = AutoModelForCausalLM.from_pretrained(prepare_default_model(), dtype=torch.float32)
    with torch.no_grad():
        changed.model.norm.weight.mul_(-1)
    changed.save_pretrained(tmp_path / "changed")

    assert engine.load_weights(tmp_path / "changed") == version + 1
    new_version, after = greedy_answer(own_engine)
    assert new_version == version + 1
    assert after != before
    assert engine.load_weights(prepare_default_model()) == version + 2
    assert greedy_answer(own_engine) == (version + 2, before)


# -- errors -----------------------------------------------------------------------------------


def test_a_weights_file_that_is_not_safetensors_is_a_json_400(
    embedded: ServedEngine, tmp_path: Path
) -> None:
    version = embedded.engine.weight_version
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{trunc")
    response = httpx.post(
        f"{embedded.server.url}/reins/load_weights", json={"path": str(tmp_path)}, timeout=60
    )
    assert_openai_error(response, 400, "is not a readable safetensors file")
    assert embedded.engine.weight_version == version


@pytest.mark.parametrize(
    ("tool_calls", "says"),
    [
        ([{"id": "c", "type": "function", "function": "x"}], "tool_calls[0].function must be"),
        ([{"id": "c", "type": "function", "function": None}], "tool_calls[0].function must be"),
        ("abc", "messages[1].tool_calls must be a list"),
        ([{"function": {"name": 5, "arguments": "{}"}}], "function.name must be a string"),
    ],
)
def test_a_history_tool_call_of_the_wrong_shape_is_400(
    embedded: ServedEngine, tool_calls: Any, says: str
) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]
    body = {"model": embedded.name, "messages": messages, "max_tokens": 1}
    for url in (f"{embedded.base_url}/chat/completions", f"{embedded.server.url}/tokenize"):
        assert_openai_error(httpx.post(url, json=body, timeout=60), 400, says)


def test_weights_of_another_shape_are_a_json_400_and_change_nothing(
    embedded: ServedEngine, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    engine = embedded.engine
    version, before = greedy_answer(embedded)
    save_file({"model.norm.weight": torch.ones(7)}, str(tmp_path / "model.safetensors"))
    response = httpx.post(
        f"{embedded.server.url}/reins/load_weights", json={"path": str(tmp_path)}, timeout=60
    )
    assert_openai_error(response, 400, "model.norm.weight [7] (the model's: [576])")
    assert "nothing was loaded" in response.json()["error"]["message"]
    assert engine.weight_version == version
    assert greedy_answer(embedded) == (version, before)


def assert_openai_error(
    response: httpx.Response, status: int, says: str, code: str | None = None
) -> None:
    """vLLM's error shape: its code is the status, or OpenAI's `code` where one is known."""
    assert response.status_code == status
    error = response.json()["error"]
    assert says in error["message"]
    assert error["code"] == (code or status)
    assert isinstance(error["type"], str)


def test_unknown_model_is_404(embedded: ServedEngine) -> None:
    for route, body in [
        ("/chat/completions", {"messages": OPEN_QUESTION}),
        ("/completions", {"prompt": "hi"}),
    ]:
        response = post(embedded, route, {"model": "gpt-9", **body})
        assert_openai_error(response, 404, "gpt-9")
        assert response.json()["error"]["type"] == "NotFoundError"
    client = openai.OpenAI(base_url=embedded.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)


def test_a_lower_weight_version_is_409_conflict(embedded: ServedEngine) -> None:
    lower = embedded.engine.weight_version - 1
    response = httpx.post(
        f"{embedded.server.url}/reins/load_weights",
        json={"path": str(prepare_default_model()), "version": lower},
        timeout=60,
    )
    assert_openai_error(response, 409, "only go up")
    assert response.json()["error"]["type"] == "ConflictError"


def test_too_long_prompt_is_400(embedded: ServedEngine) -> None:
    too_long = [42] * (embedded.engine.max_model_len + 1)
    response = post(embedded, "/completions", {"model": embedded.name, "prompt": too_long})
    assert_openai_error(response, 400, "maximum context length", "context_length_exceeded")


def test_max_tokens_beyond_the_context_ends_at_the_context(embedded: ServedEngine) -> None:
    room = 3
    body = {
        "model": embedded.name,
        "prompt": [42] * (embedded.engine.max_model_len - room),
        "max_tokens": embedded.engine.max_model_len,
        "temperature": 0,
        "stop": [],
    }
    response = post(embedded, "/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert len(choice["token_ids"]) <= room
    if len(choice["token_ids"]) == room:
        assert choice["finish_reason"] == "length"


def test_body_that_is_not_json_is_400(embedded: ServedEngine) -> None:
    response = httpx.post(
        f"{embedded.base_url}/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert_openai_error(response, 400, "not JSON")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        ("/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}'),
    ],
    ids=["chat", "completions"],
)
def test_an_unpaired_surrogate_is_400_not_500(embedded: ServedEngine, path: str, body: str) -> None:
    """JSON can escape one and Python's reader takes it; the tokenizer then raised a TypeError."""
    response = httpx.post(
        f"{embedded.base_url}{path}",
        content=body.replace("{", f'{{"model": "{embedded.name}", ', 1),
        headers={"content-type": "application/json"},
    )
    assert_openai_error(response, 400, "(no low surrogate in string: line 1 column")
    assert "a string with an unpaired UTF-16 surrogate" in response.text


def test_logit_bias_and_penalties_reach_the_sampler(embedded: ServedEngine) -> None:
    """They were accepted and ignored (the request model allows unknown fields)."""
    plain = complete(embedded, "The sea is", max_tokens=4, temperature=0, logprobs=0)
    first = plain["choices"][0]["token_ids"][0]
    forced = 1234 if first != 1234 else 1235
    biased = complete(
        embedded, "The sea is", max_tokens=4, temperature=0, logit_bias={str(forced): 100}
    )
    assert biased["choices"][0]["token_ids"] == [forced] * 4
    # The first token again, now penalized: the greedy answer must take another.
    again = complete(
        embedded,
        "The sea is",
        max_tokens=2,
        temperature=0,
        presence_penalty=2,
        logit_bias={str(first): -100},
    )
    assert again["choices"][0]["token_ids"][0] != first
    for bias, says in [({"x": 1}, "'x' is no token ID"), ({"5": 101}, "from -100 to 100")]:
        body = {"model": embedded.name, "prompt": "a", "logit_bias": bias}
        assert_openai_error(post(embedded, "/completions", body), 400, says)
    body = {"model": embedded.name, "prompt": "a", "frequency_penalty": 3}
    assert_openai_error(post(embedded, "/completions", body), 400, "frequency_penalty")


def test_invalid_field_is_400(embedded: ServedEngine) -> None:
    body = {"model": embedded.name, "messages": OPEN_QUESTION, "temperature": "hot"}
    assert_openai_error(post(embedded, "/chat/completions", body), 400, "temperature")


def test_a_seed_a_generator_cannot_take_is_400_streamed_or_not(embedded: ServedEngine) -> None:
    for seed, stream in [(2**70, False), (2**64, True), (-(2**63) - 1, False)]:
        body = {"model": embedded.name, "prompt": "Hi", "max_tokens": 2, "seed": seed}
        response = post(embedded, "/completions", {**body, "stream": stream})
        assert_openai_error(response, 400, "seed")


def test_the_largest_seed_serves_several_choices(embedded: ServedEngine) -> None:
    answer = complete(embedded, "Hi", max_tokens=2, seed=2**64 - 1, n=2)
    assert len(answer["choices"]) == 2


@pytest.mark.parametrize("route", ["/chat/completions", "/completions"])
def test_a_null_n_is_one_choice(embedded: ServedEngine, route: str) -> None:
    """`n: null` is the default, as OpenAI and vLLM take it: the openai SDK sends `n=None` as
    null, which must not be a 400."""
    body: dict[str, Any] = {"model": embedded.name, "max_tokens": 2, "n": None}
    body |= {"messages": OPEN_QUESTION} if route == "/chat/completions" else {"prompt": "Hi"}
    response = post(embedded, route, body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1


def test_models_lists_the_served_name(embedded: ServedEngine) -> None:
    models = httpx.get(f"{embedded.base_url}/models").json()
    assert [m["id"] for m in models["data"]] == [embedded.name]


# -- clients that go away ---------------------------------------------------------------------


def test_a_client_that_hangs_up_mid_stream_frees_its_batch_slot(embedded: ServedEngine) -> None:
    engine = embedded.engine
    assert embedded.idle()
    steps_before = engine.scheduler.steps
    body = {
        "model": embedded.name,
        "prompt": COUNTING,
        "temperature": 0,
        "max_tokens": 400,
        "stream": True,
    }
    with httpx.stream("POST", f"{embedded.base_url}/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        assert engine.scheduler.load() == (1, 0)
    # The connection is closed: the sequence leaves the batch long before its 400 tokens.
    assert wait_until(embedded.idle)
    assert engine.scheduler.steps - steps_before < 300
