"""LLM proxy overhead: reins's proxy and LiteLLM's, each in front of the same stub engine.

One stub engine (`tests/stub_engine.py`, vLLM-shaped, no model) runs in its own uvicorn process
(uvloop, httptools) on loopback. One small non-streaming chat call, as a harness makes it (3
messages, ~300 characters), is sent along each path:

- `direct`: client -> stub `/v1/chat/completions`;
- `direct+ids`: the same, with the fields reins adds on the way to the engine (token IDs,
  logprobs, the `train` sampling settings), so the engine's larger answer is visible apart from
  the proxy's own work;
- `reins`: client -> `reins gateway` (its own process, SQLite file in a temp dir) proxy path
  `/proxy/rollout/{id}/attempt/1/mode/train/openai/v1/chat/completions` under the attempt's scoped
  token -> stub; every call is recorded as a `model_request` event before it is answered;
- `litellm`: client -> LiteLLM's proxy server (`litellm --config`, from `.venv-litellm`, see
  `scripts/install-litellm-bench.sh`; no database, master key auth) -> stub.

Every path is measured with the same client: one `httpx.AsyncClient` (one keep-alive connection)
per simulated client, all in one asyncio (uvloop) process, each waiting for its answer before the
next call. Latency p50/p99 at 1 client is measured in short slices that rotate over the paths, so
the machine's noise falls on every path alike; throughput at 16 clients is one warm-up plus one
fixed window per path. Added latency = path p50 (p99) - direct p50 (p99). After the run every
reins rollout's `model_request` events are counted and checked against the 2xx answers.

    .venv/bin/python benchmarks/proxy.py            # 3 s per cell; about a minute with LiteLLM
    .venv/bin/python benchmarks/proxy.py --long     # 15 s per cell
    .venv/bin/python benchmarks/proxy.py --py-spy /tmp/spy   # + py-spy stacks of the gateway

The last line is the headline: `proxy_added_latency_p50: VALUE ms` (reins p50 - direct p50).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reins.gateway.capture import upstream_body  # noqa: E402
from reins.gateway.settings import GatewaySettings  # noqa: E402
from tests.support import descendants, free_port, running_gateway  # noqa: E402

API_KEY = "bench-admin-key"
MODEL = "stub"
LITELLM_VENV = Path(os.environ.get("REINS_LITELLM_VENV", ROOT / ".venv-litellm"))
INSTALL_LITELLM = "bash scripts/install-litellm-bench.sh"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
HIGH = 16  # clients in the throughput cell

MESSAGES = [
    {
        "role": "system",
        "content": "You are a careful software engineer. Use the tools to read, edit and test "
        "code. Answer with one tool call per turn.",
    },
    {
        "role": "user",
        "content": "The test tests/test_parser.py::test_nested_lists fails with an IndexError "
        "in parse_list. Find the cause and fix it without changing the public API.",
    },
    {"role": "user", "content": "Observation: 1 failed, 41 passed in 0.84s"},
]


def harness_body() -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 256, "temperature": 0.7}


# -- processes --------------------------------------------------------------------------------


def _proc_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def _cpu(pids: list[int]) -> float:
    """Of the processes and their own (the gateway's SQLite event writer and its fork server)."""
    return sum(_proc_cpu_s(p) for pid in pids for p in _tree(pid))


def _tree(pid: int) -> list[int]:
    return [pid, *descendants(pid)]


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def _wait_ready(
    url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float, name: str
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited early:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{name} did not start in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


STUB_CODE = (
    "import sys, uvicorn\n"
    "from tests.stub_engine import create_stub_app\n"
    "uvicorn.run(create_stub_app(), host='127.0.0.1', port=int(sys.argv[1]), loop='uvloop',\n"
    "            http='httptools', log_level='warning', access_log=False)\n"
)


def start_stub(port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", STUB_CODE, str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def litellm_version() -> str:
    found = list((LITELLM_VENV / "lib").glob("python3*/site-packages/litellm-*.dist-info"))
    return found[0].name.removeprefix("litellm-").removesuffix(".dist-info") if found else "?"


def start_litellm(
    port: int, stub_url: str, master_key: str, workdir: Path, log: Path
) -> subprocess.Popen[bytes]:
    """LiteLLM's proxy server: config file, no database, no network beyond the stub."""
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": stub_url,
                    "api_key": "x",
                },
            }
        ],
        "litellm_settings": {"telemetry": False},
        "general_settings": {"master_key": master_key},
    }
    path = workdir / "litellm.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"DATABASE_URL", "DIRECT_URL", "REDIS_HOST", "REDIS_URL"}
        and not key.startswith("LITELLM_")
    }
    env.update(
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # else it downloads a price table at import
        LITELLM_LOG="ERROR",  # no per-request log lines (reins runs without an access log too)
        LITELLM_MODE="PRODUCTION",  # no .env loading
        LITELLM_DONT_SHOW_FEEDBACK_BOX="True",
        NO_PROXY="127.0.0.1,localhost",
    )
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                str(LITELLM_VENV / "bin" / "litellm"),
                "--config",
                str(path),
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
            ],
            cwd=workdir,  # no stray .env or config from the repo
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


