"""The embedded engine's prefix cache: its bookkeeping (pure), then exactness: the same seeds give
the same tokens with the cache on and off, and logprobs equal within `TOLERANCE`, on multi-turn
conversations (token-ID prompts and chat, streamed and not), in batches mixing cached and uncached
prompts, and across weight updates (a cached entry of version N never serves version N+1).

Two engines share one model, one with the cache and one without (`prefix_cache_gb=0`), so they
run exactly the same weights. The fast tier uses a tiny random Llama with the default model's
tokenizer; the slow tier the real default model (float32).

Measured (float32, 2 CPU cores, 4 concurrent chat conversations x 4 turns, sampled and greedy):
sampled tokens always identical; logprobs with the cache differ from those without by at most
1e-6 on the tiny model and 2.1e-5 on the default model, where the engine without the cache
differs from itself by as much (2.1e-5) between a request alone and the same request in a batch:
fp32 matrix multiplies over other shapes (a prefix computed in another batch, or by decode steps
instead of a prefill) round differently. `TOLERANCE` is about five times that.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from reins.engine.api import create_engine_app
from reins.engine.embedded import EmbeddedEngine, Finished, Token
from reins.engine.prefix_cache import PrefixCache, as_tokens
from reins.engine.sampling import SamplingParams
from reins.engine.scheduler import PREFILL_KEEP_TOKENS
from reins.serving import BackgroundServer
from tests.embedded_support import served_engine
from tests.tiny_model import default_tokenizer, tiny_llama

TOLERANCE = 1e-4
"""Largest |logprob with cache - logprob without| accepted (see the module docstring)."""

# -- the cache's bookkeeping (no model) -------------------------------------------------------


PER_TOKEN = 2 * 2 * 4 * 4
"""Bytes per position of `kv`: 2 layers x (keys, values) x 4 float32."""


def kv(length: int, layers: int = 2, fill: float = 0.0) -> tuple[tuple[torch.Tensor, ...], ...]:
    """A fake KV of `length` positions: 2 layers of [1, 1, length, 4] float32."""
    return tuple(
        (torch.full((1, 1, length, 4), fill), torch.full((1, 1, length, 4), fill))
        for _ in range(layers)
    )


def tokens(*parts: range | list[int]) -> np.ndarray:
    return as_tokens([t for part in parts for t in part])


def test_lookup_takes_the_longest_shared_prefix() -> None:
    cache = PrefixCache(10_000, min_tokens=4)
    cache.insert(tokens(range(0, 20)), kv(20), version=0)  # type: ignore[arg-type]
    cache.insert(tokens(range(0, 10), range(100, 130)), kv(40), version=0)  # type: ignore[arg-type]
    match = cache.lookup(tokens(range(0, 10), range(100, 120), [7, 7]), version=0)
    assert match is not None and match.length == 30
    assert len(match.entry.tokens) == 40


def test_a_match_may_stop_inside_an_entry_and_leaves_one_token_to_prefill() -> None:
    cache = PrefixCache(10_000, min_tokens=4)
    cache.insert(tokens(range(0, 30)), kv(30), version=0)  # type: ignore[arg-type]
    inside = cache.lookup(tokens(range(0, 12), [999]), version=0)
    assert inside is not None and inside.length == 12
    whole = cache.lookup(tokens(range(0, 30)), version=0)
    assert whole is not None and whole.length == 29  # the last token is prefilled for logits
    assert cache.lookup(tokens(range(0, 3), [999]), version=0) is None  # under min_tokens


def test_entries_of_other_weight_versions_never_match_and_invalidate_drops_them() -> None:
    cache = PrefixCache(10_000, min_tokens=4)
    cache.insert(tokens(range(0, 20)), kv(20), version=3)  # type: ignore[arg-type]
    assert cache.lookup(tokens(range(0, 21)), version=4) is None
    assert cache.lookup(tokens(range(0, 21)), version=3) is not None
    assert cache.invalidate(4) == 1
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.invalidated) == (0, 0, 1)


def test_least_recently_used_entries_go_first_to_stay_under_capacity() -> None:
    cache = PrefixCache(3 * 20 * PER_TOKEN, min_tokens=4)  # room for three entries of 20 tokens
    for start in (0, 1000, 2000):
        cache.insert(tokens(range(start, start + 20)), kv(20), version=0)  # type: ignore[arg-type]
    used = cache.lookup(tokens(range(0, 21)), version=0)
    cache.use(used, 21)  # the first entry becomes the most recently used
    cache.insert(tokens(range(3000, 3020)), kv(20), version=0)  # type: ignore[arg-type]
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.evicted) == (3, 3 * 20 * PER_TOKEN, 1)
    assert cache.lookup(tokens(range(1000, 1021)), version=0) is None  # the oldest went
    assert cache.lookup(tokens(range(0, 21)), version=0) is not None
    too_big = kv(100)
    assert not cache.insert(tokens(range(0, 100)), too_big, version=0)  # type: ignore[arg-type]


def test_an_entry_extended_by_a_new_one_is_dropped_and_a_covered_one_is_not_added() -> None:
    cache = PrefixCache(10_000, min_tokens=4)
    cache.insert(tokens(range(0, 20)), kv(20), version=0)  # type: ignore[arg-type]
    cache.insert(tokens(range(0, 30)), kv(30), version=0)  # type: ignore[arg-type]
    assert cache.stats().entries == 1 and cache.stats().bytes == 30 * PER_TOKEN
    assert not cache.insert(tokens(range(0, 25)), kv(25), version=0)  # type: ignore[arg-type]
    assert cache.stats().entries == 1


def test_a_cache_of_zero_bytes_is_off() -> None:
    cache = PrefixCache(0)
    assert not cache.insert(tokens(range(0, 40)), kv(40), version=0)  # type: ignore[arg-type]
    assert cache.lookup(tokens(range(0, 41)), version=0) is None


@pytest.mark.parametrize("size", [float("inf"), float("nan"), -1.0])
def test_a_cache_size_that_cannot_be_is_refused_before_the_model_loads(size: float) -> None:
    """`reins engine --prefix-cache-gb inf` ended in an OverflowError's traceback and `nan` in
    "cannot convert float NaN to integer", both after loading the model."""
    with pytest.raises(ValueError, match="prefix_cache_gb must be a finite number >= 0"):
        EmbeddedEngine.load("/nonexistent-model-folder", prefix_cache_gb=size)


# -- engines on one model: the cache on and off -----------------------------------------------


@dataclass
class Pair:
    """Two engines on one model: `on` with the prefix cache, `off` without."""

    on: EmbeddedEngine
    off: EmbeddedEngine

    def close(self) -> None:
        self.on.close()
        self.off.close()


@dataclass
class Answer:
    token_ids: list[int]
    logprobs: list[float]
    cached_tokens: int
    prompt_length: int = 0


def pair_on(model: Any, tokenizer: Any) -> Pair:
    return Pair(
        EmbeddedEngine(model, tokenizer, name="on"),
        EmbeddedEngine(model, tokenizer, name="off", prefix_cache_gb=0),
    )


@pytest.fixture(scope="module")
def tiny() -> Iterator[Pair]:
    """A tiny random Llama (`tests.tiny_model`; built in memory) with the default model's
    tokenizer and `LlamaConfig`'s own bos and padding ids."""
    tokenizer = default_tokenizer()
    model = tiny_llama(tokenizer, tokenizer_bos_and_pad=False)
    pair = pair_on(model.eval(), tokenizer)
    yield pair
    pair.close()


