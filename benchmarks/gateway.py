"""Gateway throughput against a real `reins gateway` process, on SQLite and on PostgreSQL.

For each backend and each client count (1 and 16 concurrent clients) it measures, for a fixed
duration:

- `healthz`: `GET /healthz` round trips, the HTTP floor of this server and client on this machine;
- `create`: `POST /api/rollouts` with a one-element list (a client-chosen rollout id);
- `append`: durable event appends, `POST /api/rollouts/{id}/attempt/{aid}/events` with one
  ~2 KB `model_request` event and a unique idempotency key, under the admin key (a scoped
  token may not post `model_request`: the proxy writes those; the append costs the same).
  The gateway answers only after the transaction holding the event committed.

Every simulated client holds one keep-alive connection and waits for each answer before its next
request. By default all of them run in one asyncio (uvloop) process on a minimal HTTP/1.1 client
that sends pre-built requests: on 2 cores, httpx costs the client several times the server's CPU
per request, CPU taken from the gateway under test (`--client httpx` to compare,
`--client-procs N` to spread the clients over N processes). Each row also shows the CPU used by
the gateway, the PostgreSQL processes, the client and the rest of the machine, so a saturated
client or a noisy neighbour is visible. After the run every event and created rollout is read
back and the number stored is checked against the number of 2xx answers.

    .venv/bin/python benchmarks/gateway.py            # 0.3 s warm-up + 3 s per cell, under a minute
    .venv/bin/python benchmarks/gateway.py --long     # 20 s per cell

The last line is the headline: `gateway_event_appends_sqlite_16: VALUE appends/s`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import PostgresServer, running_gateway  # noqa: E402

API_KEY = "bench-admin-key"
OPS = ("healthz", "create", "append")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- request bodies ---------------------------------------------------------------------------


def event_data(rng: random.Random) -> dict[str, Any]:
    """A realistic `model_request` event: one LLM call of a multi-turn agent."""
    prompt = [rng.randrange(151_000) for _ in range(200)]
    response = [rng.randrange(151_000) for _ in range(50)]
    return {
        "prompt_token_ids": prompt,
        "response_token_ids": response,
        "response_logprobs": [round(-rng.expovariate(4.0), 4) for _ in response],
        "model": "qwen2.5-1.5b-instruct",
        "endpoint": "http://127.0.0.1:8001/v1",
        "model_version": 12,
        "latency_s": 0.412,
        "status": 200,
        "finish_reason": "stop",
        "request": {"temperature": 1.0, "max_tokens": 512, "n_messages": 5},
    }


KEY_MARK = "@@KEY@@"


def _template(body: Any) -> tuple[bytes, bytes]:
    """JSON bytes split around the idempotency key / rollout id, so a client only splices."""
    prefix, suffix = json.dumps(body, separators=(",", ":")).split(KEY_MARK)
    return prefix.encode(), suffix.encode()


def append_template(data: dict[str, Any]) -> tuple[bytes, bytes]:
    return _template({"type": "model_request", "data": data, "idempotency_key": KEY_MARK})


def create_template() -> tuple[bytes, bytes]:
    return _template(
        [
            {
                "rollout_id": KEY_MARK,
                "input": {"task": "Fix the failing test in src/parser.py", "repo": "demo/parser"},
                "group_id": "bench-group",
                "metadata": {"dataset": "bench", "step": 0},
            }
        ]
    )


# -- one cell: N clients hammering one endpoint for a fixed time -----------------------------


@dataclass
class ClientSpec:
    key_prefix: str
    token: str = API_KEY
    rollout_id: str = ""
    attempt_id: int = 0


@dataclass
class CellSpec:
    url: str
    op: str
    clients: list[ClientSpec]
    start_at: float  # time.time() at which every client starts
    warmup_s: float
    duration_s: float
    template: tuple[bytes, bytes] = (b"", b"")
    client: str = "raw"


@dataclass
class CellResult:
    latencies_ms: list[float] = field(default_factory=list)  # answers inside the window
    ok_by_client: dict[str, int] = field(default_factory=dict)  # every 2xx, window or not
    errors: Counter[str] = field(default_factory=Counter)


class _RawConnection(asyncio.Protocol):
    """A minimal HTTP/1.1 keep-alive client: one request at a time, Content-Length answers.

    httpx spends several times the server's CPU per request; on a 2-core machine that CPU is
    taken from the gateway under test, so the default client writes pre-built requests and reads
    only the status line and Content-Length.
    """

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = bytes(self.buffer[:end]).split(b"\r\n")
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            waiter.set_exception(RuntimeError(f"no Content-Length in {lines!r}"))
            return
        total = end + 4 + length
        if len(self.buffer) >= total:
            body = bytes(self.buffer[end + 4 : total])
            del self.buffer[:total]
            waiter.set_result((int(lines[0].split(b" ", 2)[1]), body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc!r}"))

    async def request(self, data: bytes) -> tuple[int, bytes]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.waiter


class _RawClient:
    def __init__(self, url: str, token: str) -> None:
        parsed = httpx.URL(url)
        self.host, self.port = parsed.host, parsed.port or 80
        self.headers = (
            f"Host: {self.host}:{self.port}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\n"
        )
        self.connection: _RawConnection | None = None
        self.transport: asyncio.BaseTransport | None = None

    async def __aenter__(self) -> _RawClient:
        loop = asyncio.get_running_loop()
        self.transport, self.connection = await loop.create_connection(
            _RawConnection, self.host, self.port
        )
        return self

    async def __aexit__(self, *_: object) -> None:
        if self.transport is not None:
            self.transport.close()

    async def get(self, path: str) -> tuple[int, bytes]:
        assert self.connection is not None
        return await self.connection.request(f"GET {path} HTTP/1.1\r\n{self.headers}\r\n".encode())

    async def post(self, path: str, content: bytes) -> tuple[int, bytes]:
        assert self.connection is not None
        head = f"POST {path} HTTP/1.1\r\n{self.headers}Content-Length: {len(content)}\r\n\r\n"
        return await self.connection.request(head.encode() + content)


class _HttpxClient:
    """The same two calls on one `httpx.AsyncClient` with one keep-alive connection."""

    def __init__(self, url: str, token: str) -> None:
        self.http = httpx.AsyncClient(
            base_url=url,
            headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
            timeout=60,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        )

    async def __aenter__(self) -> _HttpxClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.http.aclose()

    async def get(self, path: str) -> tuple[int, bytes]:
        response = await self.http.get(path)
        return response.status_code, response.content

    async def post(self, path: str, content: bytes) -> tuple[int, bytes]:
        response = await self.http.post(path, content=content)
        return response.status_code, response.content


async def _run_client(spec: CellSpec, client: ClientSpec, result: CellResult) -> None:
    window_start = spec.start_at + spec.warmup_s
    window_end = window_start + spec.duration_s
    prefix, suffix = spec.template
    path = {
        "healthz": "/healthz",
        "create": "/api/rollouts",
        "append": f"/api/rollouts/{client.rollout_id}/attempt/{client.attempt_id}/events",
    }[spec.op]
    ok = 0
    latencies = result.latencies_ms
    make = _RawClient if spec.client == "raw" else _HttpxClient
    async with make(spec.url, client.token) as http:
        await http.get("/healthz")  # open the keep-alive connection before the clock starts
        await asyncio.sleep(max(0.0, spec.start_at - time.time()))
        n = 0
        while time.time() < window_end:
            t0 = time.perf_counter()
            try:
                if spec.op == "healthz":
                    status, _ = await http.get(path)
                else:
                    n += 1
                    key = f"{client.key_prefix}-{n}".encode()
                    status, _ = await http.post(path, content=prefix + key + suffix)
            except (httpx.HTTPError, OSError) as error:
                result.errors[type(error).__name__] += 1
                if spec.client == "raw":
                    raise  # the connection is gone; the cell is invalid
                continue
            elapsed_ms = (time.perf_counter() - t0) * 1000
            if 200 <= status < 300:
                ok += 1
                if window_start <= time.time() <= window_end:  # answered inside the window
                    latencies.append(elapsed_ms)
            else:
                result.errors[f"HTTP {status}"] += 1
    result.ok_by_client[client.key_prefix] = ok


async def _run_clients(spec: CellSpec, clients: list[ClientSpec]) -> CellResult:
    result = CellResult()
    await asyncio.gather(*(_run_client(spec, client, result) for client in clients))
    return result


def _drive(spec: CellSpec, clients: list[ClientSpec]) -> CellResult:
    try:
        import uvloop

        return uvloop.run(_run_clients(spec, clients))
    except ImportError:
        return asyncio.run(_run_clients(spec, clients))


def _drive_into(spec: CellSpec, clients: list[ClientSpec], conn: Any) -> None:
    conn.send(_drive(spec, clients))
    conn.close()


# -- CPU accounting from /proc ----------------------------------------------------------------


def _proc_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid:
                    out.append(int(entry.name))
    return out


def _descendants(pid: int) -> list[int]:
    children = _children(pid)
    return [p for child in children for p in (child, *_descendants(child))]


def _machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / CLOCK_TICKS, sum(values) / CLOCK_TICKS


@dataclass
class CpuWindow:
    """CPU used by groups of processes between the window's start and end, in cores."""

    groups: dict[str, list[int]]
    usage: dict[str, float] = field(default_factory=dict)

    def watch(self, start_at: float, end_at: float, db_root: int | None) -> threading.Thread:
        def run() -> None:
            time.sleep(max(0.0, start_at - time.time()))
            if db_root is not None:  # PostgreSQL backends are forked per connection
                self.groups["db"] = [db_root, *_children(db_root)]
            # SQLite's event writer process and the fork server it came from.
            self.groups["writer"] = _descendants(self.groups["gateway"][0])
            before = {pid: _proc_cpu_s(pid) for pids in self.groups.values() for pid in pids}
            machine_before = _machine_busy_s()
            t0 = time.time()
            time.sleep(max(0.0, end_at - time.time()))
            if db_root is not None:
                self.groups["db"] = [db_root, *_children(db_root)]
            # Listed again: the writer may have been forked after the window opened (the fork
            # server takes a second or so to start); a process started in the window counts
            # from zero.
            self.groups["writer"] = _descendants(self.groups["gateway"][0])
            wall = time.time() - t0
            for name, pids in self.groups.items():
                used = sum(max(0.0, _proc_cpu_s(pid) - before.get(pid, 0.0)) for pid in pids)
                self.usage[name] = used / wall
            busy, total = _machine_busy_s()
            cores = os.cpu_count() or 1
            machine = (busy - machine_before[0]) / max(1e-9, total - machine_before[1]) * cores
            self.usage["other"] = max(0.0, machine - sum(self.usage.values()))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


