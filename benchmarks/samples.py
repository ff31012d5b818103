"""Throughput of the Sample Adapter: ``build_batch`` on a synthetic batch shaped like the paper's.

The batch: 512 rollouts in groups of 8, each a chain of LLM calls whose prompts grow by an
observation and the previous response (so consecutive calls merge), with occasional splits of
every kind (retokenized, template, transformed, branch/summary) and a few retried calls. The split
rates are tuned so a rollout yields ~2.4 training sequences of ~8k tokens (paper section 2.2).

Figures are tokens per second of input: the sum over all calls of prompt + response tokens, the
data the adapter has to read. They are printed against two baselines measured in the same run:

- floor: one ``np.concatenate`` of every call's prompt and response (touch each token once);
- per-call: the no-merge path, one training sequence per call (tokens, mask, logprobs).

Run: ``python benchmarks/samples.py`` (under a minute) or ``--long`` (4x the rollouts, more
repeats). The last line is the headline: ``samples_adapter_throughput: VALUE Mtok/s``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import numpy as np

from reins.samples import AdapterConfig, Call, RolloutRecord, build_batch
from reins.samples.records import TokenArray

ALIAS = 24_576
"""Synthetic vocabulary of 2 * ALIAS ids: ids i and i + ALIAS decode to the same character, so
swapping one for the other is a retokenization (same text, other token IDs)."""
SYSTEM_TOKENS = 2_000
MAX_CONTEXT = 16_000
SPLIT_P = {"retokenized": 0.07, "template": 0.03, "transformed": 0.02, "branch": 0.03}
RETRY_P = 0.03


def decode(ids: TokenArray) -> str:
    """Synthetic tokenizer: one CJK-range character per token id (modulo the alias)."""
    return (ids % ALIAS + 0x4E00).astype("<u4").tobytes().decode("utf-32-le")


def _tokens(rng: np.random.Generator, lo: int, hi: int) -> TokenArray:
    return rng.integers(0, ALIAS, int(rng.integers(lo, hi)), dtype=np.int32)


def make_rollout(
    rng: np.random.Generator, rollout_id: str, group_id: str, calls: int
) -> tuple[RolloutRecord, dict[int, str]]:
    """One rollout: ``calls`` calls of a conversation that mostly continues and sometimes splits.

    Also returns the true split kind after each call that was followed by one (by its seq).
    """
    out: list[Call] = []
    truth: dict[int, str] = {}
    prompt = _tokens(rng, SYSTEM_TOKENS, SYSTEM_TOKENS + 1)
    kinds = list(SPLIT_P)
    # harnesses differ: some rollouts never split, some split often (paper: 36% stay whole)
    scale = rng.exponential(1.0)
    split_p = np.array(list(SPLIT_P.values())) * scale
    if split_p.sum() > 0.9:
        split_p *= 0.9 / split_p.sum()
    weights = np.array([*split_p, 1.0 - split_p.sum()])
    seq = 0
    for _ in range(calls):
        if rng.random() < RETRY_P:  # a retried call: same prompt, superseded by the next one
            r = _tokens(rng, 200, 600)
            out.append(Call(prompt, r, np.full(r.size, -1.0, np.float32), seq, 0))
            seq += 1
        resp = _tokens(rng, 200, 600)
        logprobs = -rng.random(resp.size, dtype=np.float32)
        out.append(Call(prompt, resp, logprobs, seq, 0))
        seq += 1
        obs = _tokens(rng, 400, 1200)
        kind = str(rng.choice([*kinds, "continue"], p=weights))
        if kind == "template" and prompt.size < SYSTEM_TOKENS + 1000:
            kind = "retokenized"  # no earlier history to re-render yet
        if prompt.size + resp.size + obs.size > MAX_CONTEXT:
            kind = "branch"  # the context is full: the harness summarizes
        if kind != "continue":
            truth[seq - 1] = kind
        if kind == "continue":
            prompt = np.concatenate([prompt, resp, obs])
        elif kind == "retokenized":
            shown = resp.copy()
            shown[rng.integers(0, resp.size, 3)] += ALIAS
            prompt = np.concatenate([prompt, shown, obs])
        elif kind == "transformed":
            shown = resp.copy()
            shown[:16] = rng.integers(0, ALIAS, 16)
            prompt = np.concatenate([prompt, shown, obs])
        elif kind == "template":  # an earlier span of the history dropped (e.g. a <think> block)
            cut = int(rng.integers(SYSTEM_TOKENS, prompt.size - 500))
            prompt = np.concatenate([prompt[:cut], prompt[cut + 300 :], resp, obs])
        else:  # branch: a summary or a subagent starts a fresh context
            prompt = np.concatenate([_tokens(rng, 1500, 1501), _tokens(rng, 500, 1000)])
    truth.pop(seq - 1, None)  # no call followed the last one
    record = RolloutRecord(
        rollout_id=rollout_id, reward=float(rng.random() < 0.5), calls=out, group_id=group_id
    )
    return record, truth


def make_batch(
    rollouts: int, calls: int, seed: int = 0
) -> tuple[list[RolloutRecord], dict[tuple[str, int], str]]:
    """The batch, and the true kind of each split by (rollout id, seq of the call before it)."""
    rng = np.random.default_rng(seed)
    batch: list[RolloutRecord] = []
    truth: dict[tuple[str, int], str] = {}
    for i in range(rollouts):
        record, kinds = make_rollout(rng, f"r{i}", f"g{i // 8}", calls)
        batch.append(record)
        truth.update({(record.rollout_id, seq): kind for seq, kind in kinds.items()})
    return batch, truth


def floor(batch: list[RolloutRecord]) -> None:
    """Touch every token once: concatenate every call's prompt and response."""
    np.concatenate([x for r in batch for c in r.calls for x in (c.prompt, c.response)])


