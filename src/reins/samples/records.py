"""The adapter's input: one rollout's recorded LLM calls and its reward, as plain arrays.

``rollout_from_events`` turns the gateway's events of one attempt into a ``RolloutRecord``;
everything after it works on records only, so tests and benchmarks build records directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from reins.schemas import MODEL_REQUEST, REWARD, Event, ModelRequest, parse_reward

TokenArray = NDArray[np.int32]
"""Token IDs: int32 holds every vocabulary in use (the largest are ~256k) at half the size."""
LogprobArray = NDArray[np.float32]


def as_tokens(ids: Sequence[int] | NDArray[np.integer]) -> TokenArray:
    """A 1-D int32 array of token IDs (``ids`` itself when it already is one); for any other
    input, a ValueError for IDs that are not integers from 0 to 2**31 - 1 (a cast would wrap
    2**32 + 7 to 7 and cut 1.9 to 1, silently)."""
    source = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if source.dtype == np.int32 and source.ndim == 1:
        # Taken as it is, unscanned: the trainer's binary read lays out millions of tokens as
        # int32 views (checked when they were stored), and a min and max over each call's
        # whole prompt cost a pass over every rollout's prompts again.
        return source  # type: ignore[return-value]
    if source.ndim != 1:
        raise ValueError(f"token IDs must be 1-D, got shape {source.shape}")
    if not source.size:
        return source.astype(np.int32, copy=False)
    if source.dtype.kind not in "iu":
        raise ValueError(f"token IDs must be integers, got {source.dtype} values")
    low, high = int(source.min()), int(source.max())
    if low < 0 or high > _INT32_MAX:
        raise ValueError(f"token IDs must be from 0 to 2**31 - 1, got {low if low < 0 else high}")
    return source.astype(np.int32, copy=False)


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
    choice: int = 0
    """Which choice of an `n > 1` request it is (the proxy records one call per choice, all with
    the request's prompt; `choice_index`): 0 is the first, or the only one."""

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


_INT32_MAX = 2**31 - 1
_STATE_FIELDS = ("status", "abandoned", "model_version")


class CheckedTokenIds(list[int]):
    """A list of token IDs that `token_ids` accepted, with the int32 array it made of them.

    The proxy checks an engine's token IDs once, when it records the call; the token reuse
    memory and the store's packing, which each made the same array again from the list
    (~3.5 ms for a 116k-token prompt, holding the interpreter lock), take this one. It is a
    list still: every reader, encoder and comparison sees the plain list (`checked`)."""

    __slots__ = ("array",)
    array: TokenArray


def checked(value: list[int], array: TokenArray) -> CheckedTokenIds:
    """`value` (which `token_ids` made `array` of) carrying that array; no copy of the array."""
    ids = CheckedTokenIds(value)
    ids.array = array
    return ids


def token_ids(value: Any) -> TokenArray | None:
    """`value` as int32 token IDs, or None when it is not a list of ints (no bool, float or
    string) from 0 to 2**31 - 1. A 1-D int32 array (a call restored with `token_arrays`,
    `reins.packed.unpack`) is taken as it is when none is negative, and a `CheckedTokenIds`'s
    array when the list still has its length (it is read-only: nobody appends to a record's
    token IDs)."""
    if type(value) is CheckedTokenIds and len(value) == value.array.size:
        return value.array
    if isinstance(value, np.ndarray):
        if value.dtype != np.int32 or value.ndim != 1 or (value.size and int(value.min()) < 0):
            return None
        return value
    if not isinstance(value, list):
        return None
    if not value:
        return np.zeros(0, dtype=np.int32)
    if set(map(type, value)) != {int}:
        return None
    try:
        wide = np.array(value, dtype=np.int64)
    except OverflowError:
        return None
    if int(wide.min()) < 0 or int(wide.max()) > _INT32_MAX:
        return None
    return wide.astype(np.int32)


def response_logprobs(value: Any, count: int) -> LogprobArray | None:
    """A call's logprobs for its `count` response tokens, or None (unknown) when they are
    absent, null, of another length, or not all numbers."""
    if not isinstance(value, list) or len(value) != count:
        return None
    if value and not set(map(type, value)) <= {float, int}:
        return None
    return np.asarray(value, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class CallState:
    status: int
    abandoned: bool
    model_version: int | None


def call_state(data: Mapping[str, Any]) -> CallState | None:
    """A `model_request`'s `status`, `abandoned` and `model_version` as `ModelRequest` reads
    them (`abandoned: 1` is abandoned, `model_version: 3.0` is 3), or None when they do not
    validate (the call is then skipped)."""
    status = data.get("status", 200)
    abandoned = data.get("abandoned", False)
    version = data.get("model_version")
    exact = version is None or type(version) is int
    if exact and type(status) is int and type(abandoned) is bool:
        return CallState(status, abandoned, version)
    try:
        read = ModelRequest.model_validate({k: data[k] for k in _STATE_FIELDS if k in data})
    except ValueError:  # pydantic's ValidationError
        return None
    return CallState(read.status, read.abandoned, read.model_version)


def of_another_model(data: Mapping[str, Any], model: str | None) -> bool:
    """Whether a `model_request` was served by another registered model than `model` (None:
    any model is the policy). Its recorded `model` is the registered name that served it (the
    proxy sends a name it does not know to the first registered model, and records that one's);
    a call recorded without one is taken as the policy's."""
    served = data.get("model")
    return model is not None and isinstance(served, str) and served != model


def call_of(data: Any, seq: int) -> tuple[Call | None, bool]:
    """The call a `model_request`'s data gives the trainer (None: skipped), and whether it was
    abandoned. The one rule of both readers: `rollout_from_events` and the gateway's binary
    read (`reins.recordbatch`). A call is kept when its status is 200, it is not abandoned,
    and both its prompt and response are non-empty token IDs (`token_ids`); its logprobs are
    kept when they are one number per response token (`response_logprobs`). Of the calls kept,
    the readers leave out those another model served (`of_another_model`)."""
    if not isinstance(data, Mapping):
        return None, False
    state = call_state(data)
    if state is None or state.abandoned or state.status != 200:
        return None, state is not None and state.abandoned
    prompt = token_ids(data.get("prompt_token_ids", []))
    response = token_ids(data.get("response_token_ids", []))
    if prompt is None or response is None or not prompt.size or not response.size:
        return None, False
    logprobs = response_logprobs(data.get("response_logprobs"), response.size)
    return Call(prompt, response, logprobs, seq, state.model_version, choice_of(data)), False


def choice_of(data: Mapping[str, Any]) -> int:
    """A `model_request`'s `choice_index` (0 when absent or not a count)."""
    choice = data.get("choice_index")
    return choice if type(choice) is int and choice > 0 else 0


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
    other_model_calls: int = 0
    """Calls another registered model served (``of_another_model``), which would have been kept
    (not counted in ``skipped_calls``): not the policy's actions, never trained."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The agent's own numbers about the episode, from the last ``reward`` event."""


class MissingRewardError(ValueError):
    """A rollout's attempt has no usable ``reward`` event and no fill value was given."""


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


def reward_of(
    data: Any, rollout_id: str, attempt_id: int, missing_reward: float | None
) -> tuple[float, dict[str, float]]:
    """The reward and metrics of an attempt from its last ``reward`` event's data (None: it has
    none). A reward that does not fit the `Reward` schema (stored before the gateway checked
    them) is a missing one, never an error of the whole read: ``missing_reward`` fills either,
    and without it this raises ``MissingRewardError`` naming the rollout and what was wrong."""
    problem = "has no reward event"
    if data is not None:
        reward = parse_reward(data)
        if isinstance(reward, str):
            problem = f"has a reward event that does not parse ({reward})"
        else:
            return reward.value, numeric_metrics(getattr(reward, "metrics", None))
    if missing_reward is None:
        raise MissingRewardError(
            f"rollout {rollout_id} attempt {attempt_id} {problem}; have the agent report one "
            "(`reins.agent.report_reward`), or pass missing_reward=<value> to fill it"
        )
    return missing_reward, {}


def rollout_from_events(
    events: Iterable[Event],
    *,
    rollout_id: str | None = None,
    group_id: str | None = None,
    attempt_id: int | None = None,
    missing_reward: float | None = None,
    model: str | None = None,
) -> RolloutRecord:
    """Build the record of one rollout attempt from its gateway events.

    - Only events of ``attempt_id`` are read; None reads the latest attempt present in ``events``
      (the succeeded one when the rollout succeeded: a succeeded attempt is always the last).
    - ``model_request`` events are kept when ``status == 200``, they are not ``abandoned`` and
      both prompt and response token IDs are non-empty (``call_of``, the gateway's binary read's
      rule too); the others are counted in ``skipped_calls`` (and the abandoned ones in
      ``abandoned_calls`` too). With ``model`` (the policy's registered name), the kept calls
      another model served are left out and counted in ``other_model_calls``. An abandoned call
      is never kept: dedup keeps the last of identical prompts, which would otherwise be
      whichever finished last, not the answer the harness went on with.
    - The reward is the value of the last ``reward`` event (highest seq). With none, or one that
      does not parse, this raises ``MissingRewardError`` unless ``missing_reward`` gives a fill
      value (e.g. 0.0); see ``reward_of``.
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
    skipped = abandoned = other = 0
    reward_data: Any = None
    for ev in evs:
        if ev.attempt_id != attempt_id:
            continue
        if ev.type == MODEL_REQUEST:
            call, gave_up = call_of(ev.data, ev.seq)
            abandoned += gave_up
            if call is None:
                skipped += 1
            elif of_another_model(ev.data, model):
                other += 1
            else:
                calls.append(call)
        elif ev.type == REWARD:
            reward_data = ev.data
    reward, metrics = reward_of(reward_data, rollout_id, attempt_id, missing_reward)
    return RolloutRecord(
        rollout_id=rollout_id,
        reward=float(reward),
        calls=calls,
        group_id=group_id,
        attempt_id=attempt_id,
        skipped_calls=skipped,
        abandoned_calls=abandoned,
        other_model_calls=other,
        metrics=metrics,
    )