# -- paths ------------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    routes: list[tuple[str, dict[str, str]]]
    """Per simulated client (index): the URL to post to and its headers."""
    body: bytes
    pids: list[int] = field(default_factory=list)
    """The proxy's processes (CPU accounting); none for the direct paths."""
    ok_by_client: Counter[int] = field(default_factory=Counter)
    """Every 2xx answer per client index, warm-up included (checked against the store)."""


@dataclass
class Cell:
    latencies_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    proxy_cpu_s: float = 0.0
    stub_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def calls_s(self) -> float:
        return len(self.latencies_ms) / self.seconds if self.seconds else float("nan")

    def per_call_ms(self, cpu_s: float) -> float:
        return cpu_s / len(self.latencies_ms) * 1000 if self.latencies_ms else float("nan")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=60,
        trust_env=False,
        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
    )


async def _loop(
    http: httpx.AsyncClient,
    path: Target,
    index: int,
    cell: Cell,
    window: tuple[float, float],
    record: bool = True,
    stop_at: float | None = None,
) -> None:
    """Calls back to back until stop_at (the window's end); keeps latencies answered inside it."""
    url, headers = path.routes[index]
    start, end = window
    stop_at = end if stop_at is None else stop_at
    while time.perf_counter() < stop_at:
        t0 = time.perf_counter()
        try:
            response = await http.post(url, content=path.body, headers=headers)
        except httpx.HTTPError as error:
            cell.errors[type(error).__name__] += 1
            continue
        t1 = time.perf_counter()
        if 200 <= response.status_code < 300:
            path.ok_by_client[index] += 1
            if record and start <= t1 <= end:
                cell.latencies_ms.append((t1 - t0) * 1000)
        else:
            cell.errors[f"HTTP {response.status_code}"] += 1


class _CpuMeter:
    def __init__(self, path: Target, stub_pid: int) -> None:
        self.path, self.stub_pid = path, stub_pid

    def read(self) -> tuple[float, float, float]:
        return _cpu(self.path.pids), _proc_cpu_s(self.stub_pid), time.process_time()

    def add(self, cell: Cell, before: tuple[float, float, float]) -> None:
        after = self.read()
        cell.proxy_cpu_s += after[0] - before[0]
        cell.stub_cpu_s += after[1] - before[1]
        cell.client_cpu_s += after[2] - before[2]


async def measure_c1(
    paths: list[Target], stub_pid: int, warmup_s: float, duration_s: float, slice_s: float
) -> dict[str, Cell]:
    """One client per path; short slices rotate over the paths until each had duration_s."""
    cells = {path.name: Cell() for path in paths}
    clients = {path.name: _client() for path in paths}
    try:
        for path in paths:  # open the connection, warm both servers' caches
            now = time.perf_counter()
            await _loop(clients[path.name], path, 0, cells[path.name], (now, now + warmup_s), False)
        rounds = max(1, round(duration_s / slice_s))
        for number in range(rounds):
            shift = number % len(paths)
            for path in paths[shift:] + paths[:shift]:
                cell, meter = cells[path.name], _CpuMeter(path, stub_pid)
                before = meter.read()
                now = time.perf_counter()
                # Every call of the slice counts, the one that ends after it too, so that the
                # CPU measured over the slice is divided by the calls that used it.
                window = (now, math.inf)
                await _loop(clients[path.name], path, 0, cell, window, stop_at=now + slice_s)
                cell.seconds += time.perf_counter() - now
                meter.add(cell, before)
    finally:
        for client in clients.values():
            await client.aclose()
    return cells