async def generate(
    engine: EmbeddedEngine, prompt: list[int], seed: int, max_tokens: int = 12
) -> Answer:
    answer = Answer([], [], -1, len(prompt))
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed)
    async for item in engine.generate(prompt, [params]):
        if isinstance(item, Token):
            answer.token_ids.append(item.token_id)
            answer.logprobs.append(item.logprob)
        else:
            assert isinstance(item, Finished) and item.error is None, item
            answer.cached_tokens = item.cached_tokens
    return answer


def text_ids(engine: EmbeddedEngine, text: str) -> list[int]:
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


SYSTEM = "You are a coding agent working in a repository. You can call these tools: " + " ".join(
    f"tool_{i}(path: string, limit: int) reads up to `limit` lines of file number {i}."
    for i in range(12)
)


async def token_conversation(
    engine: EmbeddedEngine, number: int, turns: int = 4, max_tokens: int = 12
) -> list[Answer]:
    """A conversation as the proxy sends it with token reuse: each prompt is the previous prompt,
    the sampled tokens, then a tool result's tokens."""
    prompt = text_ids(engine, f"{SYSTEM}\nTask {number}: list the files.")
    answers = []
    for turn in range(turns):
        answer = await generate(engine, prompt, seed=100 * number + turn, max_tokens=max_tokens)
        answers.append(answer)
        result = text_ids(engine, f"\nTool result {turn}: src/a_{turn}.py src/b_{turn}.py\n")
        prompt = prompt + answer.token_ids + result
    return answers


