"""Synthetic batches for backend tests: real `reins.samples` batches from made-up calls."""

from __future__ import annotations

import numpy as np

from reins.samples.batch import AdapterConfig, Batch, build_batch
from reins.samples.records import Call, RolloutRecord


def rollout(
    rollout_id: str, group: str, reward: float, *, seed: int, turns: int = 2, logprobs: bool = True
) -> RolloutRecord:
    """A multi-turn rollout whose calls merge (each prompt extends the previous one)."""
    rng = np.random.default_rng(seed)
    history = list(rng.integers(100, 5000, size=12))
    calls = []
    for turn in range(turns):
        response = list(rng.integers(100, 5000, size=int(rng.integers(3, 8))))
        lp = rng.uniform(-3, -0.1, size=len(response)).astype(np.float32) if logprobs else None
        calls.append(Call(np.array(history), np.array(response), lp, seq=turn + 1, model_version=0))
        history = history + response + list(rng.integers(100, 5000, size=4))
    return RolloutRecord(rollout_id=rollout_id, group_id=group, calls=calls, reward=reward)


def make_batch(
    *,
    groups: int = 2,
    per_group: int = 4,
    dp_size: int = 1,
    micro_tokens: int | None = None,
    num_minibatches: int = 1,
    logprobs: bool = True,
) -> Batch:
    records = [
        rollout(f"g{g}.r{r}", f"g{g}", float((r + g) % 2), seed=100 * g + r, logprobs=logprobs)
        for g in range(groups)
        for r in range(per_group)
    ]
    config = AdapterConfig(
        dp_size=dp_size, max_tokens_per_microbatch=micro_tokens, num_minibatches=num_minibatches
    )
    return build_batch(records, config)