# -- a row of the table -----------------------------------------------------------------------


@dataclass
class Row:
    backend: str
    op: str
    clients: int
    ops_s: float
    p50_ms: float
    p99_ms: float
    cpu: dict[str, float]
    errors: Counter[str]
    ok_total: int
    ratio: float | None = None


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Bench:
    url: str
    gateway_pid: int
    backend: str
    db_pid: int | None
    args: argparse.Namespace
    event_body: tuple[bytes, bytes]
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    append_clients: dict[int, list[ClientSpec]] = field(default_factory=dict)
    append_ok: dict[str, int] = field(default_factory=dict)
    create_ok: int = 0

    def cell(self, op: str, n_clients: int, clients: list[ClientSpec]) -> Row:
        args = self.args
        spec = CellSpec(
            url=self.url,
            op=op,
            clients=clients,
            start_at=time.time() + 0.2,
            warmup_s=args.warmup,
            duration_s=args.duration,
            template=self.event_body if op == "append" else create_template(),
            client=args.client,
        )
        procs = max(1, min(args.client_procs, n_clients))
        shares = [clients[i::procs] for i in range(procs)]
        groups = {"gateway": [self.gateway_pid]}
        window = (spec.start_at + spec.warmup_s, spec.start_at + spec.warmup_s + spec.duration_s)
        if procs == 1:
            groups["client"] = [os.getpid()]
            cpu = CpuWindow(groups)
            watcher = cpu.watch(*window, self.db_pid)
            results = [_drive(spec, shares[0])]
        else:
            ctx = multiprocessing.get_context("fork")
            pipes, workers = [], []
            for share in shares:
                receiver, sender = ctx.Pipe(duplex=False)
                worker = ctx.Process(target=_drive_into, args=(spec, share, sender), daemon=True)
                worker.start()
                pipes.append(receiver)
                workers.append(worker)
            groups["client"] = [w.pid for w in workers if w.pid is not None]
            cpu = CpuWindow(groups)
            watcher = cpu.watch(*window, self.db_pid)
            results = [pipe.recv() for pipe in pipes]
            for worker in workers:
                worker.join()
        watcher.join()
        latencies = [ms for r in results for ms in r.latencies_ms]
        errors: Counter[str] = Counter()
        ok_by_client: dict[str, int] = {}
        for r in results:
            errors.update(r.errors)
            ok_by_client.update(r.ok_by_client)
        if op == "append":
            self.append_ok.update(ok_by_client)
        elif op == "create":
            self.create_ok += sum(ok_by_client.values())
        return Row(
            backend=self.backend,
            op=op,
            clients=n_clients,
            ops_s=len(latencies) / args.duration,
            p50_ms=_percentile(latencies, 0.50),
            p99_ms=_percentile(latencies, 0.99),
            cpu=cpu.usage,
            errors=errors,
            ok_total=sum(ok_by_client.values()),
        )

    def open_attempts(self, n_clients: int) -> list[ClientSpec]:
        """One rollout per client, each with an open attempt, posted to with the admin key:
        `model_request` events are the proxy's to write, a scoped token gets 403."""
        ids = [f"bench-{self.run_id}-{n_clients}c-{i}" for i in range(n_clients)]
        specs = [{"rollout_id": rollout_id, "input": {"i": i}} for i, rollout_id in enumerate(ids)]
        with httpx.Client(base_url=self.url, headers=_admin(), timeout=60) as http:
            _check(http.post("/api/rollouts", json=specs))
            clients = []
            for rollout_id in ids:
                attempt = _check(http.post(f"/api/rollouts/{rollout_id}/attempts"))
                clients.append(
                    ClientSpec(
                        key_prefix=f"{rollout_id}-ev",
                        rollout_id=rollout_id,
                        attempt_id=attempt["attempt_id"],
                    )
                )
        self.append_clients[n_clients] = clients
        return clients

    def verify(self) -> list[str]:
        """Read back every event and rollout; stored counts must equal the 2xx answers."""
        lines = []
        with httpx.Client(base_url=self.url, headers=_admin(), timeout=120) as http:
            stored_total = answered_total = 0
            bad = []
            for clients in self.append_clients.values():
                for client in clients:
                    stored = _count_events(http, client.rollout_id, client.attempt_id)
                    answered = self.append_ok.get(client.key_prefix, 0)
                    stored_total += stored
                    answered_total += answered
                    if stored != answered:
                        bad.append(f"{client.rollout_id}: {stored} stored, {answered} answered")
            verdict = "OK" if not bad else "MISMATCH " + "; ".join(bad[:5])
            lines.append(
                f"{self.backend}: events stored {stored_total}, 2xx answers {answered_total}: "
                f"{verdict}"
            )
            created = _count_rollouts(http, f"bench-{self.run_id}-create-")
            verdict = "OK" if created == self.create_ok else "MISMATCH"
            lines.append(
                f"{self.backend}: rollouts created {created}, 2xx answers {self.create_ok}: "
                f"{verdict}"
            )
        return lines