async def measure_many(
    path: Target, n_clients: int, stub_pid: int, warmup_s: float, duration_s: float
) -> Cell:
    """n_clients at once: warm-up, then one measured window."""
    cell, meter = Cell(), _CpuMeter(path, stub_pid)
    clients = [_client() for _ in range(n_clients)]
    start = time.perf_counter() + warmup_s
    window = (start, start + duration_s)

    async def watch() -> None:
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        before = meter.read()
        await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
        meter.add(cell, before)

    try:
        await asyncio.gather(
            watch(), *(_loop(c, path, i, cell, window) for i, c in enumerate(clients))
        )
    finally:
        for client in clients:
            await client.aclose()
    cell.seconds = duration_s
    return cell


def _run(coro_factory: Callable[[], Any]) -> Any:
    try:
        import uvloop

        return uvloop.run(coro_factory())
    except ImportError:
        return asyncio.run(coro_factory())


# -- reins setup and checks -------------------------------------------------------------------


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 300:
        raise RuntimeError(f"{response.request.url}: {response.status_code} {response.text}")
    return response.json()


def setup_reins(gateway_url: str, stub_url: str, n_clients: int) -> tuple[list[str], list[str]]:
    """Registers the stub; one rollout per simulated client with attempt 1 open. (ids, tokens)"""
    run = uuid.uuid4().hex[:8]
    ids = [f"proxy-bench-{run}-{i}" for i in range(n_clients)]
    with httpx.Client(
        base_url=gateway_url,
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=60,
        trust_env=False,
    ) as http:
        _check(http.post("/api/models", json={"model": MODEL, "endpoint": stub_url}))
        _check(http.post("/api/rollouts", json=[{"rollout_id": i, "input": {}} for i in ids]))
        tokens = []
        for rollout_id in ids:
            attempt = _check(http.post(f"/api/rollouts/{rollout_id}/attempts"))
            assert attempt["attempt_id"] == 1, attempt
            tokens.append(attempt["token"])
    return ids, tokens


def count_model_requests(gateway_url: str, rollout_id: str) -> int:
    count, after = 0, 0
    with httpx.Client(
        base_url=gateway_url,
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=120,
        trust_env=False,
    ) as http:
        while True:
            page = _check(
                http.get(
                    f"/api/rollouts/{rollout_id}/events",
                    params={"attempt_id": 1, "type": "model_request", "after": after},
                )
            )
            if not page:
                return count
            count += len(page)
            after = page[-1]["seq"]


def sanity_call(path: Target) -> str:
    """One call before the clock starts: the answer must be the stub's, stripped for reins."""
    url, headers = path.routes[0]
    response = httpx.post(url, content=path.body, headers=headers, timeout=60, trust_env=False)
    payload = _check(response)
    path.ok_by_client[0] += 1
    text = payload["choices"][0]["message"]["content"]
    if "Hello from the stub" not in text:
        raise RuntimeError(f"{path.name}: unexpected answer {payload}")
    return f"{path.name} {len(response.content)} B"


# -- the run ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _py_spy(
    directory: str | None, pid: int | None, label: str
) -> Iterator[subprocess.Popen[bytes] | None]:
    if not directory or pid is None:
        yield None
        return
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    Path(directory).mkdir(parents=True, exist_ok=True)
    out = Path(directory) / f"reins-{label}.txt"
    spy = subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--rate", "500", "--format", "raw", "--nonblocking",
         "--output", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield spy
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        with contextlib.suppress(subprocess.TimeoutExpired):
            spy.wait(timeout=30)