def per_call(batch: list[RolloutRecord]) -> None:
    """The no-merge path: one training sequence (tokens, mask, logprobs) per call."""
    for r in batch:
        for c in r.calls:
            tokens = np.concatenate([c.prompt, c.response])
            mask = np.zeros(tokens.size, np.bool_)
            mask[c.prompt.size :] = True
            logprobs = np.zeros(tokens.size, np.float32)
            logprobs[c.prompt.size :] = c.logprobs if c.logprobs is not None else np.nan


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--long", action="store_true", help="4x the rollouts and more repeats")
    ap.add_argument("--rollouts", type=int, default=None)
    ap.add_argument("--calls", type=int, default=10, help="calls per rollout (before retries)")
    args = ap.parse_args()
    rollouts = args.rollouts or (2048 if args.long else 512)
    repeats = 5 if args.long else 3

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"cores: {os.cpu_count()} (usable {affinity}); the adapter runs on one core")
    print(f"python {platform.python_version()}, numpy {np.__version__}")

    t0 = time.perf_counter()
    batch, truth = make_batch(rollouts, args.calls)
    print(f"generated {rollouts} rollouts in {time.perf_counter() - t0:.1f} s")

    cfg = AdapterConfig(num_minibatches=4, dp_size=8, max_tokens_per_microbatch=32_768)
    result = build_batch(batch, cfg, decode=decode)  # warm-up, and the figures below
    m = result.metrics
    call_tokens = sum(c.prompt.size + c.response.size for r in batch for c in r.calls)
    print(
        f"batch: {m.rollouts} rollouts in groups of 8, {sum(len(r.calls) for r in batch)} calls "
        f"({m.dedup_calls} retried), {call_tokens / 1e6:.1f}M call tokens"
    )
    print(
        f"  -> {m.sequences} sequences ({m.samples_per_rollout:.2f}/rollout, one-sample rollouts "
        f"{m.one_sample_rollout_ratio:.0%}), {m.trained_tokens / 1e6:.1f}M trained tokens "
        f"({m.trained_tokens / max(m.sequences, 1) / 1e3:.1f}k/sequence), merging saved "
        f"{m.merge_token_saving:.0%}"
    )
    agree = sum(truth.get((s.rollout_id, s.before_seq)) == s.reason for s in result.splits)
    print(f"  splits: {m.split_reasons}; the generator's kind agrees on {agree}/{len(truth)}")
    print(
        f"  plan: {m.minibatches} mini-batches, {m.microbatches} micro-batches, "
        f"rank imbalance {m.rank_imbalance:.3f}"
    )

    t_floor = best_of(repeats, lambda: floor(batch))
    t_naive = best_of(repeats, lambda: per_call(batch))
    t_adapter = best_of(repeats, lambda: build_batch(batch, cfg, decode=decode))
    t_tokens_only = best_of(repeats, lambda: build_batch(batch, cfg))

    def rate(t: float) -> float:
        return call_tokens / t / 1e6

    print(f"floor, np.concatenate of every call:   {t_floor:7.3f} s  {rate(t_floor):8.1f} Mtok/s")
    print(f"per-call path, no merge:               {t_naive:7.3f} s  {rate(t_naive):8.1f} Mtok/s")
    print(
        f"build_batch, no decode (token reasons): {t_tokens_only:6.3f} s  "
        f"{rate(t_tokens_only):8.1f} Mtok/s"
    )
    print(
        f"build_batch, with decode:              {t_adapter:7.3f} s  {rate(t_adapter):8.1f} Mtok/s"
    )
    print(
        f"ratio: build_batch = {t_floor / t_adapter:.3f}x the floor's speed "
        f"({t_adapter / t_floor:.1f}x its time), {t_naive / t_adapter:.2f}x the per-call path's; "
        f"{m.trained_tokens / t_adapter / 1e6:.1f} M trained tokens/s"
    )
    print(f"samples_adapter_throughput: {rate(t_adapter):.1f} Mtok/s")


if __name__ == "__main__":
    main()
