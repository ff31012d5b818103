"""Events: append-only records attached to a rollout attempt."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, TypeVar

import numpy as np
from fastapi import APIRouter, Body, Depends, Header, HTTPException, Query, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import Field, TypeAdapter, ValidationError
from starlette.types import Receive, Scope, Send

from reins.gateway.deps import Admin, AttemptCaller, AttemptIdPath, RolloutIdPath, StoreDep
from reins.gateway.guards import GuardedRoute
from reins.gateway.store import Store
from reins.schemas import (
    RESERVED_EVENT_TYPES,
    REWARD,
    Event,
    EventAck,
    EventIn,
    PackedEvent,
    Reward,
)

router = APIRouter(prefix="/api/rollouts", tags=["events"], route_class=GuardedRoute)

JSON = "application/json"
_E = TypeVar("_E", Event, PackedEvent)

MAX_EVENTS_PER_POST = 10_000
MAX_KEY_LENGTH = 200
"""Of an idempotency key (the events table's column)."""


@router.post("/{rollout_id}/attempt/{attempt_id}/events")
async def append_events(
    rollout_id: RolloutIdPath,
    attempt_id: AttemptIdPath,
    body: Annotated[
        EventIn | Annotated[list[EventIn], Field(max_length=MAX_EVENTS_PER_POST)], Body()
    ],
    store: StoreDep,
    caller: AttemptCaller,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=MAX_KEY_LENGTH)] = None,
) -> EventAck | list[EventAck]:
    """Append one event or a list; answered with the stored events' seqs and keys, no data.

    A retried post with the same idempotency key (in the body or the `Idempotency-Key` header;
    for a list, the header keys each event without one as `{key}:{index}`) is stored once and
    answered with the stored events' acknowledgements. With the attempt's
    scoped token, a post to a superseded attempt or a terminal rollout is 409, and one of a type
    the proxy or the controller writes (`RESERVED_EVENT_TYPES`) is 403; the admin key may still
    annotate any attempt and post any type.
    """
    key = header_text(idempotency_key)
    return await append(store, rollout_id, attempt_id, body, key, from_harness=not caller.is_admin)


def header_text(value: str | None) -> str | None:
    """A header's text as its client wrote it: HTTP reads a header's bytes as Latin-1, while
    clients send a non-ASCII key as UTF-8 ("é" was stored as "Ã©"). Bytes that are not UTF-8
    stay as read."""
    if value is None or value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value


async def append(
    store: Store,
    rollout_id: str,
    attempt_id: int,
    body: EventIn | list[EventIn],
    idempotency_key: str | None,
    *,
    from_harness: bool,
) -> EventAck | list[EventAck]:
    """The work of an event post, shared with its fast endpoint (`reins.gateway.fast`)."""
    if from_harness:
        _refuse_reserved_types(body)
    _check_rewards(body)
    if isinstance(body, list):
        if idempotency_key:
            body = _keyed_items(body, idempotency_key)
        stored = await store.append_events(rollout_id, attempt_id, body, from_harness=from_harness)
        return [_ack(e) for e in stored]
    if body.idempotency_key is None and idempotency_key:
        body = body.model_copy(update={"idempotency_key": idempotency_key})
    (event,) = await store.append_events(rollout_id, attempt_id, [body], from_harness=from_harness)
    return _ack(event)


def _refuse_reserved_types(body: EventIn | list[EventIn]) -> None:
    events = body if isinstance(body, list) else [body]
    reserved = sorted({event.type for event in events} & RESERVED_EVENT_TYPES)
    if reserved:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"{', '.join(reserved)} events are written by the gateway's proxy and the "
            "controller: an attempt's scoped token may not post them (the admin key may)",
        )


def _keyed_items(events: list[EventIn], key: str) -> list[EventIn]:
    """A list post's `Idempotency-Key` keys each event that has no key of its own as
    `{key}:{i}`, `i` its place in the list: a retried list is then stored once, as a retried
    single event is."""
    if all(event.idempotency_key for event in events):
        return events
    longest = len(f"{key}:{len(events) - 1}")
    if longest > MAX_KEY_LENGTH:
        raise RequestValidationError(
            [
                {
                    "loc": ("header", "idempotency-key"),
                    "msg": f"String should have at most {MAX_KEY_LENGTH - (longest - len(key))} "
                    f"characters for a list of {len(events)} events (each event's key is "
                    "`{key}:{index}`, at most 200 characters)",
                    "type": "too_long",
                }
            ]
        )
    return [
        event
        if event.idempotency_key
        else event.model_copy(update={"idempotency_key": f"{key}:{index}"})
        for index, event in enumerate(events)
    ]


def _check_rewards(body: EventIn | list[EventIn]) -> None:
    """A `reward` event's data must fit `Reward` (a finite number `value`): the trainer reads
    it at every step, so one that does not is refused here (422 naming the field, nothing of the
    post stored) rather than stored and found when a step reads it."""
    located = list(enumerate(body)) if isinstance(body, list) else [(None, body)]
    errors: list[Any] = []
    for index, event in located:
        if event.type != REWARD:
            continue
        try:
            Reward.model_validate(event.data)
        except ValidationError as error:
            at = ("body",) if index is None else ("body", index)
            errors += [
                {"loc": (*at, "data", *e["loc"]), "msg": e["msg"], "type": e["type"]}
                for e in error.errors()
            ]
    if errors:
        raise RequestValidationError(errors)


