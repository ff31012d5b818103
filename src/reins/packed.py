"""The packed form of a `model_request` event: what the store writes, so that a rollout's records
grow with its length, not with the square of its turns.

An agent's call N repeats call N-1's whole context: its prompt starts with call N-1's prompt +
response, and its request holds every earlier message again. Stored as posted, a rollout of T
turns costs ~T/2 times its final sequence (issue #17). Packed, a call keeps only what is new
against a *base*, an earlier packed call of the same attempt:

- the prompt: the first `keep` tokens of the base's prompt + response, then its own tail;
- the request, key by key: a value equal to the base's is named only; a list that starts with
  the base's list keeps that prefix's length and its own tail; anything else is kept whole;
- token IDs as int32, logprobs as float32 when each one survives the round trip (else float64),
  both byte plane by byte plane, in one zlib stream with a block (its own Huffman table) per
  plane (all the trainer's read needs, readable without any other blob);
- the rest (the request's delta, the answer as the harness got it, the event's other fields but
  `COLUMN_FIELDS`) as JSON in a second zlib stream, whose preset dictionary is the base's own
  text: the next request usually carries the base's answer again as its assistant message, and
  the fields and keys mostly repeat.

Both streams favour Huffman coding over short matches (`Z_FILTERED`): in text that does not
repeat, a 3-5 byte match costs more than the literals it replaces (5.0 against 4.55 bits a
character on random words), while the long repeats (the answer again) are still found.
Format 1 (before 2026-12-02) kept every field but the packed ones in the JSON column and used
the base's answer alone as the text's dictionary; it is still read.

Every field is restored exactly (JSON values, key order, int versus float); a document this form
cannot carry exactly (token IDs that are not int32, logprobs that are not all floats, an integer
beyond 64 bits) is simply not packed and is stored whole. `data` must already satisfy the JSON
rule (`reins.gateway.jsonrule`: no NaN), as the store checks before it packs. Pure functions on
plain data: the gateway's store packs and unpacks, the trainer's read decodes token streams
(`reins.recordbatch`).
"""

from __future__ import annotations

import base64
import hashlib
import struct
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from numpy.typing import NDArray

from reins.samples.records import token_ids
from reins.schemas import Event, PackedEvent

FORMAT = 2
_READABLE = (1, 2)
PACKED_FIELDS = (
    "prompt_token_ids",
    "response_token_ids",
    "response_logprobs",
    "request",
    "response",
)
"""The fields of a `model_request` the packed blob holds as arrays or deltas."""
COLUMN_FIELDS = ("model_version", "status", "abandoned", "model")
"""The fields that stay in the JSON column, where queries and the trainer's read find them
without opening the blob; the blob's text holds every other field (`model` was there in calls
packed before 2026-12-07: those are read as the policy's, `samples.records.of_another_model`)."""


def _in_column(key: str, value: Any) -> bool:
    """Whether a field stays in the JSON column: `COLUMN_FIELDS`, and a `choice_index` other
    than 0 (which choice of an `n > 1` request the call is: the trainer's read keeps the first
    when no later call shows which one the harness took; 0, the usual one, costs nothing)."""
    return key in COLUMN_FIELDS or (key == "choice_index" and value != 0)


_ZDICT_BYTES = 32 * 1024  # zlib's window
_LEVEL = 6
_BLOCKS_FROM = 2048
_HEADER = struct.Struct("<I")
_PREFIX = struct.Struct("<BqIIIBI")
"""A blob's uncompressed start: format, base seq (-1: none), keep, tail and response lengths,
logprob kind, the token stream's size. Then two zlib streams: the tokens and logprobs (all the
trainer's read needs), and the text (the JSON header with the request's delta and the other
fields, then the answer), whose preset dictionary is the base's text."""
_LOGPROB_KINDS = ("absent", "null", "f4", "f8")

Digest = bytes