def assert_same(with_cache: list[Answer], without: list[Answer]) -> None:
    assert [a.token_ids for a in with_cache] == [a.token_ids for a in without]
    for a, b in zip(with_cache, without, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=TOLERANCE)


def test_a_multi_turn_conversation_reuses_its_prefix_and_samples_the_same(tiny: Pair) -> None:
    tiny.on.prefix_cache.clear()
    with_cache = asyncio.run(token_conversation(tiny.on, 0))
    without = asyncio.run(token_conversation(tiny.off, 0))
    assert_same(with_cache, without)
    # Each later prompt reuses the whole previous prompt and all its sampled tokens but the last.
    reusable = [a.prompt_length + len(a.token_ids) - 1 for a in with_cache]
    assert [a.cached_tokens for a in with_cache] == [0, *reusable[:-1]]
    assert all(a.cached_tokens == 0 for a in without)


def test_concurrent_conversations_sample_the_same_with_and_without_the_cache(tiny: Pair) -> None:
    async def conversations(engine: EmbeddedEngine) -> list[list[Answer]]:
        return list(await asyncio.gather(*(token_conversation(engine, n) for n in range(5))))

    tiny.on.prefix_cache.clear()
    with_cache, without = asyncio.run(conversations(tiny.on)), asyncio.run(conversations(tiny.off))
    for a, b in zip(with_cache, without, strict=True):
        assert_same(a, b)
    assert sum(a.cached_tokens > 0 for c in with_cache for a in c) >= 5 * 3


async def held_then_released(
    engine: EmbeddedEngine, prompts: list[list[int]]
) -> tuple[list[Answer], list[list[int]]]:
    """Generates for `prompts` (seeds 0, 1, ...), all submitted while the scheduler holds new
    sequences in line, so that they can join in one step. Returns the answers and, for each
    prefill, the cached tokens of each sequence in it."""
    scheduler = engine.scheduler
    prefills: list[list[int]] = []
    original = scheduler._prefill

    def spy(joining: list[Any]) -> Any:
        prefilled = original(joining)
        prefills.append([s.cached_tokens for s in joining])
        return prefilled

    scheduler._prefill = spy  # type: ignore[method-assign]
    try:
        with scheduler.holding():
            tasks = [
                asyncio.create_task(generate(engine, prompt, seed))
                for seed, prompt in enumerate(prompts)
            ]
            for _ in range(3000):  # at most 30 s
                if scheduler.load()[1] == len(prompts):
                    break
                await asyncio.sleep(0.01)
            assert scheduler.load()[1] == len(prompts)
        answers = list(await asyncio.gather(*tasks))
    finally:
        del scheduler._prefill
    return answers, prefills


def test_a_batch_mixing_cached_and_uncached_prompts_samples_the_same(tiny: Pair) -> None:
    engine = tiny.on
    engine.prefix_cache.clear()
    shared = text_ids(engine, f"{SYSTEM}\nTask 7: read the README.")
    first = asyncio.run(generate(engine, shared, seed=5))
    cached_prompt = shared + first.token_ids + text_ids(engine, "\nTool result: 12 lines\n")
    fresh = text_ids(engine, "A different prompt that nothing in the cache starts with. " * 3)
    prompts = [cached_prompt, fresh, cached_prompt[:40] + fresh[:5]]
    mixed, prefills = asyncio.run(held_then_released(engine, prompts))
    expected = [len(shared) + len(first.token_ids) - 1, 0, 40]
    assert prefills == [expected]  # one prefill for the three
    assert [a.cached_tokens for a in mixed] == expected
    alone = [asyncio.run(generate(tiny.off, p, seed)) for seed, p in enumerate(prompts)]
    assert_same(mixed, alone)