def _ack(event: Event) -> EventAck:
    return EventAck.model_construct(
        seq=event.seq,
        rollout_id=event.rollout_id,
        attempt_id=event.attempt_id,
        type=event.type,
        idempotency_key=event.idempotency_key,
        created_at=event.created_at,
    )


def _event_filter(
    attempt_id: Annotated[
        int | None, Query(ge=1, le=1_000_000, description="Default: the latest attempt")
    ] = None,
    all_attempts: Annotated[bool, Query(description="Events of every attempt")] = False,
    type: Annotated[
        list[str] | None, Query(max_length=100, description="Keep these event types")
    ] = None,
    after: Annotated[int, Query(ge=0, le=2**62, description="Events with seq above this")] = 0,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> dict[str, Any]:
    """The query of both event reads, as the store's keyword arguments."""
    return {
        "attempt_id": attempt_id,
        "all_attempts": all_attempts,
        "types": type or (),
        "after": after,
        "limit": limit,
    }


EventFilter = Annotated[dict[str, Any], Depends(_event_filter)]


@router.get("/{rollout_id}/events", response_model=list[Event])
async def read_events(
    rollout_id: RolloutIdPath, store: StoreDep, _: Admin, query: EventFilter
) -> Response:
    """Events in seq order; page with `after` = the last seq read."""
    # Prompts as arrays: as lists, a long rollout's are millions of ints that the garbage
    # collector walks (gen 0 and 1 collections of 20-90 ms, every thread held meanwhile).
    return await _json(_EVENTS, await store.get_events(rollout_id, token_arrays=True, **query))


@router.get("/{rollout_id}/events/packed", response_model=list[PackedEvent])
async def read_packed_events(
    rollout_id: RolloutIdPath, store: StoreDep, _: Admin, query: EventFilter
) -> Response:
    """The events as stored: a `model_request` packed against an earlier call of its attempt
    comes with its blob (`packed`, base64; `reins.packed.unpack_events` restores the events of
    an attempt read from its first call). A copy or an export of a long rollout costs its
    length, not the square of its turns."""
    return await _json(_PACKED_EVENTS, await store.get_packed_events(rollout_id, **query))


_EVENTS: TypeAdapter[list[Event]] = TypeAdapter(list[Event])
_PACKED_EVENTS: TypeAdapter[list[PackedEvent]] = TypeAdapter(list[PackedEvent])


async def _json(adapter: TypeAdapter[list[_E]], events: list[_E]) -> Response:
    """The events' JSON, encoded in a thread: a long rollout's whole events are ~140 MB of JSON
    (200 calls growing to 128k tokens), ~0.7 s that held up every other request on the loop.
    The thread also drops the events: freeing their token IDs (millions of ints) took the loop
    ~0.1 s more when the last reference went here."""
    held = [events]
    del events
    return PartsResponse(await asyncio.to_thread(_parts_and_drop, adapter, held))


def _parts_and_drop(adapter: TypeAdapter[list[_E]], held: list[list[_E]]) -> list[bytes]:
    return event_parts(adapter, held.pop())


class PartsResponse(Response):
    """A JSON answer sent as the parts it was encoded in, one body message each: joining 140 MB
    of parts into one `bytes` (twice: the array's brackets) held the interpreter lock, and so the
    event loop, for ~0.25 s; a part at a time, uvicorn's flow control lets the loop run between
    them. `Content-Length` is their sum: the same answer, byte for byte."""

    media_type = JSON

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        super().__init__(media_type=JSON)
        self.headers["content-length"] = str(sum(map(len, parts)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        for index, part in enumerate(self.parts, 1):
            await send(
                {"type": "http.response.body", "body": part, "more_body": index < len(self.parts)}
            )


SLICE_TOKENS = 50_000
"""Token IDs (or their packed bytes / 4) encoded in one call of the encoder."""
_SLICE_EVENTS = 1000


def event_parts(adapter: TypeAdapter[list[_E]], events: list[_E]) -> list[bytes]:
    """`adapter.dump_json(events)` in parts (their concatenation), encoded in slices of about
    `SLICE_TOKENS` tokens: the encoder holds the interpreter lock for the whole of one call, so
    a thread encoding a long rollout in one call stalled the event loop for as long (~0.7 s for
    140 MB); between slices the loop runs."""
    parts: list[bytes] = [b"["]
    start = weight = 0

    def add(end: int) -> None:
        if len(parts) > 1:
            parts.append(b",")
        parts.append(adapter.dump_json(events[start:end], fallback=_array_as_list)[1:-1])

    for end, event in enumerate(events, 1):
        weight += _tokens(event)
        if weight >= SLICE_TOKENS or end - start >= _SLICE_EVENTS:
            add(end)
            start, weight = end, 0
    if start < len(events):
        add(len(events))
    parts.append(b"]")
    return parts


def _array_as_list(value: Any) -> Any:
    """A prompt restored as an array (`token_arrays`) is written as the list it stands for: a
    list made for the moment of its encoding, never held by the events."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"Unable to serialize unknown type: {type(value)}")


def encode_events(adapter: TypeAdapter[list[_E]], events: list[_E]) -> bytes:
    """`adapter.dump_json(events)`, as `event_parts` encodes it."""
    return b"".join(event_parts(adapter, events))


def _tokens(event: Event | PackedEvent) -> int:
    if isinstance(event, PackedEvent):
        return 1 + len(event.packed or "") // 4
    prompt = event.data.get("prompt_token_ids")
    return 1 + (len(prompt) if isinstance(prompt, list | np.ndarray) else 0)