def _digest(value: Any) -> Digest:
    return hashlib.blake2b(orjson.dumps(value), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What a later request is compared with: a digest of each key's value, and of each element
    of the list values (exact JSON equality: `1`, `1.0` and `true` differ, key order counts)."""

    whole: dict[str, Digest]
    elements: dict[str, list[Digest]]


def request_shape(request: Any) -> RequestShape | None:
    if not isinstance(request, dict):
        return None
    whole: dict[str, Digest] = {}
    elements: dict[str, list[Digest]] = {}
    for key, value in request.items():
        if isinstance(value, list):
            parts = [_digest(item) for item in value]
            elements[key] = parts
            whole[key] = hashlib.blake2b(b"".join(parts), digest_size=16).digest()
        else:
            whole[key] = _digest(value)
    return RequestShape(whole, elements)


@dataclass(frozen=True, slots=True)
class Base:
    """A packed call as a later call of its attempt is packed against: light (no request body)."""

    seq: int
    tokens: NDArray[np.int32]
    """Its prompt + response."""
    request: RequestShape | None
    text: bytes
    """Its blob's text stream, uncompressed: the preset dictionary of the next call (of a
    format-1 call: the answer at its end)."""


@dataclass(frozen=True, slots=True)
class Packed:
    skeleton: dict[str, Any]
    """The event's other fields, for the JSON column."""
    blob: bytes
    base_seq: int | None
    prompt_tokens: int
    response_tokens: int
    tokens: NDArray[np.int32]
    request: RequestShape | None
    text: bytes

    def as_base(self, seq: int) -> Base:
        return Base(seq, self.tokens, self.request, self.text)


def _logprob_array(value: Any, count: int) -> tuple[str, NDArray[Any]] | None:
    """("f4" | "f8", array), or None when the values are not exactly `count` floats."""
    if not isinstance(value, list) or len(value) != count:
        return None
    if value and set(map(type, value)) != {float}:
        return None
    wide = np.array(value, dtype=np.float64)
    narrow = wide.astype(np.float32)
    if np.array_equal(narrow.astype(np.float64), wide) and not _signs_differ(narrow, wide):
        return "f4", narrow
    return "f8", wide


def _signs_differ(narrow: NDArray[np.float32], wide: NDArray[np.float64]) -> bool:
    return bool(np.any(np.signbit(narrow) != np.signbit(wide)))


