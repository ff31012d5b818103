"""The LLM proxy on long prompts: what a coding agent's growing context costs the gateway.

A coding agent (Claude Code, Codex, mini-swe-agent) sends its whole history on every call, and
the proxy records each call with the prompt's token IDs, which the engine returns
(`return_token_ids`): at 128k tokens the answer carries 128k integers that the gateway parses,
checks, records in the call journal and packs, all on its one event loop. This measures that
per call at three context sizes, against the engine answering the very same body directly:

- `direct+ids`: client -> stub engine, with the body reins sends upstream (token IDs, logprobs,
  the `train` sampling settings): the engine's own cost of the long answer, without any proxy;
- `reins`: client -> `reins gateway` (own process, SQLite in a temp dir) -> stub engine, recorded.

The stub engine (`tests/stub_engine.py`, own uvicorn process) tokenizes UTF-8 bytes, so a
context of N bytes is an N-token prompt. Each size is an agent's history grown to that many
bytes (tool outputs of ~3 KB); each measured call then adds an answer and a short observation,
as an agent's next turn does (the proxy's token reuse applies, as in a real run). Calls
alternate between the two paths. Per size: p50 of each path, the added p50, the gateway's CPU
per call (its process and the SQLite event writer's, from /proc), and the longest wait of a
`/healthz` asked every 5 ms meanwhile (how long the long calls hold up every other request).

    .venv/bin/python benchmarks/proxy_long.py           # 8k, 32k, 128k tokens; under a minute
    .venv/bin/python benchmarks/proxy_long.py --calls 60

The last line is the headline: `proxy_long_prompt_added_128k: VALUE ms` (reins p50 - direct+ids
p50 at 128k tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy import (
    API_KEY,
    MODEL,
    _cpu,
    _stop,
    _wait_ready,
    setup_reins,
    start_stub,
)

from reins.gateway.capture import upstream_body
from reins.gateway.settings import GatewaySettings
from tests.support import free_port, running_gateway

SIZES = (8_000, 32_000, 128_000)
OBSERVATION_BYTES = 3_000
WORDS = ("def", "return", "self", "value", "import", "test", "x", "=", "None", "file.py", "0")


def history(size: int, rng: random.Random) -> list[dict[str, Any]]:
    """An agent's messages of about `size` bytes: a task, then answers and tool outputs."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": "Fix the failing test in tests/test_parser.py."},
    ]
    total = sum(len(m["content"]) for m in messages)
    turn = 0
    while total < size:
        answer = f"I will look at file {turn}."
        output = " ".join(rng.choice(WORDS) for _ in range(OBSERVATION_BYTES // 5))
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": output}]
        total += len(answer) + len(output)
        turn += 1
    return messages


def measure(
    size: int,
    calls: int,
    stub_url: str,
    gateway_url: str,
    rollout: tuple[str, str],
    gateway_pids: list[int],
) -> dict[str, float]:
    rng = random.Random(size)
    messages = history(size, rng)
    proxy_url = (
        f"{gateway_url}/proxy/rollout/{rollout[0]}/attempt/1/mode/train/openai/v1/chat/completions"
    )
    auth = {"authorization": f"Bearer {rollout[1]}", "content-type": "application/json"}
    plain = {"content-type": "application/json"}
    policy = GatewaySettings().train_sampling
    direct: list[float] = []
    reins: list[float] = []
    waits: list[float] = []
    stop = threading.Event()

    def ask_healthz() -> None:
        with httpx.Client(trust_env=False, timeout=30) as client:
            while not stop.is_set():
                started = time.perf_counter()
                client.get(gateway_url + "/healthz")
                waits.append(time.perf_counter() - started)
                stop.wait(0.005)

    watcher = threading.Thread(target=ask_healthz, daemon=True)
    before = 0.0

    with httpx.Client(trust_env=False, timeout=120) as http:
        for index in range(calls + 2):  # the first two warm both paths up
            body = {"model": MODEL, "messages": messages, "max_tokens": 64}
            harness = json.dumps(body).encode()
            engine = json.dumps(
                upstream_body(body, kind="chat", model=MODEL, policy=policy)
            ).encode()
            started = time.perf_counter()
            answer = http.post(stub_url + "/chat/completions", content=engine, headers=plain)
            middle = time.perf_counter()
            if index == 2:
                watcher.start()
                before = _cpu(gateway_pids)
            proxied = http.post(proxy_url, content=harness, headers=auth)
            ended = time.perf_counter()
            if answer.status_code != 200 or proxied.status_code != 200:
                raise RuntimeError(f"{answer.status_code} / {proxied.status_code}: {proxied.text}")
            if index >= 2:
                direct.append(middle - started)
                reins.append(ended - middle)
            reply = proxied.json()["choices"][0]["message"]["content"]
            messages = [
                *messages,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"Observation {index}: 1 failed, 41 passed"},
            ]
        cpu_s = _cpu(gateway_pids) - before
        stop.set()
        watcher.join()
    return {
        "bytes": float(len(json.dumps(messages))),
        "direct": statistics.median(direct) * 1e3,
        "reins": statistics.median(reins) * 1e3,
        "cpu": cpu_s / calls * 1e3,
        "healthz_max": max(waits) * 1e3 if waits else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20, help="measured calls per size and path")
    args = parser.parse_args()
    print(
        f"reins long-prompt proxy benchmark: {os.cpu_count()} CPU cores, Python "
        f"{sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S')}"
    )
    print(
        "stub engine: tests/stub_engine.py (tokens = UTF-8 bytes), own process; reins gateway: "
        "own process, SQLite (WAL) in a temp dir; one httpx client, calls alternating"
    )
    with tempfile.TemporaryDirectory(prefix="reins-proxy-long-") as tmp_name:
        tmp = Path(tmp_name)
        stub_port = free_port()
        stub_url = f"http://127.0.0.1:{stub_port}/v1"
        stub = start_stub(stub_port, tmp / "stub.log")
        try:
            _wait_ready(f"{stub_url}/models", stub, tmp / "stub.log", 60, "stub engine")
            with running_gateway(str(tmp / "gateway.db"), API_KEY) as gateway:
                assert gateway.process is not None
                ids, tokens = setup_reins(gateway.url, stub_url, len(SIZES))
                print(
                    f"\n{'context':>9}{'request':>10}{'direct+ids':>12}{'reins':>9}{'added':>9}"
                    f"{'x direct':>10}{'gw CPU/call':>13}{'healthz max':>13}"
                )
                rows = {}
                for size, rollout in zip(SIZES, zip(ids, tokens, strict=True), strict=True):
                    row = measure(
                        size, args.calls, stub_url, gateway.url, rollout, [gateway.process.pid]
                    )
                    rows[size] = row
                    print(
                        f"{size // 1000:>7}k{row['bytes'] / 1e3:>8.0f} KB{row['direct']:>9.1f} ms"
                        f"{row['reins']:>6.1f} ms{row['reins'] - row['direct']:>6.1f} ms"
                        f"{row['reins'] / row['direct']:>9.2f}x{row['cpu']:>10.1f} ms"
                        f"{row['healthz_max']:>10.1f} ms"
                    )
        finally:
            _stop(stub)
    print(
        "\np50 of each path over the measured calls; added = reins - direct+ids; gw CPU/call: the "
        "gateway's and its event writer's CPU over the reins calls; healthz max: the longest "
        "/healthz answer while they ran"
    )
    last = rows[SIZES[-1]]
    print(f"proxy_long_prompt_added_128k: {last['reins'] - last['direct']:.1f} ms")


if __name__ == "__main__":
    main()
