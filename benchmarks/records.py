"""Records at scale (issue #17): bytes stored per rollout, write throughput, and the trainer's read.

A real ``reins gateway`` on a SQLite file (or PostgreSQL: ``--backends``) runs on 127.0.0.1.
Synthetic agent rollouts of 10, 50 and 200 turns, whose context grows to 8k, 32k and 128k tokens,
are posted to it as the proxy records them: one ``model_request`` event per call
(``src/reins/gateway/capture.py``): the prompt's token IDs, the response's token IDs and logprobs,
the ``request`` as the harness sent it (every message of the conversation so far) and the
``response`` as the harness received it. Each turn's prompt is the previous prompt + the previous
response + a new observation (one sequence, as a coding agent's is), and each turn's request holds
the previous messages plus the assistant's answer and the new tool output. Message text is 4 ASCII
characters per token. A ``reward`` event closes each rollout.

Figures, each as a ratio against the aim of issue #17 where there is one:

- **storage overhead**: bytes stored per rollout / bytes of its final sequence. "Bytes stored" is
  the growth of the SQLite database file (after ``PRAGMA wal_checkpoint(TRUNCATE)``, so the WAL
  is empty) divided by the rollouts written: enough rollouts of each shape for ~1.5 MB, since the
  file grows by whole pages (64 KB), on a database that already holds a rollout (its tables
  past their first page, as any database in use). "Bytes of its final sequence" is the last
  call's prompt + response token IDs as 4-byte ints. Aim: <= 1.5 at every length.
- **write throughput**: bytes of event bodies posted per second, events/s and new tokens/s (final
  sequence tokens per second), each rollout posted by one client in order, one call at a time as
  a harness does. No aim: printed for the before/after.
- **read**: the time the trainer takes to turn one step's rollouts into a ``Batch``: one
  binary read of the step (``GatewayClient.get_records``, ``POST /api/records``), ``record_of``
  per rollout, then ``build_batch`` (``src/reins/trainer/loop.py``, ``_records`` / ``_update``),
  as final-sequence tokens per second. Aim: >= 10 M tokens/s on loopback, for 512 rollouts x
  32k tokens. The baseline in the same run is the JSON read the trainer did before:
  ``GatewayClient.get_events`` per rollout, then ``rollout_from_events``.

The default run keeps to about a minute on 2 cores: ~1 MB of final sequences of each shape
above, and a read step of 16 rollouts of 50 turns x 32k. ``--long`` writes 5 MB of each shape
and reads the issue's step, 512 rollouts x 32k (5 GB of JSON posted, ~100 MB stored; 7-8
minutes on 2 cores). The machine may be shared: each figure is also printed as a
ratio to its aim.

``--backends sqlite,postgres`` runs the storage cells on a local PostgreSQL server too (Debian's
``postgresql``, as the tests start it; "bytes stored" there is the growth of the tables with their
TOAST tables, indexes and maps, ``pg_total_relation_size``); the read step runs on SQLite. Each
shape's line also times the dashboard's rollout page against the JSON read of its events, and
the longest ``/healthz`` answer while they ran (asked every 5 ms): what a long read costs the
requests it shares the gateway's event loop with.

Run: ``python benchmarks/records.py [--long] [--backends sqlite,postgres]``. Last line:
``records_storage_overhead_200_turns: VALUE ratio`` (SQLite's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import numpy as np
from pydantic import TypeAdapter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reins.client import GatewayClient  # noqa: E402
from reins.gateway.proxy import call_key  # noqa: E402
from reins.recordbatch import record_of  # noqa: E402
from reins.samples import AdapterConfig, RolloutRecord, build_batch  # noqa: E402
from reins.samples.records import rollout_from_events  # noqa: E402
from reins.schemas import Event  # noqa: E402
from reins.trainer.loop import fitted_id  # noqa: E402
from tests.support import PostgresServer, descendants, running_gateway  # noqa: E402

API_KEY = "bench-admin-key"
CHARS_PER_TOKEN = 4
VOCAB = 151_000
OVERHEAD_AIM = 1.5
STORAGE_SAMPLE_BYTES = 1.0e6
"""Bytes of final sequences written per shape for the storage figure (``--long``: 5x). The file
grows by whole 64 KB pages: at 1 MB (~1.5 MB stored) a ratio is within about +-0.03."""
READ_AIM_TOKENS_S = 10e6
_EVENTS = TypeAdapter(list[Event])
RUN_NAME = "recall-20261207-120000"
"""A run's name as `reins demo` makes one (the example's and the start time). The ids of its
rollouts hold it, and an id is stored in each of its events' rows and again in the key index,
as the proxy's key for the call is: both as long as in a real run, or the figure flatters."""
GROUP_SIZE = 8