def _admin() -> dict[str, str]:
    return {"authorization": f"Bearer {API_KEY}"}


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 300:
        raise RuntimeError(f"{response.request.url}: {response.status_code} {response.text}")
    return response.json()


def _count_events(http: httpx.Client, rollout_id: str, attempt_id: int) -> int:
    count, after, keys = 0, 0, set[str]()
    while True:
        page = _check(
            http.get(
                f"/api/rollouts/{rollout_id}/events",
                params={"attempt_id": attempt_id, "after": after, "limit": 1000},
            )
        )
        if not page:
            return count if len(keys) == count else -1
        count += len(page)
        keys.update(event["idempotency_key"] for event in page)
        after = page[-1]["seq"]


def _count_rollouts(http: httpx.Client, prefix: str) -> int:
    count, cursor = 0, 0
    while True:
        page = _check(http.get("/api/rollouts", params={"cursor": cursor, "limit": 1000}))
        count += sum(item["rollout_id"].startswith(prefix) for item in page["items"])
        if not page["items"]:
            return int(count)
        cursor = page["next_cursor"]


# -- the run ----------------------------------------------------------------------------------


class BackendUnavailable(Exception):
    pass


class _Postgres:
    """A cluster started in the background (initdb overlaps the first gateway's start)."""

    def __init__(self, pool: futures.ThreadPoolExecutor) -> None:
        self.future: Future[PostgresServer] = pool.submit(PostgresServer.start)
        self.stopped = False

    def wait(self) -> None:
        futures.wait([self.future])

    def server(self) -> PostgresServer:
        try:
            return self.future.result()
        except (RuntimeError, OSError, subprocess.SubprocessError) as error:
            raise BackendUnavailable(f"PostgreSQL did not start: {error}") from error

    def stop(self) -> None:
        self.wait()
        if not self.stopped and self.future.exception() is None:
            self.future.result().stop()
        self.stopped = True