def test_a_long_prompt_prefilled_is_reused_by_a_peer_that_joins_with_it(tiny: Pair) -> None:
    engine = tiny.on
    engine.prefix_cache.clear()
    long_prefix = text_ids(engine, SYSTEM * 4)[: PREFILL_KEEP_TOKENS + 100]
    prompts = [long_prefix + text_ids(engine, f" Question {n}?") for n in range(3)]
    answers, prefills = asyncio.run(held_then_released(engine, prompts))
    # The first is prefilled whole; the others wait one step and reuse its prompt's KV.
    assert len(prefills) == 2 and prefills[0] == [0]
    assert len(prefills[1]) == 2 and min(prefills[1]) >= len(long_prefix)
    alone = [asyncio.run(generate(tiny.off, p, seed)) for seed, p in enumerate(prompts)]
    assert_same(answers, alone)


def test_an_entry_of_older_weights_never_serves_newer_ones(tiny: Pair) -> None:
    engine = tiny.on
    engine.prefix_cache.clear()
    prompt = text_ids(engine, f"{SYSTEM}\nTask 9: fix the bug.")
    first = asyncio.run(generate(engine, prompt, seed=1))
    follow_up = prompt + first.token_ids + text_ids(engine, "\nTool result: done\n")
    assert engine.prefix_cache.lookup(as_tokens(follow_up), engine.weight_generation) is not None
    # A layer below the last: its change reaches the KV of the layers above it (the final norm's
    # would change the logits only, and stale KV would go unseen).
    weight = engine.model.model.layers[0].mlp.down_proj.weight
    try:
        with engine.updating_weights(), torch.no_grad():
            weight.mul_(1.5)
        assert engine.prefix_cache.stats().entries == 0
        after = asyncio.run(generate(engine, follow_up, seed=2))
        assert after.cached_tokens == 0
        assert_same([after], [asyncio.run(generate(tiny.off, follow_up, seed=2))])
        # Entries of the new weights are reused again.
        again = follow_up + after.token_ids + text_ids(engine, "\nTool result: ok\n")
        reused = asyncio.run(generate(engine, again, seed=3))
        assert reused.cached_tokens == len(follow_up) + len(after.token_ids) - 1
        assert_same([reused], [asyncio.run(generate(tiny.off, again, seed=3))])
    finally:
        with engine.updating_weights(), torch.no_grad():
            weight.div_(1.5)


def test_a_sequence_running_across_a_weight_update_is_not_kept(tiny: Pair) -> None:
    engine = tiny.on
    engine.prefix_cache.clear()
    prompt = text_ids(engine, f"{SYSTEM}\nTask 11: a long answer.")
    updated = threading.Event()

    async def run() -> Answer:
        answer = Answer([], [], -1)
        params = SamplingParams(temperature=1.0, max_tokens=40, seed=4)
        async for item in engine.generate(prompt, [params]):
            if isinstance(item, Token):
                answer.token_ids.append(item.token_id)
                if len(answer.token_ids) == 5:
                    with engine.updating_weights():
                        updated.set()  # the same weights, but a new version
        return answer

    answer = asyncio.run(run())
    assert updated.is_set() and len(answer.token_ids) == 40
    stats = engine.prefix_cache.stats()
    assert stats.entries == 0
    assert engine.prefix_cache.lookup(as_tokens(prompt + answer.token_ids), 0) is None


