"""Builders of calls and rollout records for the Sample Adapter tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from reins.samples import Call, RolloutRecord


def call(
    prompt: Sequence[int],
    response: Sequence[int],
    *,
    seq: int = 0,
    version: int | None = None,
    logprobs: Sequence[float] | None = None,
) -> Call:
    """A call; logprobs default to -0.5, -1.5, ... so each response token's value is distinct."""
    if logprobs is None:
        logprobs = [-(i + 0.5) for i in range(len(response))]
    return Call(
        prompt=np.asarray(prompt, dtype=np.int32),
        response=np.asarray(response, dtype=np.int32),
        logprobs=np.asarray(logprobs, dtype=np.float32),
        seq=seq,
        model_version=version,
    )


def continuing(prev: Call, observation: Sequence[int], response: Sequence[int], seq: int) -> Call:
    """The next call of a linear conversation: prompt = previous prompt + response + observation."""
    prompt = np.concatenate([prev.prompt, prev.response, np.asarray(observation, np.int32)])
    return call(prompt.tolist(), response, seq=seq)


def separate_calls(response_lengths: Sequence[int], *, first_seq: int = 0) -> list[Call]:
    """Calls that never merge (each prompt starts with a different token), one per length."""
    return [
        call([1000 + i, 7, 7], [5] * n, seq=first_seq + i) for i, n in enumerate(response_lengths)
    ]


def record(
    rollout_id: str,
    calls: Sequence[Call],
    *,
    reward: float = 0.0,
    group_id: str | None = None,
    attempt_id: int = 1,
) -> RolloutRecord:
    return RolloutRecord(
        rollout_id=rollout_id,
        reward=reward,
        calls=list(calls),
        group_id=group_id,
        attempt_id=attempt_id,
    )