@dataclass
class Row:
    name: str
    c1: Cell
    many: Cell
    pids: list[int]

    @property
    def p50(self) -> float:
        return _percentile(self.c1.latencies_ms, 0.50)

    @property
    def p99(self) -> float:
        return _percentile(self.c1.latencies_ms, 0.99)


HEADER2 = (
    f"{'':<11}{'c=1':>16}{f'c={HIGH}':>25}{'added vs direct, c=1':>22}"
    f"{'proxy CPU ms/call':>19}{'stub CPU':>10}{'client':>8}"
)
HEADER = (
    f"{'path':<11}{'p50 ms':>8}{'p99 ms':>8}{'calls/s':>9}{'p50 ms':>8}{'p99 ms':>8}"
    f"{'p50 ms':>11}{'p99 ms':>11}{f'c=1 / c={HIGH}':>19}{'ms/call':>10}{'CPU':>8}"
    "  errors"
)
LEGEND = (
    f"stub CPU: the stub engine's CPU per call at c={HIGH}; client: the client process's CPU at "
    f"c={HIGH}, % of one core (it shares the {os.cpu_count()} cores with the servers)"
)


def _fmt(value: float, width: int, digits: int = 2) -> str:
    return f"{value:>{width}.{digits}f}" if value == value else f"{'-':>{width}}"