def test_a_reload_under_the_same_version_reuses_nothing_of_the_old_weights(tiny: Pair) -> None:
    """The same version number again reloads the weights (`load_weights`): the KV cached before,
    and the KV of a sequence running across the reload, are of the old weights all the same."""
    engine = tiny.on
    engine.prefix_cache.clear()
    prompt = text_ids(engine, f"{SYSTEM}\nTask 13: rename the module.")
    first = asyncio.run(generate(engine, prompt, seed=6))
    follow_up = prompt + first.token_ids + text_ids(engine, "\nTool result: renamed\n")
    # A weight before the last layer: the KV depends on it (the final norm's scale would not).
    down = engine.model.model.layers[0].mlp.down_proj.weight
    version = engine.weight_version

    async def run_across_a_reload() -> Answer:
        answer = Answer([], [], -1)
        params = SamplingParams(temperature=1.0, max_tokens=30, seed=7)
        async for item in engine.generate(follow_up, [params]):
            if isinstance(item, Token):
                answer.token_ids.append(item.token_id)
                if len(answer.token_ids) == 5:
                    with engine.updating_weights(version), torch.no_grad():
                        down.mul_(1.5)
        return answer

    try:
        across = asyncio.run(run_across_a_reload())
        assert engine.weight_version == version and len(across.token_ids) == 30
        assert engine.prefix_cache.stats().entries == 0
        later = follow_up + across.token_ids + text_ids(engine, "\nTool result: ok\n")
        warm = asyncio.run(generate(engine, later, seed=8))
        assert warm.cached_tokens == 0
        assert_same([warm], [asyncio.run(generate(tiny.off, later, seed=8))])
    finally:
        with engine.updating_weights(), torch.no_grad():
            down.div_(1.5)


# -- over HTTP: chat, streamed or not, usage and /metrics --------------------------------------


@pytest.fixture(scope="module")
def tiny_served(tiny: Pair) -> Iterator[tuple[str, str]]:
    """(base URL with the cache, base URL without) of the tiny pair."""
    servers = [BackgroundServer(create_engine_app(e)).start() for e in (tiny.on, tiny.off)]
    yield servers[0].url, servers[1].url
    for server in servers:
        server.stop()


def chat_turn(url: str, messages: list[dict[str, Any]], seed: int, stream: bool) -> Answer:
    body: dict[str, Any] = {
        "messages": messages,
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 12,
        "logprobs": True,
    }
    if not stream:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        answer = response.json()
        choice = answer["choices"][0]
        return Answer(
            choice["token_ids"],
            [item["logprob"] for item in choice["logprobs"]["content"]],
            answer["usage"]["prompt_tokens_details"]["cached_tokens"],
        )
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    result = Answer([], [], -1)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                result.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk["choices"]:
                result.token_ids += choice["token_ids"]
                if choice["logprobs"]:
                    result.logprobs += [i["logprob"] for i in choice["logprobs"]["content"]]
    return result


