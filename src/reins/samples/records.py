"""The adapter's input: one rollout's recorded LLM calls and its reward, as plain arrays.

``rollout_from_events`` turns the gateway's events of one attempt into a ``RolloutRecord``;
everything after it works on records only, so tests and benchmarks build records directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from reins.schemas import MODEL_REQUEST, REWARD, Event, ModelRequest, Reward

TokenArray = NDArray[np.int32]
"""Token IDs: int32 holds every vocabulary in use (the largest are ~256k) at half the size."""
LogprobArray = NDArray[np.float32]


def as_tokens(ids: Sequence[int] | NDArray[np.integer]) -> TokenArray:
    """A 1-D int32 array of token IDs (no copy when ``ids`` already is one)."""
    arr = np.asarray(ids, dtype=np.int32)
    if arr.ndim != 1:
        raise ValueError(f"token IDs must be 1-D, got shape {arr.shape}")
    return arr


@dataclass(slots=True)
class Call:
    """One LLM call as the engine saw it: the exact prompt consumed and response sampled."""

    prompt: TokenArray
    """Prompt token IDs, exactly as consumed (never re-tokenized)."""
    response: TokenArray
    """Response token IDs, exactly as sampled (non-empty)."""
    logprobs: LogprobArray | None = None
    """Rollout logprob of each response token; None when the engine returned none."""
    seq: int = 0
    """The ``model_request`` event's seq: provenance, and the order calls are merged in."""
    model_version: int | None = None
    """Weight version of the engine that served the call."""

    def __post_init__(self) -> None:
        self.prompt = as_tokens(self.prompt)
        self.response = as_tokens(self.response)
        if self.response.size == 0:
            raise ValueError(f"call seq {self.seq} has no response tokens; skip it instead")
        if self.logprobs is not None:
            self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
            if self.logprobs.shape != self.response.shape:
                raise ValueError(
                    f"call seq {self.seq} has {self.logprobs.size} logprobs for "
                    f"{self.response.size} response tokens; the engine must return one per token"
                )


@dataclass(slots=True)
class RolloutRecord:
    """One rollout's succeeded attempt: its calls in event order and its outcome reward."""

    rollout_id: str
    reward: float
    calls: list[Call]
    """In event order (ascending ``seq``)."""
    group_id: str | None = None
    """Rollouts of the same example share it; None: the rollout is a group of its own."""
    attempt_id: int = 1
    skipped_calls: int = 0
    """``model_request`` events dropped by the converter (failed, abandoned, or no tokens
    recorded)."""
    abandoned_calls: int = 0
    """Of those, the calls whose harness hung up or timed out before the answer (``abandoned``):
    the harness never used their answer, its retry (a later call) is the one trained on."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The agent's own numbers about the episode, from the last ``reward`` event."""


class MissingRewardError(ValueError):
    """A rollout's attempt has no ``reward`` event and no fill value was given."""


def numeric_metrics(raw: Any) -> dict[str, float]:
    """The numbers of a reward event's ``metrics`` (`reins.agent.report_reward`); anything else
    a harness put there is left out rather than failing the rollout."""
    if not isinstance(raw, dict):
        return {}
    return {
        str(name): float(value)
        for name, value in raw.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


def rollout_from_events(
    events: Iterable[Event],
    *,
    rollout_id: str | None = None,
    group_id: str | None = None,
    attempt_id: int | None = None,
    missing_reward: float | None = None,
) -> RolloutRecord:
    """Build the record of one rollout attempt from its gateway events.

    - Only events of ``attempt_id`` are read; None reads the latest attempt present in ``events``
      (the succeeded one when the rollout succeeded: a succeeded attempt is always the last).
    - ``model_request`` events are kept when ``status == 200``, they are not ``abandoned`` and
      both prompt and response token IDs are non-empty; the others are counted in
      ``skipped_calls`` (and the abandoned ones in ``abandoned_calls`` too). An abandoned call
      is never kept: dedup keeps the last of identical prompts, which would otherwise be
      whichever finished last, not the answer the harness went on with.
    - The reward is the value of the last ``reward`` event (highest seq). With none, this raises
      ``MissingRewardError`` unless ``missing_reward`` gives a fill value (e.g. 0.0).
    - Other event types are ignored.
    """
    evs = sorted(events, key=lambda e: e.seq)
    if rollout_id is None:
        if not evs:
            raise ValueError("no events and no rollout_id: pass rollout_id= to name the rollout")
        rollout_id = evs[0].rollout_id
    foreign = {e.rollout_id for e in evs} - {rollout_id}
    if foreign:
        raise ValueError(f"events of rollouts {sorted(foreign)} passed for rollout {rollout_id}")
    if attempt_id is None:
        attempt_id = max((e.attempt_id for e in evs), default=1)
    calls: list[Call] = []
    skipped = abandoned = 0
    reward: float | None = None
    metrics: dict[str, float] = {}
    for ev in evs:
        if ev.attempt_id != attempt_id:
            continue
        if ev.type == MODEL_REQUEST:
            req = ModelRequest.model_validate(ev.data)
            if req.abandoned:
                abandoned += 1
            if (
                req.abandoned
                or req.status != 200
                or not req.response_token_ids
                or not req.prompt_token_ids
            ):
                skipped += 1
                continue
            calls.append(
                Call(
                    prompt=as_tokens(req.prompt_token_ids),
                    response=as_tokens(req.response_token_ids),
                    logprobs=(
                        None
                        if req.response_logprobs is None
                        else np.asarray(req.response_logprobs, dtype=np.float32)
                    ),
                    seq=ev.seq,
                    model_version=req.model_version,
                )
            )
        elif ev.type == REWARD:
            reward = Reward.model_validate(ev.data).value
            metrics = numeric_metrics(ev.data.get("metrics"))
    if reward is None:
        if missing_reward is None:
            raise MissingRewardError(
                f"rollout {rollout_id} attempt {attempt_id} has no reward event; have the agent "
                "report one, or pass missing_reward=<value> to fill it"
            )
        reward = missing_reward
    return RolloutRecord(
        rollout_id=rollout_id,
        reward=float(reward),
        calls=calls,
        group_id=group_id,
        attempt_id=attempt_id,
        skipped_calls=skipped,
        abandoned_calls=abandoned,
        metrics=metrics,
    )