def trainer_ids(position: int) -> tuple[str, str]:
    """(rollout id, group id) of the `position`-th rollout, as the trainer declares them
    (`reins.trainer.loop`), for a task of the recall example's kind of id."""
    task, k = divmod(position, GROUP_SIZE)
    group = fitted_id(f"{RUN_NAME}.t{task:07d}.", f"task-{task:05d}")
    return f"{group}.{k}", group


# -- synthetic rollouts -----------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    turns: int
    context: int
    """Tokens of the final sequence (last prompt + last response), at most."""

    @property
    def first_prompt(self) -> int:
        return min(self.context // 8, 4_000)

    @property
    def response(self) -> int:
        return max(1, (self.context - self.first_prompt) // (4 * self.turns))

    @property
    def observation(self) -> int:
        if self.turns == 1:
            return 0
        return (self.context - self.first_prompt - self.turns * self.response) // (self.turns - 1)

    @property
    def final_tokens(self) -> int:
        return self.first_prompt + self.turns * self.response + (self.turns - 1) * self.observation

    def label(self) -> str:
        return f"{self.turns} turns to {self.context // 1024}k"


@dataclass
class Rollout:
    rollout_id: str
    group_id: str
    bodies: list[bytes]
    """Event posts in order: one ``model_request`` per turn, then the reward."""
    final_tokens: int
    parts: dict[str, int]
    """JSON bytes of each part of the events (prompt ids, request, ...), summed over turns."""


class Text:
    """Random lowercase words, 4 characters per token, sliced from one shared pool (fast)."""

    def __init__(self, rng: np.random.Generator, chars: int) -> None:
        raw = rng.integers(97, 123, chars, dtype=np.uint8)
        raw[rng.random(chars) < 0.2] = 32
        self.pool = raw.tobytes().decode("ascii")

    def slice(self, rng: np.random.Generator, tokens: int) -> str:
        n = tokens * CHARS_PER_TOKEN
        start = int(rng.integers(0, len(self.pool) - n))
        return self.pool[start : start + n]


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def make_rollout(shape: Shape, rollout_id: str, group_id: str, seed: int, pool: Text) -> Rollout:
    """One rollout's event bodies, built before anything is timed."""
    rng = np.random.default_rng(seed)

    def text(tokens: int) -> str:
        return pool.slice(rng, tokens)

    prompt = rng.integers(0, VOCAB, shape.first_prompt, dtype=np.int32)
    system = shape.first_prompt // 2
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": text(system)},
        {"role": "user", "content": text(shape.first_prompt - system)},
    ]
    bodies: list[bytes] = []
    parts = dict.fromkeys(("prompt_token_ids", "response_token_ids", "logprobs", "request"), 0)
    parts["response"] = parts["other"] = 0
    for turn in range(shape.turns):
        response = rng.integers(0, VOCAB, shape.response, dtype=np.int32)
        logprobs = (-rng.exponential(0.3, shape.response)).astype(np.float32)
        answer = text(shape.response)
        request = {
            "model": "policy",
            "messages": messages,
            "temperature": 1.0,
            "max_tokens": 4096,
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": {}}}],
        }
        shown = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": 1_764_000_000 + turn,
            "model": "policy",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": int(prompt.size),
                "completion_tokens": int(response.size),
                "total_tokens": int(prompt.size + response.size),
            },
        }
        pieces = {
            "prompt_token_ids": _dumps(prompt.tolist()),
            "response_token_ids": _dumps(response.tolist()),
            "logprobs": _dumps([float(x) for x in logprobs]),
            "request": _dumps(request),
            "response": _dumps(shown),
        }
        data = (
            f'{{"prompt_token_ids":{pieces["prompt_token_ids"]},'
            f'"response_token_ids":{pieces["response_token_ids"]},'
            f'"response_logprobs":{pieces["logprobs"]},'
            f'"request":{pieces["request"]},"response":{pieces["response"]},'
            '"model":"policy","endpoint":"http://127.0.0.1:8001/v1","model_version":3,'
            '"latency_s":1.234,"status":200,"finish_reason":"stop","error":null,'
            '"kind":"chat","mode":"train","stream":false,"choice_index":0}'
        )
        key = call_key()  # the proxy's, as long as it makes them
        body = f'{{"type":"model_request","data":{data},"idempotency_key":"{key}"}}'
        bodies.append(body.encode())
        for name, piece in pieces.items():
            parts[name] += len(piece)
        parts["other"] += len(body) - sum(len(p) for p in pieces.values())
        if turn + 1 < shape.turns:
            observation = rng.integers(0, VOCAB, shape.observation, dtype=np.int32)
            prompt = np.concatenate([prompt, response, observation])
            messages = [
                *messages,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": text(shape.observation)},
            ]
    final = int(prompt.size + response.size)
    reward = {"type": "reward", "data": {"value": float(rng.random() < 0.5)}}
    bodies.append(_dumps({**reward, "idempotency_key": "reward"}).encode())
    return Rollout(rollout_id, group_id, bodies, final, parts)


