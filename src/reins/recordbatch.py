"""The trainer's binary read: a set of rollouts' calls and rewards in one answer, as arrays.

`POST /api/records` answers this instead of JSON events. Calls come as the store packs them
(`reins.packed`): each one's new prompt tokens and its response, with the earlier call of the
same attempt whose first `keep` tokens its prompt starts with. The reader lays a rollout's
calls out in one int32 buffer, so that a call extending the previous one (the usual agent turn)
adds only its new tokens: every `Call`'s prompt and response are views into that buffer, and a
rollout costs its final sequence's size, not the sum of its prompts.

Layout (little-endian): `RRB1`, a u32 header size, the JSON header (per rollout: id, attempt,
the last reward event's data, one row per call), then each call's data in order: a packed call's
token stream as the store keeps it (zlib; the reader decompresses it, so that work is off the
gateway and runs while the next chunk is read), or a whole call's int32 tokens (new prompt
tokens, then the response) and float32 logprobs.

`records_from_batch` turns a decoded rollout into a `RolloutRecord` under the same rules as
`reins.samples.records.rollout_from_events` (tests hold the two equal).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from numpy.typing import NDArray

from reins.packed import decode_stream_into
from reins.samples.records import Call, RolloutRecord, reward_of

MAGIC = b"RRB1"
MEDIA_TYPE = "application/vnd.reins.records"
_SIZE = struct.Struct("<I")


@dataclass(slots=True)
class CallParts:
    """One `model_request` of an attempt, as the batch carries it."""

    seq: int
    base: int
    """Index of the earlier call (in this rollout's list) whose tokens the prompt starts with;
    -1: none."""
    keep: int
    tail: int
    """New prompt tokens."""
    response: int
    logprob_kind: str
    """"f4", "f8" or "none"."""
    status: Any
    abandoned: Any
    model_version: Any
    stream: bytes | memoryview | None = None
    """A packed call's token stream as stored (`reins.packed.Prefix.stream`): decompressed by the
    reader, which keeps that work off the gateway."""
    arrays: tuple[NDArray[np.int32], NDArray[np.int32], NDArray[Any] | None] | None = None
    """A call stored whole: its prompt, response and logprobs."""
    tokens: bool = True
    """False: the event holds no token IDs usable for training (it is counted as skipped and is
    never a base)."""
    choice: int = 0
    """Its `choice_index` (`Call.choice`): which choice of an `n > 1` request it is."""
    other_model: bool = False
    """Served by another registered model than the one the read names (`RecordsRequest.model`):
    laid out (a later call may be packed against it), never trained."""


@dataclass(slots=True)
class RolloutParts:
    rollout_id: str
    attempt_id: int
    reward: Any
    """The data of the attempt's last `reward` event; None when it has none."""
    calls: list[CallParts] = field(default_factory=list)


_LOGPROB_CODES = {"none": 0, "f4": 1, "f8": 2}
_USABLE_OTHER_MODEL = 2
"""A call row's `usable` code beside 0 (no token IDs) and 1: another model's call. Only sent
when the read names its model, which a reader from before it never does."""


def encode(rollouts: Sequence[RolloutParts]) -> bytes:
    header: list[dict[str, Any]] = []
    data: list[bytes | memoryview] = []
    for rollout in rollouts:
        rows = []
        for call in rollout.calls:
            if call.stream is not None:
                data.append(call.stream)
                size = len(call.stream)
                kind = call.logprob_kind
            else:
                tail, response, logprobs = call.arrays or (_EMPTY, _EMPTY, None)
                parts = [tail.astype("<i4").tobytes(), response.astype("<i4").tobytes()]
                kind = "none"
                if logprobs is not None:
                    parts.append(logprobs.astype("<f4").tobytes())
                    kind = "f4"
                data.append(b"".join(parts))
                size = -1
            rows.append(
                [
                    call.seq,
                    call.base,
                    call.keep,
                    call.tail,
                    call.response,
                    _LOGPROB_CODES[kind],
                    call.status,
                    call.abandoned,
                    call.model_version,
                    _USABLE_OTHER_MODEL if call.other_model and call.tokens else int(call.tokens),
                    size,
                ]
            )
        entry = {
            "rollout_id": rollout.rollout_id,
            "attempt_id": rollout.attempt_id,
            "reward": rollout.reward,
            "calls": rows,
        }
        # Beside the rows (whose shape a reader before it unpacks): only the calls of an `n > 1`
        # request's other choices, which are rare.
        choices = {str(i): call.choice for i, call in enumerate(rollout.calls) if call.choice}
        if choices:
            entry["choices"] = choices
        header.append(entry)
    head = orjson.dumps({"rollouts": header})
    return b"".join([MAGIC, _SIZE.pack(len(head)), head, *data])


_EMPTY = np.zeros(0, dtype=np.int32)


@dataclass(slots=True)
class DecodedRollout:
    rollout_id: str
    attempt_id: int
    reward: Any
    calls: list[Call]
    """The calls `rollout_from_events` keeps, prompts and responses as views of one buffer."""
    skipped_calls: int
    abandoned_calls: int
    other_model_calls: int = 0


def decode(body: bytes) -> list[DecodedRollout]:
    if body[:4] != MAGIC:
        raise ValueError("not a reins record batch (expected RRB1): is the gateway up to date?")
    (size,) = _SIZE.unpack_from(body, 4)
    header = orjson.loads(body[8 : 8 + size])
    view = memoryview(body)
    at = 8 + size
    kinds = ("none", "f4", "f8")
    out = []
    for rollout in header["rollouts"]:
        rows = rollout["calls"]
        choices: dict[str, int] = rollout.get("choices", {})
        # Where each call's sequence (prompt + response) lies in the rollout's buffer: right
        # after its base when the base is the last one laid out and it keeps all of it.
        regions: list[tuple[int, int]] = []
        end = 0
        for _seq, base, keep, tail, resp, *_ in rows:
            if base >= 0 and regions[base][1] == keep and sum(regions[base]) == end:
                start = regions[base][0]
            else:
                start = end
            regions.append((start, keep + tail + resp))
            end = start + keep + tail + resp
        buffer = np.empty(end, dtype=np.int32)
        # Every call's logprobs, one slice per call (those without any get none).
        answers = np.empty(sum(row[4] for row in rows), dtype=np.float32)
        answered = 0
        calls: list[Call] = []
        skipped = abandoned = other = 0
        for index, row in enumerate(rows):
            seq, base, keep, tail, resp, lp, status, gave_up, version, usable, stream = row
            start, length = regions[index]
            prefix_at = start + keep
            if base >= 0 and keep and start != regions[base][0]:
                b_start = regions[base][0]
                buffer[start:prefix_at] = buffer[b_start : b_start + keep]
            elif base < 0 and keep:
                raise ValueError(f"call seq {seq} keeps {keep} tokens of no base")
            kind = kinds[lp]
            logprobs = None if kind == "none" else answers[answered : answered + resp]
            answered += resp
            at = _fill(view, at, stream, kind, buffer[prefix_at : start + length], logprobs)
            if gave_up is True:
                abandoned += 1
            if gave_up is True or status != 200 or not usable or not resp or not keep + tail:
                skipped += 1
                continue
            if usable == _USABLE_OTHER_MODEL:
                other += 1
                continue
            calls.append(
                Call(
                    prompt=buffer[start : prefix_at + tail],
                    response=buffer[prefix_at + tail : start + length],
                    logprobs=logprobs,
                    seq=seq,
                    model_version=version if type(version) is int else None,
                    choice=choices.get(str(index), 0),
                )
            )
        out.append(
            DecodedRollout(
                rollout["rollout_id"],
                rollout["attempt_id"],
                rollout["reward"],
                calls,
                skipped,
                abandoned,
                other,
            )
        )
    return out


def _fill(
    view: memoryview,
    at: int,
    stream: int,
    kind: str,
    tokens: NDArray[np.int32],
    logprobs: NDArray[np.float32] | None,
) -> int:
    """A call's new prompt tokens and response (`tokens`) and logprobs from its data at `at`;
    where the next call's data starts."""
    if stream >= 0:
        decode_stream_into(view[at : at + stream], tokens, logprobs, kind)
        return at + stream
    tokens[:] = np.frombuffer(view, dtype="<i4", count=tokens.size, offset=at)
    at += 4 * tokens.size
    if logprobs is not None:
        logprobs[:] = np.frombuffer(view, dtype="<f4", count=logprobs.size, offset=at)
        at += 4 * logprobs.size
    return at


def record_of(
    decoded: DecodedRollout, *, group_id: str | None = None, missing_reward: float | None = None
) -> RolloutRecord:
    """The `RolloutRecord` `rollout_from_events` builds from the same attempt's events."""
    reward, metrics = reward_of(
        decoded.reward, decoded.rollout_id, decoded.attempt_id, missing_reward
    )
    return RolloutRecord(
        rollout_id=decoded.rollout_id,
        reward=float(reward),
        calls=decoded.calls,
        group_id=group_id,
        attempt_id=decoded.attempt_id,
        skipped_calls=decoded.skipped_calls,
        abandoned_calls=decoded.abandoned_calls,
        other_model_calls=decoded.other_model_calls,
        metrics=metrics,
    )
