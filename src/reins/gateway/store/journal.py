"""The call journal: a SQLite gateway answers a proxied call once its record is in this file,
and stores the record in the database right after, off the call's path.

A proxied call's durable write (packing the call, the INSERT, the commit: ~0.5-1 ms of CPU)
sat between the engine's answer and the harness, nearly doubling what the proxy adds to a call
(docs/benchmarks.md, "LLM proxy"). One `write` to an append-only file is as durable as SQLite's
own commit in WAL mode with `synchronous=NORMAL`, the gateway's default: both survive the
gateway's crash, neither an OS crash. So the record goes here first, the harness gets its
answer, and the group commit stores it as any other event. A gateway that starts replays the
file into the database before it serves (a replay of a stored record stores nothing: every
event has its idempotency key), and empties it once everything in it is stored.

Records are framed (length, CRC-32, JSON): a record the crash cut short was never answered,
and reading stops there. `SqlStore` decides which calls may take this path (an attempt a
commit saw open, with no close under way) and makes every read and every close wait for the
journaled records before it (docs/gateway.md, "The call journal").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from reins.gateway import jsonrule

_FRAME = struct.Struct("<II")
"""A record's length and the CRC-32 of its bytes."""
CLEAR_FROM_BYTES = 256 * 1024
"""The journal is emptied when everything in it is stored and it holds at least this much: a
record already stored costs only a lookup when replayed."""


@dataclass(frozen=True, slots=True)
class JournaledPost:
    """The events of one proxied call as the journal keeps them: the store's rows."""

    rollout_id: str
    attempt_id: int
    rows: list[dict[str, Any]]
    """Each with `type`, `data` (`jsonrule.Encoded`), `idempotency_key`, `created_at`."""


def encode_post(post: JournaledPost) -> bytes:
    """A framed record; the events' JSON text is written as the store encoded it."""
    payload = orjson.dumps(
        {
            "rollout_id": post.rollout_id,
            "attempt_id": post.attempt_id,
            "rows": [
                {
                    "type": row["type"],
                    "idempotency_key": row["idempotency_key"],
                    "created_at": row["created_at"],
                    "data": orjson.Fragment(row["data"].text),
                }
                for row in post.rows
            ],
        }
    )
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def decode_posts(raw: bytes) -> tuple[list[JournaledPost], int]:
    """The whole records at the start of `raw`, and the bytes they take: reading stops at the
    first record that is cut short, does not match its CRC or is not a record (the write a
    crash interrupted; an OS crash can leave a tail of zeros, whose empty payload matches the
    CRC 0)."""
    posts: list[JournaledPost] = []
    offset = 0
    while offset + _FRAME.size <= len(raw):
        size, crc = _FRAME.unpack_from(raw, offset)
        start = offset + _FRAME.size
        payload = raw[start : start + size]
        if not size or len(payload) < size or zlib.crc32(payload) != crc:
            break
        try:
            posts.append(_post_of(payload))
        except (ValueError, KeyError, TypeError, jsonrule.JsonRuleError):
            break
        offset = start + size
    return posts, offset


def _post_of(payload: bytes) -> JournaledPost:
    record = json.loads(payload)  # the standard reader: integers of any size stay exact
    rows = [
        {
            "rollout_id": record["rollout_id"],
            "attempt_id": record["attempt_id"],
            "type": row["type"],
            "idempotency_key": row["idempotency_key"],
            "created_at": row["created_at"],
            # Encoded again as the store encodes a post: the same text as before.
            "data": jsonrule.encode(row["data"], ("data",)),
        }
        for row in record["rows"]
    ]
    return JournaledPost(record["rollout_id"], record["attempt_id"], rows)


def journal_path(database: str) -> Path:
    """The call journal of the SQLite file at `database`."""
    return Path(database + "-calls")


def held_elsewhere(path: Path) -> bool:
    """Whether another process holds the journal at `path`: a gateway that may answer calls
    from it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock
    return False


class CallJournal:
    """The append-only file beside a SQLite database (`<database>-calls`), held by one gateway
    process: a second process on the same database finds it locked and does without it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self.size = 0

    def open(self) -> bool:
        """Opens and locks the file; False when another process holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        self.size = os.fstat(fd).st_size
        return True

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def read(self) -> list[JournaledPost]:
        """Every whole record in the file (what a gateway that stopped left to store)."""
        assert self._fd is not None
        raw = os.pread(self._fd, self.size, 0)
        posts, _ = decode_posts(raw)
        return posts

    def append(self, post: JournaledPost) -> None:
        """Writes one record; returns once the OS has all of it. On an error (a full disk) the
        file is cut back to where it was, so a later record never follows a broken one."""
        assert self._fd is not None
        record = encode_post(post)
        view = memoryview(record)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.size)
            raise
        self.size += len(record)

    def clear(self) -> None:
        """Empties the file: everything in it is stored."""
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        self.size = 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None