# -- writing ----------------------------------------------------------------------------------


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 300:
        raise RuntimeError(f"{response.request.url}: {response.status_code} {response.text[:500]}")
    return response.json()


def open_attempts(url: str, rollouts: list[Rollout]) -> list[tuple[Rollout, str, int]]:
    specs = [{"rollout_id": r.rollout_id, "group_id": r.group_id, "input": {}} for r in rollouts]
    with httpx.Client(base_url=url, headers=_admin(), timeout=60) as http:
        _check(http.post("/api/rollouts", json=specs))
        out = []
        for rollout in rollouts:
            attempt = _check(http.post(f"/api/rollouts/{rollout.rollout_id}/attempts"))
            out.append((rollout, attempt["token"], int(attempt["attempt_id"])))
    return out


def post_rollout(url: str, rollout: Rollout, token: str, attempt_id: int) -> None:
    """One harness: its calls' events in order, each after the previous one was acknowledged.
    Posted with the admin key: `model_request` events are the proxy's to write, and an
    attempt's scoped token may not post them (403); the proxy's own write checks the attempt
    as a scoped post would, which the admin key's skips."""
    del token
    path = f"/api/rollouts/{rollout.rollout_id}/attempt/{attempt_id}/events"
    headers = {**_admin(), "content-type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
        for body in rollout.bodies:
            _check(http.post(path, content=body))


def write(url: str, rollouts: list[Rollout], clients: int) -> float:
    """Post the rollouts, ``clients`` at a time; the seconds it took."""
    opened = open_attempts(url, rollouts)
    started = time.perf_counter()
    with futures.ThreadPoolExecutor(clients) as pool:
        for done in [pool.submit(post_rollout, url, *item) for item in opened]:
            done.result()
    return time.perf_counter() - started


def db_bytes(path: Path, timeout_s: float = 30.0) -> int:
    """The database file's size once its WAL is checkpointed into it and truncated."""
    deadline = time.monotonic() + timeout_s
    with sqlite3.connect(path, timeout=timeout_s) as conn:
        while True:
            busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not checkpoint {path} within {timeout_s} s")
            time.sleep(0.05)
    wal = path.with_name(path.name + "-wal")
    if wal.exists() and wal.stat().st_size:
        raise RuntimeError(f"{wal} still holds {wal.stat().st_size} bytes after the checkpoint")
    return path.stat().st_size


def pg_bytes(url: str) -> int:
    """The bytes of the PostgreSQL database's tables: each with its TOAST table (where the packed
    calls go), its indexes and its free-space and visibility maps."""

    async def query() -> int:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            size = await conn.fetchval(
                "SELECT sum(pg_total_relation_size(oid)) FROM pg_class "
                "WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace"
            )
        finally:
            await conn.close()
        return int(size)

    return asyncio.run(query())


@contextlib.contextmanager
def database(backend: str, workdir: Path) -> Iterator[tuple[str, Callable[[], int]]]:
    """(database URL, its size in bytes now) for a gateway on `backend`."""
    if backend == "sqlite":
        path = workdir / "gateway.db"
        yield str(path), lambda: db_bytes(path)
        return
    if backend != "postgres":
        raise SystemExit(f"unknown backend {backend!r} (sqlite, postgres)")
    server = PostgresServer.start()
    try:
        url = server.create_database("records")
        yield url, lambda: pg_bytes(url)
    finally:
        server.stop()


# -- reading, as the trainer does -------------------------------------------------------------


async def read_step_binary(url: str, rollouts: list[Rollout]) -> dict[str, float]:
    """``Trainer._records`` + ``build_batch``: one binary read, records, the batch."""
    timings: dict[str, float] = {}
    started = time.perf_counter()
    async with GatewayClient(url, API_KEY, timeout_s=300) as client:
        read = await client.get_records([r.rollout_id for r in rollouts])
    t1 = time.perf_counter()
    records = [record_of(d, group_id=r.group_id) for d, r in zip(read, rollouts, strict=True)]
    t2 = time.perf_counter()
    batch = build_batch(records, AdapterConfig())
    timings["build_s"] = time.perf_counter() - t2
    timings["total_s"] = time.perf_counter() - started
    timings["fetch_s"], timings["convert_s"] = t1 - started, t2 - t1
    _check_batch(batch, rollouts, timings)
    return timings


def _check_batch(batch: Any, rollouts: list[Rollout], timings: dict[str, float]) -> None:
    if len(batch.sequences) != len(rollouts):  # every call continues the last: one sequence each
        raise RuntimeError(f"{len(batch.sequences)} sequences for {len(rollouts)} rollouts")
    tokens = sum(int(s.token_ids.size) for s in batch.sequences)
    if tokens != sum(r.final_tokens for r in rollouts):
        raise RuntimeError(f"the batch holds {tokens} tokens, the rollouts' final sequences more")
    timings["tokens"] = tokens


async def read_step(url: str, rollouts: list[Rollout]) -> dict[str, float]:
    """The JSON read (the trainer's before the binary one): events per rollout in turn,
    ``rollout_from_events``, the batch."""
    timings: dict[str, float] = {}
    started = time.perf_counter()
    records: list[RolloutRecord] = []
    fetch_s = convert_s = 0.0
    async with GatewayClient(url, API_KEY, timeout_s=300) as client:
        for rollout in rollouts:
            t0 = time.perf_counter()
            events = await client.get_events(rollout.rollout_id)
            t1 = time.perf_counter()
            records.append(
                rollout_from_events(
                    events, rollout_id=rollout.rollout_id, group_id=rollout.group_id
                )
            )
            fetch_s += t1 - t0
            convert_s += time.perf_counter() - t1
    t0 = time.perf_counter()
    batch = build_batch(records, AdapterConfig())
    timings["build_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - started
    timings["fetch_s"], timings["convert_s"] = fetch_s, convert_s
    _check_batch(batch, rollouts, timings)
    return timings


def _admin() -> dict[str, str]:
    return {"authorization": f"Bearer {API_KEY}"}


# -- the run ----------------------------------------------------------------------------------


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class Cpu:
    """CPU seconds of the gateway process and of this one (the clients) over a window."""

    def __init__(self, gateway_pid: int) -> None:
        self.pid = gateway_pid
        self.gateway_s = self.client_s = 0.0

    def _gateway(self) -> float:
        """Of the gateway and its own processes (the SQLite event writer and its fork server)."""
        return sum(map(_cpu_s, _tree(self.pid)))

    def __enter__(self) -> Cpu:
        self._g, self._c = self._gateway(), time.process_time()
        return self

    def __exit__(self, *_: object) -> None:
        self.gateway_s += self._gateway() - self._g
        self.client_s += time.process_time() - self._c


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0  # ended
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def _tree(pid: int) -> list[int]:
    return [pid, *descendants(pid)]


def storage_cells(
    url: str,
    db_size: Callable[[], int],
    pid: int,
    shapes: list[Shape],
    pool: Text,
    sample_bytes: float,
) -> dict[int, float]:
    """Rollouts of each shape, posted call by call; the overhead ratio by turns."""
    settle = make_rollout(Shape(50, 32 * 1024), *trainer_ids(999_999), 999, pool)
    write(url, [settle], 1)  # not counted: the tables grow past their first page
    print(
        f"\nstorage per rollout (~{sample_bytes / 1e6:.1f} MB of final sequences per "
        "shape, each rollout posted call by call by one client)"
    )
    print(
        f"{'shape':<20}{'final seq':>12}{'stored':>12}{'overhead':>10}{'vs aim':>8}"
        f"{'posted':>12}{'write MB/s':>11}{'events/s':>10}{'ktok/s':>8}{'gw CPU s':>10}"
        f"{'healthz max':>12}"
    )
    overhead: dict[int, float] = {}
    for i, shape in enumerate(shapes):
        count = max(1, round(sample_bytes / (4 * shape.final_tokens)))
        written = [
            make_rollout(shape, *trainer_ids(100_000 * (i + 1) + n), 1000 + 100 * i + n, pool)
            for n in range(count)
        ]
        before = db_size()
        with Cpu(pid) as cpu, _HealthzWatch(url) as watch:
            seconds = write(url, written, 1)
        stored = (db_size() - before) / count
        rollout = written[0]
        final_bytes = 4 * rollout.final_tokens
        overhead[shape.turns] = ratio = stored / final_bytes
        posted = sum(len(b) for r in written for b in r.bodies)
        events = sum(len(r.bodies) for r in written)
        print(
            f"{shape.label() + f' x{count}':<20}{_mb(final_bytes):>12}{_mb(stored):>12}"
            f"{ratio:>9.2f}x{ratio / OVERHEAD_AIM:>7.2f}x{_mb(posted / count):>12}"
            f"{posted / seconds / 1e6:>11.1f}{events / seconds:>10.1f}"
            f"{count * rollout.final_tokens / seconds / 1e3:>8.1f}"
            f"{cpu.gateway_s:>7.1f}/{seconds:.1f}{watch.longest_s * 1e3:>9.0f} ms",
            flush=True,
        )
        one = sum(len(b) for b in rollout.bodies)
        share = ", ".join(f"{name} {100 * n / one:.0f}%" for name, n in rollout.parts.items())
        print(f"{'':<20}posted JSON by part: {share}")
        print(f"{'':<20}{rollout_page(url, rollout.rollout_id)}", flush=True)
    return overhead


def rollout_page(url: str, rollout_id: str, repeats: int = 3) -> str:
    """The dashboard's page of one rollout (`/ui/rollouts/{id}`) against the JSON read of the
    same rollout's events (`GET .../events`), best of `repeats` each; and the longest wait of
    a `/healthz` asked every 5 ms meanwhile (what every other request waits for the loop)."""
    best = {"page": math.inf, "events": math.inf}
    size = 0
    with (
        _HealthzWatch(url) as watch,
        httpx.Client(base_url=url, headers=_admin(), timeout=300) as http,
    ):
        for _ in range(repeats):
            t0 = time.perf_counter()
            page = _check_ok(http.get(f"/ui/rollouts/{rollout_id}"))
            t1 = time.perf_counter()
            _check_ok(http.get(f"/api/rollouts/{rollout_id}/events", params={"limit": 10_000}))
            t2 = time.perf_counter()
            best = {"page": min(best["page"], t1 - t0), "events": min(best["events"], t2 - t1)}
            size = len(page.content)
    return (
        f"rollout page ({_mb(size)} of HTML): {best['page'] * 1e3:.0f} ms, "
        f"{best['page'] / best['events']:.2f}x the JSON read of its events "
        f"({best['events'] * 1e3:.0f} ms), best of {repeats}; /healthz meanwhile: longest "
        f"{watch.longest_s * 1e3:.0f} ms ({watch.count} asked)"
    )


class _HealthzWatch:
    """Asks `/healthz` every 5 ms from a thread until the block ends; the longest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.longest_s = 0.0
        self.count = 0
        self.failure: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=60) as http:
                while not self._stop.wait(0.005):
                    started = time.perf_counter()
                    _check_ok(http.get("/healthz"))
                    self.longest_s = max(self.longest_s, time.perf_counter() - started)
                    self.count += 1
        except Exception as error:  # a figure from a watch that stopped would mislead
            self.failure = error

    def __enter__(self) -> _HealthzWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.failure is not None:
            raise RuntimeError(f"/healthz failed during the watch: {self.failure!r}")


def _check_ok(response: httpx.Response) -> httpx.Response:
    """`response` when it is a 200 (`_check` for an answer that is not JSON)."""
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.url}: {response.status_code} {response.text[:500]}")
    return response


def read_set(
    url: str,
    db: Path,
    pid: int,
    shape: Shape,
    count: int,
    clients: int,
    pool: Text,
    skip_json: bool = False,
) -> float:
    """Write ``count`` rollouts (built 32 at a time, untimed), read them as the trainer does;
    the read's tokens/s."""
    print(
        f"\nread step: {count} rollouts of {shape.label()}, in groups of 8, written first by "
        f"{clients} clients at once",
        flush=True,
    )
    written: list[Rollout] = []
    posted = events = 0
    seconds = 0.0
    before = db_bytes(db)
    cpu = Cpu(pid)
    for start in range(0, count, 32):
        chunk = [
            make_rollout(shape, *trainer_ids(i), i, pool)
            for i in range(start, min(count, start + 32))
        ]
        with cpu:
            seconds += write(url, chunk, clients)
        posted += sum(len(b) for r in chunk for b in r.bodies)
        events += sum(len(r.bodies) for r in chunk)
        for r in chunk:  # keep memory down: the bodies are not read again
            r.bodies.clear()
        written += chunk
    stored = db_bytes(db) - before
    final_tokens = sum(r.final_tokens for r in written)
    print(
        f"write: {_mb(posted)} posted in {seconds:.1f} s: {posted / seconds / 1e6:.1f} MB/s, "
        f"{events / seconds:.1f} events/s, {final_tokens / seconds / 1e3:.1f} k final-sequence "
        f"tokens/s; CPU s: gateway {cpu.gateway_s:.1f}, client {cpu.client_s:.1f}; stored "
        f"{_mb(stored)} ({stored / (4 * final_tokens):.1f}x the final sequences)",
        flush=True,
    )
    with Cpu(pid) as cpu, _HealthzWatch(url) as watch:
        timings = asyncio.run(read_step_binary(url, written))
    rate = timings["tokens"] / timings["total_s"]
    print(
        f"read (binary, the trainer's): {timings['tokens'] / 1e6:.2f} M tokens into a Batch in "
        f"{timings['total_s']:.2f} s: {rate / 1e6:.3f} M tokens/s, "
        f"{rate / READ_AIM_TOKENS_S:.3f}x the aim of 10 M tokens/s"
    )
    print(
        f"read (binary): get_records {timings['fetch_s']:.2f} s, record_of "
        f"{timings['convert_s']:.2f} s, build_batch {timings['build_s']:.2f} s; CPU s: "
        f"gateway {cpu.gateway_s:.1f}, trainer {cpu.client_s:.1f}; /healthz meanwhile: longest "
        f"{watch.longest_s * 1e3:.0f} ms"
    )
    json_rate = 0.0
    if not skip_json:
        with Cpu(pid) as cpu:
            baseline = asyncio.run(read_step(url, written))
        json_rate = baseline["tokens"] / baseline["total_s"]
        print(
            f"read (JSON events, the baseline): {baseline['total_s']:.2f} s, "
            f"{json_rate / 1e6:.3f} M tokens/s: the binary read is {rate / json_rate:.1f}x "
            f"faster; get_events {baseline['fetch_s']:.2f} s, rollout_from_events "
            f"{baseline['convert_s']:.2f} s, build_batch {baseline['build_s']:.2f} s; CPU s: "
            f"gateway {cpu.gateway_s:.1f}, trainer {cpu.client_s:.1f}"
        )
        print(read_breakdown(url, written[0]))
    return rate


def read_breakdown(url: str, rollout: Rollout, repeats: int = 3) -> str:
    """Where one rollout's read goes: the gateway's answer (raw bytes), ``json.loads``, the
    ``Event`` validation the client does, then ``ModelRequest`` + arrays in
    ``rollout_from_events`` (best of ``repeats``)."""
    path = f"/api/rollouts/{rollout.rollout_id}/events"
    best: dict[str, float] = {}
    with httpx.Client(base_url=url, headers=_admin(), timeout=120) as http:
        for _ in range(repeats):
            t0 = time.perf_counter()
            raw = http.get(path, params={"after": 0, "limit": 10_000}).content
            t1 = time.perf_counter()
            decoded = json.loads(raw)
            t2 = time.perf_counter()
            events = _EVENTS.validate_python(decoded)
            t3 = time.perf_counter()
            rollout_from_events(events, rollout_id=rollout.rollout_id)
            t4 = time.perf_counter()
            for name, took in (
                ("gateway", t1 - t0),
                ("json", t2 - t1),
                ("events", t3 - t2),
                ("records", t4 - t3),
            ):
                best[name] = min(best.get(name, took), took)
    return (
        f"read of one rollout ({_mb(len(raw))} of JSON), best of {repeats}: gateway answer "
        f"{best['gateway'] * 1e3:.0f} ms, json.loads {best['json'] * 1e3:.0f} ms, Event "
        f"validation {best['events'] * 1e3:.0f} ms, rollout_from_events "
        f"{best['records'] * 1e3:.0f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--long",
        action="store_true",
        help="5 MB per storage shape; the issue's read step: 512 x 32k",
    )
    ap.add_argument("--read-rollouts", type=int, default=None, help="rollouts in the read step")
    ap.add_argument("--clients", type=int, default=4, help="concurrent writers for the read set")
    ap.add_argument(
        "--skip-json-read", action="store_true", help="skip the JSON read baseline (slow at 512)"
    )
    ap.add_argument(
        "--backends",
        default="sqlite",
        help="sqlite,postgres: the storage cells on each (the read step on SQLite only); "
        "postgres starts a local server (Debian's postgresql)",
    )
    args = ap.parse_args()
    shapes = [Shape(10, 8 * 1024), Shape(50, 32 * 1024), Shape(200, 128 * 1024)]
    read_rollouts = args.read_rollouts or (512 if args.long else 16)
    pool = Text(np.random.default_rng(0), 4_000_000)
    print(
        f"records benchmark: python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"gateway on 127.0.0.1 ({args.backends}), {CHARS_PER_TOKEN} chars of message text per "
        "token",
        flush=True,
    )
    backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    overheads: dict[str, dict[int, float]] = {}
    rate = 0.0
    for backend in backends:
        print(f"\n== {backend}", flush=True)
        with (
            tempfile.TemporaryDirectory(prefix="reins-records-") as tmp,
            database(backend, Path(tmp)) as (url, db_size),
            running_gateway(url, API_KEY) as gateway,
        ):
            assert gateway.process is not None
            pid = gateway.process.pid
            sample = STORAGE_SAMPLE_BYTES * (5 if args.long else 1)
            overheads[backend] = storage_cells(gateway.url, db_size, pid, shapes, pool, sample)
            if backend == "sqlite":
                rate = read_set(
                    gateway.url,
                    Path(url),
                    pid,
                    Shape(50, 32 * 1024),
                    read_rollouts,
                    args.clients,
                    pool,
                    args.skip_json_read,
                )
    print("\nthe machine may be shared: the ratios to the aims are the figures to compare")
    for backend, overhead in overheads.items():
        on = "" if backend == "sqlite" else f"_{backend}"
        for turns, ratio in overhead.items():
            print(
                f"records_storage_overhead{on}_{turns}_turns_vs_aim: {ratio / OVERHEAD_AIM:.2f} x"
            )
    if "sqlite" in overheads:
        aim = rate / READ_AIM_TOKENS_S
        print(f"records_read_{read_rollouts}x32k_tokens_per_s_vs_aim: {aim:.3f} x")
    headline = overheads.get("sqlite") or next(iter(overheads.values()))
    on = "" if "sqlite" in overheads else f"_{backends[0]}"
    print(f"records_storage_overhead{on}_200_turns: {headline[200]:.2f} ratio")


if __name__ == "__main__":
    main()