@contextlib.contextmanager
def _backend(
    name: str, workdir: Path, postgres: _Postgres | None
) -> Iterator[tuple[str, int | None]]:
    """(database URL, PID of the database server or None) for the backend."""
    if name == "sqlite":
        yield str(workdir / "gateway.db"), None
        return
    if name != "postgres" or postgres is None:
        raise BackendUnavailable(f"unknown backend {name!r}")
    server = postgres.server()
    try:
        yield server.create_database("bench"), server.pid
    finally:
        postgres.stop()


def _py_spy(args: argparse.Namespace, pid: int, label: str) -> subprocess.Popen[bytes] | None:
    if not args.py_spy:
        return None
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = Path(args.py_spy) / f"{label}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    duration = max(1, int(args.warmup + args.duration))
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--duration", str(duration), "--rate", "250",
         "--format", "raw", "--threads", "--nonblocking", "--subprocesses", "--output", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


def run_backend(
    name: str,
    args: argparse.Namespace,
    event_body: tuple[bytes, bytes],
    postgres: _Postgres | None,
) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    with (
        tempfile.TemporaryDirectory(prefix="reins-bench-") as tmp,
        _backend(name, Path(tmp), postgres) as (url, db_pid),
        running_gateway(url, API_KEY) as gateway,
    ):
        assert gateway.process is not None
        if postgres is not None:  # initdb may run alongside a gateway start, never a cell
            postgres.wait()
        bench = Bench(gateway.url, gateway.process.pid, name, db_pid, args, event_body)
        for n_clients in args.clients:
            healthz: float | None = None
            for op in args.ops:
                if op == "append":
                    clients = bench.open_attempts(n_clients)
                else:
                    clients = [
                        ClientSpec(key_prefix=f"bench-{bench.run_id}-{op}-{n_clients}c{i}")
                        for i in range(n_clients)
                    ]
                spy = _py_spy(args, gateway.process.pid, f"{name}-{op}-{n_clients}")
                cell_started = time.monotonic()
                row = bench.cell(op, n_clients, clients)
                args.cell_time += time.monotonic() - cell_started
                if spy is not None:
                    spy.wait(timeout=60)
                if op == "healthz":
                    healthz = row.ops_s
                row.ratio = row.ops_s / healthz if healthz else None
                rows.append(row)
                print(_format(row), flush=True)
        notes = bench.verify()
    if gateway.log_path is not None:  # kept only when the gateway failed
        gateway.log_path.unlink(missing_ok=True)
    return rows, notes