def chat_conversation(url: str, tokenizer: Any, *, stream: bool, turns: int = 3) -> list[Answer]:
    """A chat the way harnesses send it: the whole history each turn, the assistant's own text
    written back (re-rendered by the chat template)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "List the files in src/."},
    ]
    answers = []
    for turn in range(turns):
        answer = chat_turn(url, messages, seed=50 + turn, stream=stream)
        answers.append(answer)
        messages += [
            {"role": "assistant", "content": tokenizer.decode(answer.token_ids)},
            {"role": "user", "content": f"Tool result {turn}: a.py b.py"},
        ]
    return answers


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "streamed"])
def test_a_chat_over_http_samples_the_same_with_and_without_the_cache(
    tiny: Pair, tiny_served: tuple[str, str], stream: bool
) -> None:
    tiny.on.prefix_cache.clear()
    on_url, off_url = tiny_served
    with_cache = chat_conversation(on_url, tiny.on.tokenizer, stream=stream)
    without = chat_conversation(off_url, tiny.on.tokenizer, stream=stream)
    assert_same(with_cache, without)
    assert with_cache[0].cached_tokens == 0
    assert all(a.cached_tokens > len(SYSTEM) // 8 for a in with_cache[1:])
    assert all(a.cached_tokens == 0 for a in without)


def test_metrics_report_prompts_hits_and_reused_tokens(
    tiny: Pair, tiny_served: tuple[str, str]
) -> None:
    tiny.on.prefix_cache.clear()
    on_url, _ = tiny_served

    def metrics() -> dict[str, float]:
        response = httpx.get(f"{on_url}/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        return {
            line.split()[0]: float(line.split()[1])
            for line in response.text.splitlines()
            if line and not line.startswith("#")
        }

    before = metrics()
    answers = chat_conversation(on_url, tiny.on.tokenizer, stream=False, turns=2)
    after = metrics()
    reused = sum(a.cached_tokens for a in answers)
    assert reused > 0

    def grew(name: str) -> float:
        return after[name] - before[name]

    assert grew("reins_engine_prompts_total") == 2
    assert grew("reins_engine_prefix_cache_hits_total") == 1
    assert grew("reins_engine_prefix_cache_reused_tokens_total") == reused
    assert grew("reins_engine_prefilled_tokens_total") == (
        grew("reins_engine_prompt_tokens_total") - reused
    )
    stats = tiny.on.prefix_cache_stats()
    assert after["reins_engine_prefix_cache_bytes"] == stats.bytes > 0
    assert after["reins_engine_prefix_cache_entries"] == stats.entries >= 1
    assert after["reins_engine_prefix_cache_capacity_bytes"] == 2 * 2**30


# -- the real default model (slow) ------------------------------------------------------------


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[Pair, str, str]]:
    """The default model in float32 behind two engines (cache on, off), both served."""
    with served_engine(dtype="float32") as served:
        off = EmbeddedEngine(served.engine.model, served.tokenizer, name="off", prefix_cache_gb=0)
        server = BackgroundServer(create_engine_app(off)).start()
        try:
            yield Pair(served.engine, off), served.server.url, server.url
        finally:
            server.stop()
            off.close()


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["answer", "streamed"])
def test_real_model_chat_is_the_same_with_and_without_the_cache(
    real: tuple[Pair, str, str], stream: bool
) -> None:
    pair, on_url, off_url = real
    pair.on.prefix_cache.clear()
    with_cache = chat_conversation(on_url, pair.on.tokenizer, stream=stream, turns=4)
    without = chat_conversation(off_url, pair.on.tokenizer, stream=stream, turns=4)
    assert_same(with_cache, without)
    assert all(a.cached_tokens > 100 for a in with_cache[1:])


@pytest.mark.slow
def test_real_model_concurrent_conversations_are_the_same_with_and_without_the_cache(
    real: tuple[Pair, str, str],
) -> None:
    pair, _, _ = real
    pair.on.prefix_cache.clear()

    async def conversations(engine: EmbeddedEngine) -> list[list[Answer]]:
        runs = (token_conversation(engine, n, turns=3, max_tokens=16) for n in range(4))
        return list(await asyncio.gather(*runs))

    with_cache, without = asyncio.run(conversations(pair.on)), asyncio.run(conversations(pair.off))
    for a, b in zip(with_cache, without, strict=True):
        assert_same(a, b)
    assert all(a.cached_tokens > 0 for c in with_cache for a in c[1:])


@pytest.mark.slow
def test_real_model_cache_is_emptied_by_load_weights(
    real: tuple[Pair, str, str], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from reins.engine.prepare import prepare_default_model

    pair, _, _ = real
    engine = pair.on
    engine.prefix_cache.clear()
    changed = AutoModelForCausalLM.from_pretrained(prepare_default_model(), dtype=torch.float32)
    with torch.no_grad():
        changed.model.norm.weight.mul_(1.25)
    changed.save_pretrained(tmp_path / "changed")
    prompt = text_ids(engine, f"{SYSTEM}\nTask 3: run the tests.")
    first = asyncio.run(generate(engine, prompt, seed=8, max_tokens=16))
    follow_up = prompt + first.token_ids + text_ids(engine, "\nTool result: 3 passed\n")
    try:
        engine.load_weights(tmp_path / "changed")
        after = asyncio.run(generate(engine, follow_up, seed=9, max_tokens=16))
        assert after.cached_tokens == 0
        assert_same([after], [asyncio.run(generate(pair.off, follow_up, seed=9, max_tokens=16))])
    finally:
        engine.load_weights(prepare_default_model())
