"""Sync vs collocated async training: wall time for the same number of policy updates.

Both runs are the real main-job stack (`reins.trainer.runtime.train`): an in-process gateway on
SQLite, the embedded engine sharing the trainer's weights, the local reconciler running agents as
processes, the torch backend. What is stubbed: the model is a tiny random Llama (2 layers, real
SmolLM2 tokenizer) so updates are fast, and the agent (`sleepy_agent` below) sleeps for a
long-tailed time (Pareto, alpha 1.5, capped at 10x the base), then makes one real LLM call through
the proxy, as agents whose tool calls take a variable time do. The same tasks and the same
per-rollout durations (seeded by rollout id) are used in both modes.

- `sync`: each step declares its groups and waits for the slowest rollout.
- `async` (paper 3.1): groups keep running (up to `max_staleness + 1` steps' worth); each update
  takes the first `tasks_per_step` groups that finished; the gateway is paused and drained around
  the update.

    .venv/bin/python benchmarks/collocated.py           # 6 updates per mode, about 2 minutes
    .venv/bin/python benchmarks/collocated.py --long    # 20 updates per mode

The last line is the headline: `collocated_speedup: VALUE x` (sync wall time / async wall time).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASE_S = 1.0
ALPHA = 1.5
CAP = 10.0


def duration_of(rollout_id: str) -> float:
    """Pareto(alpha) seconds, seeded by the rollout id (the same in both modes)."""
    digest = hashlib.sha256(rollout_id.encode()).digest()
    u = (int.from_bytes(digest[:8], "big") + 1) / 2**64
    return BASE_S * min(u ** (-1 / ALPHA), CAP)


def ask_policy(content: str, max_tokens: int) -> str:
    """One chat call through the proxy (the agent's `OPENAI_*` variables); the answer's text.

    urllib, not httpx: a new httpx client builds an SSL context (55-130 ms of CPU here), which
    dozens of agents in flight on 2 cores would turn into the bottleneck being measured."""
    body = {"model": "policy", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens}  # fmt: skip
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        text: str = json.load(response)["choices"][0]["message"]["content"] or ""
    return text


def sleepy_agent(task: dict[str, Any]) -> float:
    """Sleeps, then one chat call through the proxy; reward from it."""
    # `<run>.t<position>.<task>.<k>`: without the run's name, the same in both modes.
    time.sleep(duration_of(os.environ["REINS_ROLLOUT_ID"].split(".", 1)[1]))
    text = ask_policy(task["word"], max_tokens=3)
    return float(len(text) % 2)


def run_mode(
    mode: str, folder: Path, model: Path, steps: int, stale_groups: str = "drop"
) -> dict[str, float]:
    from reins.trainer.config import TrainConfig
    from reins.trainer.runtime import train

    tasks = folder / "tasks.jsonl"
    if not tasks.exists():
        words = [f"w{i:03d}" for i in range(200)]
        tasks.write_text("".join(json.dumps({"id": w, "input": {"word": w}}) + "\n" for w in words))
    config = TrainConfig(
        run_name=mode,
        runs_dir=folder / "runs",
        tasks=tasks,
        agent="benchmarks.collocated:sleepy_agent",
        model=model,
        mode=mode,  # type: ignore[arg-type]
        steps=steps,
        tasks_per_step=8,
        group_size=4,
        max_staleness=1,
        stale_groups=stale_groups,  # type: ignore[arg-type]
        tis_cap=2.0 if stale_groups == "correct" else None,
        max_parallel=64,
        val_every=0,
        lr=1e-4,
        max_model_len=256,
        checkpoint_every=0,
        keep_checkpoints=1,
        tensorboard=False,
    )
    started = time.perf_counter()
    records = asyncio.run(train(config))
    wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "updates": len(records),
        "step_s": sum(r["time/step"] for r in records) / len(records),
        "update_s": sum(r["time/update"] for r in records) / len(records),
        "stale_groups": sum(r.get("rollouts/stale_groups", 0) for r in records),
        "generated_per_trained": records[-1].get("rollouts/generated_per_trained", float("nan")),
        "mixed_version_sequences": sum(
            r.get("samples/mixed_version_sequences", 0) for r in records
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--long", action="store_true", help="20 updates per mode instead of 6")
    parser.add_argument(
        "--stale-groups",
        choices=["drop", "correct"],
        default="drop",
        help="async: drop stale groups (default) or train them with the correction (tis_cap 2)",
    )
    args = parser.parse_args()
    steps = 20 if args.long else 6
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)  # agents import `benchmarks.collocated` from here
    from tests.trainer.conftest import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="reins-collocated-") as tmp:
        folder = Path(tmp)
        model = make_tiny_model(folder / "tiny-llama")
        results = {
            mode: run_mode(mode, folder, model, steps, args.stale_groups)
            for mode in ("sync", "async")
        }
    load = os.getloadavg()[0]
    print(f"{steps} updates per mode, 8 groups x 4 rollouts per update; load {load:.1f}")
    print(f"async: stale groups {args.stale_groups}")
    print(f"agent durations: Pareto alpha {ALPHA}, base {BASE_S} s, cap {CAP * BASE_S} s")
    header = f"{'mode':6} {'wall s':>8} {'s/update':>9} {'update s':>9} {'stale groups':>13}"
    print(f"{header} {'generated/trained':>18}")
    for mode, result in results.items():
        print(
            f"{mode:6} {result['wall_s']:8.1f} {result['step_s']:9.2f} {result['update_s']:9.2f}"
            f" {result['stale_groups']:13.0f} {result['generated_per_trained']:18.2f}"
        )
    speedup = results["sync"]["wall_s"] / results["async"]["wall_s"]
    step_ratio = results["sync"]["step_s"] / results["async"]["step_s"]
    print(f"per-update time ratio (sync / async): {step_ratio:.2f}x")
    print(f"collocated_speedup: {speedup:.2f} x")


if __name__ == "__main__":
    main()