HEADER = (
    f"{'backend':<9}{'op':<9}{'clients':>7}{'ops/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
    f"{'vs healthz':>12}{'gw CPU':>8}{'writer':>8}{'db CPU':>8}{'cli CPU':>9}{'other':>7}"
    f"{'srv ms/op':>11}"
    "  errors"
)


def _format(row: Row) -> str:
    ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
    db = f"{row.cpu['db'] * 100:.0f}%" if "db" in row.cpu else "-"
    errors = ", ".join(f"{k}: {v}" for k, v in row.errors.items()) or "0"
    server_cpu = row.cpu.get("gateway", 0) + row.cpu.get("writer", 0) + row.cpu.get("db", 0)
    per_op = f"{server_cpu / row.ops_s * 1000:.2f}" if row.ops_s else "-"
    return (
        f"{row.backend:<9}{row.op:<9}{row.clients:>7}{row.ops_s:>10.0f}{row.p50_ms:>9.2f}"
        f"{row.p99_ms:>9.2f}{ratio:>12}{row.cpu.get('gateway', 0) * 100:>7.0f}%"
        f"{row.cpu.get('writer', 0) * 100:>7.0f}%{db:>8}"
        f"{row.cpu.get('client', 0) * 100:>8.0f}%{row.cpu.get('other', 0) * 100:>6.0f}%"
        f"{per_op:>11}  {errors}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="20 s per cell instead of 3 s")
    parser.add_argument("--duration", type=float, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=0.3, help="unmeasured seconds per cell")
    parser.add_argument("--backends", default="sqlite,postgres", help="sqlite,postgres")
    parser.add_argument("--ops", default=",".join(OPS), help="healthz,create,append")
    parser.add_argument("--clients", default="1,16", help="concurrent client counts")
    parser.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes (the simulated clients are spread over them); default 1",
    )
    parser.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="raw: a minimal HTTP/1.1 keep-alive client (default); httpx: httpx.AsyncClient",
    )
    parser.add_argument(
        "--sqlite-synchronous",
        choices=["NORMAL", "FULL"],
        default="NORMAL",
        help="NORMAL (the gateway's default) survives a killed process; FULL a power loss",
    )
    parser.add_argument("--py-spy", metavar="DIR", help="record the gateway with py-spy per cell")
    args = parser.parse_args()
    args.duration = args.duration or (20.0 if args.long else 3.0)
    args.clients = [int(c) for c in args.clients.split(",")]
    args.ops = [op for op in args.ops.split(",") if op]
    if "healthz" in args.ops:  # the baseline runs first for each client count
        args.ops = ["healthz", *[op for op in args.ops if op != "healthz"]]
    backends = [b for b in args.backends.split(",") if b]
    args.cell_time = 0.0
    os.environ["REINS_SQLITE_SYNCHRONOUS"] = args.sqlite_synchronous

    event_body = append_template(event_data(random.Random(7)))
    event_bytes = len(event_body[0]) + len(event_body[1]) + 40
    procs = (
        "1 process (asyncio + uvloop)"
        if args.client_procs == 1
        else f"{args.client_procs} processes (asyncio + uvloop each)"
    )
    kind = (
        "a minimal HTTP/1.1 client (pre-built requests, Content-Length answers)"
        if args.client == "raw"
        else "one httpx.AsyncClient"
    )
    print(f"reins gateway benchmark: {os.cpu_count()} CPU cores (os.cpu_count()), Python "
          f"{sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S')}")  # fmt: skip
    print(
        f"client: {procs}; per simulated client {kind} on 1 keep-alive connection, "
        "waiting for each answer before the next request (closed loop)"
    )
    print(
        f"cell: {args.warmup:.1f} s warm-up + {args.duration:.1f} s measured; append = one "
        f"~{event_bytes} B model_request event per POST under the admin key, "
        "one rollout per client; create = one rollout per POST"
    )
    print(
        f"sqlite: WAL, synchronous={args.sqlite_synchronous}; postgres: local cluster, "
        "fsync=on; CPU columns: % of one core over the measured window (db = PostgreSQL "
        "processes; writer = the gateway's SQLite event writer process; other = the rest of "
        "the machine: noise); srv ms/op = (gateway + writer + db) CPU ms per answered "
        "request, steadier than ops/s on a noisy machine"
    )
    print()
    print(HEADER, flush=True)
    started = time.monotonic()
    rows: list[Row] = []
    notes: list[str] = []
    with futures.ThreadPoolExecutor(1) as pool:
        postgres = _Postgres(pool) if "postgres" in backends else None
        try:
            for backend in backends:
                try:
                    backend_rows, backend_notes = run_backend(backend, args, event_body, postgres)
                except BackendUnavailable as error:
                    notes.append(f"{backend}: SKIPPED, {error}")
                    continue
                rows += backend_rows
                notes += backend_notes
        finally:
            if postgres is not None:
                postgres.stop()
    print()
    for note in notes:
        print(note)
    total = time.monotonic() - started
    print(
        f"total time {total:.1f} s: cells {args.cell_time:.1f} s, servers, setup and "
        f"read-back {total - args.cell_time:.1f} s"
    )
    headline = next(
        (r.ops_s for r in rows if (r.backend, r.op, r.clients) == ("sqlite", "append", 16)),
        float("nan"),
    )
    print(f"gateway_event_appends_sqlite_16: {headline:.0f} appends/s")


if __name__ == "__main__":
    main()