def format_row(row: Row, direct: Row | None) -> str:
    added50 = row.p50 - direct.p50 if direct is not None else float("nan")
    added99 = row.p99 - direct.p99 if direct is not None else float("nan")
    if direct is row:
        added50 = added99 = float("nan")
    proxy = "-"
    if row.pids:
        c1, many = (
            row.c1.per_call_ms(row.c1.proxy_cpu_s),
            row.many.per_call_ms(row.many.proxy_cpu_s),
        )
        proxy = f"{c1:.2f} / {many:.2f}"
    client = row.many.client_cpu_s / row.many.seconds * 100 if row.many.seconds else float("nan")
    errors = row.c1.errors + row.many.errors
    return (
        f"{row.name:<11}{_fmt(row.p50, 8)}{_fmt(row.p99, 8)}{_fmt(row.many.calls_s, 9, 0)}"
        f"{_fmt(_percentile(row.many.latencies_ms, 0.5), 8)}"
        f"{_fmt(_percentile(row.many.latencies_ms, 0.99), 8)}"
        f"{_fmt(added50, 11)}{_fmt(added99, 11)}{proxy:>19}"
        f"{_fmt(row.many.per_call_ms(row.many.stub_cpu_s), 10)}{_fmt(client, 7, 0)}%"
        f"  {', '.join(f'{k}: {v}' for k, v in errors.items()) or '0'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="15 s per cell instead of 3 s")
    parser.add_argument("--duration", type=float, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=0.3, help="unmeasured seconds per cell")
    parser.add_argument("--slice", type=float, default=0.25, help="c=1 rotation slice, seconds")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM path")
    parser.add_argument(
        "--py-spy", metavar="DIR", help="record the reins gateway with py-spy (raw stacks)"
    )
    args = parser.parse_args()
    duration = args.duration or (15.0 if args.long else 3.0)
    started = time.monotonic()

    print(
        f"reins proxy benchmark: {os.cpu_count()} CPU cores (os.cpu_count()), Python "
        f"{sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S')}"
    )
    want_litellm = not args.no_litellm
    if want_litellm and not (LITELLM_VENV / "bin" / "litellm").exists():
        print(
            f"litellm: {LITELLM_VENV} is missing; install it with `{INSTALL_LITELLM}` "
            "(a separate venv; about 100 s and 750 MB); skipping the LiteLLM path"
        )
        want_litellm = False

    settings = GatewaySettings(api_key=API_KEY)
    harness = harness_body()
    engine = upstream_body(harness, kind="chat", model=MODEL, policy=settings.train_sampling)
    harness_bytes = json.dumps(harness).encode()
    chars = sum(len(m["content"]) for m in MESSAGES)

    with tempfile.TemporaryDirectory(prefix="reins-proxy-bench-") as tmp_name:
        tmp = Path(tmp_name)
        stub_port = free_port()
        stub_url = f"http://127.0.0.1:{stub_port}/v1"
        litellm: subprocess.Popen[bytes] | None = None
        stub: subprocess.Popen[bytes] | None = None
        timings: dict[str, float] = {}
        try:
            # LiteLLM first: it takes longest to start; the others start meanwhile.
            t0 = time.monotonic()
            master_key = "sk-" + secrets.token_hex(32)
            litellm_port = free_port()
            if want_litellm:
                litellm = start_litellm(
                    litellm_port, stub_url, master_key, tmp, tmp / "litellm.log"
                )
            stub = start_stub(stub_port, tmp / "stub.log")
            _wait_ready(f"{stub_url}/models", stub, tmp / "stub.log", 60, "stub engine")
            timings["stub"] = time.monotonic() - t0
            t1 = time.monotonic()
            with running_gateway(str(tmp / "gateway.db"), API_KEY) as gateway:
                assert gateway.process is not None
                timings["reins"] = time.monotonic() - t1
                ids, tokens = setup_reins(gateway.url, stub_url, HIGH)
                if litellm is not None:
                    _wait_ready(
                        f"http://127.0.0.1:{litellm_port}/health/liveliness",
                        litellm,
                        tmp / "litellm.log",
                        300,
                        "litellm",
                    )
                    timings["litellm"] = time.monotonic() - t0
                chat = "/chat/completions"
                plain = {"content-type": "application/json", "authorization": "Bearer x"}
                paths = [
                    Target("direct", [(stub_url + chat, plain)] * HIGH, harness_bytes),
                    Target(
                        "direct+ids", [(stub_url + chat, plain)] * HIGH, json.dumps(engine).encode()
                    ),
                    Target(
                        "reins",
                        [
                            (
                                f"{gateway.url}/proxy/rollout/{rollout_id}/attempt/1/mode/train"
                                f"/openai/v1{chat}",
                                {
                                    "content-type": "application/json",
                                    "authorization": f"Bearer {token}",
                                },
                            )
                            for rollout_id, token in zip(ids, tokens, strict=True)
                        ],
                        harness_bytes,
                        pids=[gateway.process.pid],
                    ),
                ]
                if litellm is not None:
                    key = {
                        "content-type": "application/json",
                        "authorization": f"Bearer {master_key}",
                    }
                    url = f"http://127.0.0.1:{litellm_port}/v1{chat}"
                    paths.append(
                        Target("litellm", [(url, key)] * HIGH, harness_bytes, [litellm.pid])
                    )
                answers = [sanity_call(path) for path in paths]

                print(
                    f"stub engine: tests/stub_engine.py, own uvicorn process (uvloop, httptools), "
                    f"127.0.0.1; ready in {timings['stub']:.1f} s"
                )
                print(
                    "reins gateway: own process, SQLite (WAL) in a temp dir; ready in "
                    f"{timings['reins']:.1f} s"
                )
                if litellm is not None:
                    print(
                        f"litellm: {litellm_version()} proxy server ({LITELLM_VENV.name}), no "
                        f"database, master key; ready in {timings['litellm']:.1f} s after launch"
                    )
                print(
                    "client: one httpx.AsyncClient (1 keep-alive connection) per simulated client, "
                    "all in one asyncio (uvloop) process; closed loop"
                )
                print(
                    f"request: non-streaming chat, {len(MESSAGES)} messages, {chars} characters, "
                    f"{len(harness_bytes)} B of JSON; answers: {', '.join(answers)}"
                )
                print(
                    f"c=1: {args.warmup:.1f} s warm-up per path, then {args.slice:.2f} s slices "
                    f"rotating over the paths, {duration:.1f} s measured per path; c={HIGH}: "
                    f"{args.warmup:.1f} s warm-up + {duration:.1f} s per path"
                )
                print(
                    "direct+ids: direct with the fields reins adds upstream (return_token_ids, "
                    "logprobs, train sampling): the engine's bigger answer without any proxy"
                )
                print()
                print(HEADER2)
                print(HEADER, flush=True)

                t2 = time.monotonic()
                pid = gateway.process.pid
                with _py_spy(args.py_spy, pid, "c1"):
                    c1 = _run(
                        lambda: measure_c1(paths, stub.pid, args.warmup, duration, args.slice)
                    )
                rows: list[Row] = []
                for path in paths:
                    with _py_spy(args.py_spy if path.name == "reins" else None, pid, f"c{HIGH}"):
                        many = _run(
                            lambda path=path: measure_many(
                                path, HIGH, stub.pid, args.warmup, duration
                            )
                        )
                    rows.append(Row(path.name, c1[path.name], many, path.pids))
                    print(format_row(rows[-1], rows[0]), flush=True)
                timings["cells"] = time.monotonic() - t2

                reins_path = next(p for p in paths if p.name == "reins")
                stored = [count_model_requests(gateway.url, rollout_id) for rollout_id in ids]
                answered = [reins_path.ok_by_client[i] for i in range(HIGH)]
        finally:
            _stop(litellm)
            _stop(stub)

    print(LEGEND)
    by_name = {row.name: row for row in rows}
    direct, reins = by_name["direct"], by_name["reins"]
    added50 = reins.p50 - direct.p50
    added99 = reins.p99 - direct.p99
    print()
    verdict = "OK" if stored == answered else f"MISMATCH stored {stored} answered {answered}"
    print(
        f"reins: model_request events stored {sum(stored)}, 2xx answers {sum(answered)}: {verdict}"
    )
    # One loopback HTTP hop is the direct call, measured in the same run: absolute times differ
    # several-fold between machines, so the aim (issue #17) is this ratio.
    hops = added50 / direct.p50
    print(
        f"reins added latency (c=1) vs direct: p50 {added50:.3f} ms, p99 {added99:.3f} ms; "
        f"p50 = {hops:.2f} hops of {direct.p50:.2f} ms (the direct call; aim <= 1.5 hops: "
        f"{'met' if hops <= 1.5 else 'MISSED'}); vs direct+ids, the proxy's own work: p50 "
        f"{reins.p50 - by_name['direct+ids'].p50:.3f} ms"
    )
    print(
        f"reins CPU per call: {reins.c1.per_call_ms(reins.c1.proxy_cpu_s):.2f} ms at c=1, "
        f"{reins.many.per_call_ms(reins.many.proxy_cpu_s):.2f} ms at c={HIGH}; "
        f"throughput c={HIGH}: {reins.many.calls_s / direct.many.calls_s:.2f}x direct"
    )
    if "litellm" in by_name:
        lite = by_name["litellm"]
        lite50, lite99 = lite.p50 - direct.p50, lite.p99 - direct.p99
        ratio = added50 / lite50 if lite50 > 0 else float("nan")
        print(
            f"litellm added latency (c=1) vs direct: p50 {lite50:.3f} ms, p99 {lite99:.3f} ms; "
            f"CPU per call {lite.c1.per_call_ms(lite.c1.proxy_cpu_s):.2f} ms at c=1, "
            f"{lite.many.per_call_ms(lite.many.proxy_cpu_s):.2f} ms at c={HIGH}; "
            f"throughput c={HIGH}: {lite.many.calls_s / direct.many.calls_s:.2f}x direct"
        )
        print(
            f"ratio reins added p50 / litellm added p50: {ratio:.3f} "
            f"(target <= 0.333: {'met' if ratio <= 1 / 3 else 'MISSED'}); p99: "
            f"{added99 / lite99 if lite99 > 0 else float('nan'):.3f}"
        )
    total = time.monotonic() - started
    startup = (
        f"LiteLLM startup {timings['litellm']:.1f} s (the others start meanwhile)"
        if "litellm" in timings
        else f"servers {timings['stub'] + timings['reins']:.1f} s"
    )
    servers = timings.get("litellm", timings["stub"] + timings["reins"])
    print(
        f"total time {total:.1f} s: {startup}, cells {timings['cells']:.1f} s, "
        f"setup and checks {total - timings['cells'] - servers:.1f} s"
    )
    print(f"proxy_added_latency_p50: {added50:.3f} ms")
    if stored != answered:
        sys.exit(1)


if __name__ == "__main__":
    main()