def _common_prefix(a: NDArray[np.int32], b: NDArray[np.int32]) -> int:
    n = min(a.size, b.size)
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _prefix_count(a: Sequence[Digest], b: Sequence[Digest]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _request_delta(
    request: Any, shape: RequestShape | None, base: RequestShape | None
) -> dict[str, Any]:
    if shape is None or base is None or not isinstance(request, dict):
        return {"whole": request}
    same: list[str] = []
    prefix: dict[str, int] = {}
    own: dict[str, Any] = {}
    for key, value in request.items():
        if base.whole.get(key) == shape.whole[key]:
            same.append(key)
            continue
        keep = 0
        if key in shape.elements and key in base.elements:
            keep = _prefix_count(shape.elements[key], base.elements[key])
        if keep:
            prefix[key] = keep
            own[key] = value[keep:]
        else:
            own[key] = value
    return {"order": list(request), "same": same, "prefix": prefix, "own": own}


def pack(data: Any, bases: Sequence[Base] = (), *, level: int = _LEVEL) -> Packed | None:
    """The packed form of a `model_request`'s `data`, against the one of `bases` (earlier calls
    of its attempt, oldest first) that shares the longest token prefix with its prompt (the
    latest on a tie; none when `bases` is empty), or None when it cannot be packed exactly (it
    is then stored whole)."""
    if not isinstance(data, dict) or "prompt_token_ids" not in data:
        return None
    prompt = token_ids(data["prompt_token_ids"])
    response = token_ids(data.get("response_token_ids", []))
    if prompt is None or response is None:
        return None
    logprobs: tuple[str, NDArray[Any]] | None = None
    logprob_kind = "absent"
    if "response_logprobs" in data:
        raw = data["response_logprobs"]
        if raw is None:
            logprob_kind = "null"
        else:
            logprobs = _logprob_array(raw, response.size)
            if logprobs is None:
                return None
            logprob_kind = logprobs[0]
    request = data.get("request")
    try:
        shape = request_shape(request)
    except (TypeError, orjson.JSONEncodeError):
        return None  # an integer beyond 64 bits: stored whole
    base: Base | None = None
    keep = -1
    for candidate in reversed(bases):
        if keep == prompt.size:
            break  # no earlier one can share more
        if min(prompt.size, candidate.tokens.size) <= keep:
            continue
        shared = _common_prefix(prompt, candidate.tokens)
        if shared > keep:
            base, keep = candidate, shared
    keep = max(keep, 0)
    header: dict[str, Any] = {
        "order": list(data),
        "resp_key": "response_token_ids" in data,
        "req": _request_delta(request, shape, None if base is None else base.request),
        "fields": {
            key: value
            for key, value in data.items()
            if key not in PACKED_FIELDS and not _in_column(key, value)
        },
    }
    try:
        header_json = orjson.dumps(header)
        answer = orjson.dumps(data["response"]) if "response" in data else b""
    except (TypeError, orjson.JSONEncodeError):
        return None  # an integer beyond 64 bits: stored whole
    planes = _planes(np.concatenate([prompt[keep:], response]))
    if logprobs is not None:
        planes.extend(_planes(logprobs[1]))
    token_stream = _compress_blocks(planes, level)
    text = b"".join([_HEADER.pack(len(header_json)), header_json, answer])
    zdict = base.text[-_ZDICT_BYTES:] if base is not None else b""
    compressor = _compressor(level, zdict)
    prefix = _PREFIX.pack(
        FORMAT,
        -1 if base is None else base.seq,
        keep,
        prompt.size - keep,
        response.size,
        _LOGPROB_KINDS.index(logprob_kind),
        len(token_stream),
    )
    blob = b"".join([prefix, token_stream, compressor.compress(text), compressor.flush()])
    skeleton = {key: value for key, value in data.items() if _in_column(key, value)}
    return Packed(
        skeleton=skeleton,
        blob=blob,
        base_seq=None if base is None else base.seq,
        prompt_tokens=int(prompt.size),
        response_tokens=int(response.size),
        tokens=np.concatenate([prompt, response]),
        request=shape,
        text=text,
    )


def _compressor(level: int, zdict: bytes) -> zlib._Compress:
    """A zlib stream that favours Huffman codes over short matches (see the module's doc)."""
    if zdict:
        return zlib.compressobj(level, zlib.DEFLATED, 15, 9, zlib.Z_FILTERED, zdict)
    return zlib.compressobj(level, zlib.DEFLATED, 15, 9, zlib.Z_FILTERED)


def _compress_blocks(parts: Sequence[bytes], level: int) -> bytes:
    """One zlib stream, a deflate block per part: each byte plane gets its own Huffman table
    (a token ID's low bytes are near uniform, its high bytes nearly constant). Under
    `_BLOCKS_FROM` bytes in all, one block: the tables would cost more than they save, and
    each block's are built on the event's write path (~10 us a block)."""
    compressor = _compressor(level, b"")
    if sum(map(len, parts)) < _BLOCKS_FROM:
        return compressor.compress(b"".join(parts)) + compressor.flush()
    out = [compressor.compress(part) + compressor.flush(zlib.Z_BLOCK) for part in parts]
    return b"".join([*out, compressor.flush()])


def _answer_of(text: bytes) -> bytes:
    (size,) = _HEADER.unpack_from(text, 0)
    return text[4 + size :]


@dataclass(frozen=True, slots=True)
class Arrays:
    """A packed call's own parts, read without its base's request (the trainer's batch read)."""

    header: dict[str, Any]
    text: bytes
    """The text stream, uncompressed (`Base.text`)."""
    answer: bytes
    tail: NDArray[np.int32]
    response: NDArray[np.int32]
    logprobs: NDArray[Any] | None

    @property
    def base_seq(self) -> int | None:
        base: int | None = self.header["base"]
        return base

    @property
    def keep(self) -> int:
        keep: int = self.header["keep"]
        return keep


def _planes(values: NDArray[Any]) -> list[bytes]:
    """The values' bytes, plane by plane (every first byte, then every second...): the high
    bytes of token IDs and the sign and exponent bytes of logprobs vary little, and zlib finds
    that only when they sit together."""
    width = values.dtype.itemsize
    little = values.astype(values.dtype.newbyteorder("<"), copy=False)
    planes = np.ascontiguousarray(little.view(np.uint8).reshape(-1, width).T)
    return [plane.tobytes() for plane in planes]


def _unplane(raw: bytes, offset: int, count: int, dtype: np.dtype[Any]) -> NDArray[Any]:
    planes = np.frombuffer(raw, dtype=np.uint8, count=count * dtype.itemsize, offset=offset)
    return np.ascontiguousarray(planes.reshape(dtype.itemsize, count).T).view(dtype).reshape(-1)


def _check_format(version: int) -> None:
    if version not in _READABLE:
        raise ValueError(
            f"packed event format {version} is newer than this reins reads ({FORMAT}): "
            "upgrade reins"
        )


def base_of(blob: bytes) -> int | None:
    """The seq of the event a blob is packed against, None for none."""
    version, seq, *_ = _PREFIX.unpack_from(blob, 0)
    _check_format(version)
    return None if seq < 0 else int(seq)


@dataclass(frozen=True, slots=True)
class Numbers:
    """A packed call's token IDs and logprobs, read without its text (the trainer's read needs
    nothing else, and no earlier blob to read them)."""

    version: int
    base_seq: int | None
    keep: int
    tail: NDArray[np.int32]
    response: NDArray[np.int32]
    logprobs: NDArray[Any] | None
    logprob_kind: str
    text_at: int
    """Where the text stream starts in the blob."""


@dataclass(frozen=True, slots=True)
class Prefix:
    """A blob's uncompressed start, and where its token stream lies in it."""

    version: int
    base_seq: int | None
    keep: int
    tail: int
    response: int
    logprob_kind: str
    stream: slice


def read_prefix(blob: bytes) -> Prefix:
    version, seq, keep, tail, resp, kind, size = _PREFIX.unpack_from(blob, 0)
    _check_format(version)
    stream = slice(_PREFIX.size, _PREFIX.size + size)
    base = None if seq < 0 else int(seq)
    return Prefix(version, base, keep, tail, resp, _LOGPROB_KINDS[kind], stream)


def decode_stream(
    stream: bytes | memoryview, tail: int, response: int, logprob_kind: str
) -> tuple[NDArray[np.int32], NDArray[np.int32], NDArray[Any] | None]:
    """A blob's token stream (`Prefix.stream`): its new prompt tokens, response and logprobs.
    The trainer's read runs this on its side (`reins.recordbatch`)."""
    raw = zlib.decompress(stream)
    tokens = _unplane(raw, 0, tail + response, np.dtype("<i4"))
    logprobs = None
    if logprob_kind in ("f4", "f8"):
        dtype = np.dtype("<f4") if logprob_kind == "f4" else np.dtype("<f8")
        logprobs = _unplane(raw, 4 * (tail + response), response, dtype)
    return tokens[:tail], tokens[tail:], logprobs


def decode_stream_into(
    stream: bytes | memoryview,
    tokens: NDArray[np.int32],
    logprobs: NDArray[np.float32] | None,
    logprob_kind: str,
) -> None:
    """`decode_stream` written straight into the caller's arrays (`tokens`: the new prompt
    tokens then the response; `logprobs`: one per response token, or None to drop them): the
    byte planes go to their bytes in place, with no intermediate array per plane (the trainer's
    read decodes tens of thousands of calls a step)."""
    raw = zlib.decompress(stream)
    count = tokens.size
    _unplane_into(raw, 0, count, tokens)
    if logprobs is None or logprob_kind not in ("f4", "f8"):
        return
    if logprob_kind == "f4":
        _unplane_into(raw, 4 * count, logprobs.size, logprobs)
    else:
        logprobs[:] = _unplane(raw, 4 * count, logprobs.size, np.dtype("<f8"))


def _unplane_into(raw: bytes, offset: int, count: int, out: NDArray[Any]) -> None:
    """Byte plane j of `raw` (every value's j-th little-endian byte) into byte j of each of
    `out`'s 4-byte values."""
    if out.size != count or out.dtype.itemsize != 4 or not out.flags.c_contiguous:
        raise ValueError(f"expected {count} contiguous 4-byte values, got {out.size} {out.dtype}")
    planes = np.frombuffer(raw, dtype=np.uint8, count=4 * count, offset=offset).reshape(4, count)
    values = out.view(np.uint8).reshape(count, 4)
    if _BIG_ENDIAN_HOST:
        values = values[:, ::-1]
    values[...] = planes.T


_BIG_ENDIAN_HOST = sys.byteorder == "big"


def read_numbers(blob: bytes) -> Numbers:
    prefix = read_prefix(blob)
    stream = memoryview(blob)[prefix.stream]
    tail, response, logprobs = decode_stream(
        stream, prefix.tail, prefix.response, prefix.logprob_kind
    )
    return Numbers(
        prefix.version,
        prefix.base_seq,
        prefix.keep,
        tail,
        response,
        logprobs,
        prefix.logprob_kind,
        prefix.stream.stop,
    )


def read_arrays(blob: bytes, base_text: bytes | None) -> Arrays:
    """The header and arrays of a blob; `base_text` is its base's `Arrays.text` (None when it
    has no base, see `base_of`)."""
    numbers = read_numbers(blob)
    zdict = b""
    if base_text:
        zdict = _answer_of(base_text) if numbers.version == 1 else base_text
    zdict = zdict[-_ZDICT_BYTES:]
    inflater = zlib.decompressobj(zdict=zdict) if zdict else zlib.decompressobj()
    raw = inflater.decompress(memoryview(blob)[numbers.text_at :]) + inflater.flush()
    (size,) = _HEADER.unpack_from(raw, 0)
    header = orjson.loads(raw[4 : 4 + size])
    header.update(
        base=numbers.base_seq,
        keep=numbers.keep,
        tail=int(numbers.tail.size),
        resp=int(numbers.response.size),
        lp=numbers.logprob_kind,
    )
    answer = raw[4 + size :]
    return Arrays(header, raw, answer, numbers.tail, numbers.response, numbers.logprobs)


def shape_after(delta: dict[str, Any], base: RequestShape | None) -> RequestShape | None:
    """The `RequestShape` of a request restored from `delta` (`pack`'s "req") on `base`'s."""
    if "whole" in delta:
        return request_shape(delta["whole"])
    assert base is not None
    whole: dict[str, Digest] = {}
    elements: dict[str, list[Digest]] = {}
    own = delta["own"]
    for key in delta["order"]:
        if key in delta["same"]:
            whole[key] = base.whole[key]
            if key in base.elements:
                elements[key] = base.elements[key]
            continue
        value = own[key]
        if key in delta["prefix"]:
            parts = base.elements[key][: delta["prefix"][key]] + [_digest(v) for v in value]
        elif isinstance(value, list):
            parts = [_digest(v) for v in value]
        else:
            whole[key] = _digest(value)
            continue
        elements[key] = parts
        whole[key] = hashlib.blake2b(b"".join(parts), digest_size=16).digest()
    return RequestShape(whole, elements)


def base_after(seq: int, arrays: Arrays, base: Base | None) -> Base:
    """What a later call is packed against, from this call's blob and its own base (the store
    rebuilds its candidates this way without restoring any request)."""
    prompt = arrays.tail
    if base is not None:
        prompt = np.concatenate([base.tokens[: arrays.keep], arrays.tail])
    tokens = np.concatenate([prompt, arrays.response])
    shape = shape_after(arrays.header["req"], None if base is None else base.request)
    return Base(seq, tokens, shape, arrays.text)


@dataclass(frozen=True, slots=True)
class Unpacked:
    """A packed call restored: its whole `data`, and what a later call needs of it."""

    data: dict[str, Any]
    base: Base


def unpack(
    seq: int,
    skeleton: dict[str, Any],
    blob: bytes,
    base: Unpacked | None,
    *,
    token_arrays: bool = False,
) -> Unpacked:
    """The event `data` that `pack` was given. `base` is the restored event named by the
    blob's header (`Arrays.base_seq`), or None when it names none. `token_arrays`: its
    `prompt_token_ids` an int32 array rather than a list (a long rollout's prompts as lists of
    ints are the square of its length in Python objects; `reins.samples` takes either)."""
    named = base_of(blob)
    if named != (None if base is None else base.base.seq):
        raise ValueError(f"event {seq} is packed against event {named}: pass that one")
    arrays = read_arrays(blob, base.base.text if base is not None else None)
    header = arrays.header
    prompt = arrays.tail
    if base is not None:
        prompt = np.concatenate([base.base.tokens[: header["keep"]], arrays.tail])
    packed: dict[str, Any] = {"prompt_token_ids": prompt if token_arrays else prompt.tolist()}
    if header["resp_key"]:
        packed["response_token_ids"] = arrays.response.tolist()
    if header["lp"] == "null":
        packed["response_logprobs"] = None
    elif arrays.logprobs is not None:
        packed["response_logprobs"] = arrays.logprobs.astype(np.float64).tolist()
    delta = header["req"]
    if "whole" in delta:
        request = delta["whole"]
    else:
        assert base is not None
        base_request = base.data["request"]
        request = {}
        for key in delta["order"]:
            if key in delta["same"]:
                request[key] = base_request[key]
            elif key in delta["prefix"]:
                request[key] = base_request[key][: delta["prefix"][key]] + delta["own"][key]
            else:
                request[key] = delta["own"][key]
    order: list[str] = header["order"]
    if "request" in order:
        packed["request"] = request
    if "response" in order:
        packed["response"] = orjson.loads(arrays.answer)
    fields = {**skeleton, **header.get("fields", {})}  # format 1 kept them all in the column
    data = {key: packed[key] if key in PACKED_FIELDS else fields[key] for key in order}
    tokens = np.concatenate([prompt, arrays.response])
    shape = shape_after(delta, None if base is None else base.base.request)
    return Unpacked(data, Base(seq, tokens, shape, arrays.text))


def unpack_events(events: Sequence[PackedEvent], *, token_arrays: bool = False) -> list[Event]:
    """Whole events from packed ones (`GET .../events/packed`), in seq order. Every base a
    packed event names must be among `events`: read an attempt from its first call.
    `token_arrays`: as `unpack`'s."""
    restored: dict[int, Unpacked] = {}
    out = []
    for event in sorted(events, key=lambda e: e.seq):
        data = event.data
        if event.packed is not None:
            blob = base64.b64decode(event.packed)
            named = base_of(blob)
            if named is not None and named not in restored:
                raise ValueError(
                    f"event {event.seq} is packed against event {named}, which is not among "
                    "these events: read its attempt from the first call"
                )
            base = None if named is None else restored[named]
            restored[event.seq] = unpack(
                event.seq, event.data, blob, base, token_arrays=token_arrays
            )
            data = restored[event.seq].data
        fields = event.model_dump(exclude={"packed", "data"})
        out.append(Event.model_construct(**fields, data=data))
    return out
