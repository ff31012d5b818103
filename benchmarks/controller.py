"""Rollout Controller with `LocalReconciler`, against a real `reins gateway` process.

Measures, on this machine:

- `throughput`: N rollouts (default 200) with trivial agents, P at a time: wall time and
  rollouts/s, for a shell-command agent (`exit 0`) and a `module:function` agent that returns a
  reward (one fresh interpreter per attempt, plus the reward post);
- `latency`: from a rollout's creation at the gateway to its agent's first instruction, for
  single rollouts declared while the controller idles (the poll interval shows here) and for a
  burst of P rollouts declared at once;
- `idle`: CPU the controller process and the gateway use while nothing is queued.

    .venv/bin/python benchmarks/controller.py            # about a minute
    .venv/bin/python benchmarks/controller.py --rollouts 500 --parallel 16

The last line is the headline: `controller_rollouts_per_s_module_P: VALUE`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reins.client import GatewayClient  # noqa: E402
from reins.controller import Controller, LocalReconciler  # noqa: E402
from reins.schemas import TERMINAL_STATES, RolloutConfig, RolloutSpec  # noqa: E402
from tests.support import running_gateway  # noqa: E402

AGENT_MODULE = """\
import os, time
def solve(task):
    with open(os.path.join(task["stamps"], os.environ["REINS_ROLLOUT_ID"]), "w") as f:
        f.write(repr(time.time()))
    return 1.0
"""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


async def wait_all(client: GatewayClient, ids: set[str]) -> None:
    cursor = 0
    done: set[str] = set()
    while done < ids:
        page = await client.list_rollouts(states=list(TERMINAL_STATES), cursor=cursor, limit=1000)
        done.update(r.rollout_id for r in page.items if r.rollout_id in ids)
        cursor = page.next_cursor
        if not page.items:
            await asyncio.sleep(0.05)


async def run(args: argparse.Namespace) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="reins-bench-ctl-"))
    (work / "bench_agent.py").write_text(AGENT_MODULE)
    stamps = work / "stamps"
    stamps.mkdir()
    results: dict[str, float] = {}
    with running_gateway(str(work / "gateway.db"), api_key="bench") as gateway:
        async with GatewayClient(gateway.url, "bench") as client:
            reconciler = LocalReconciler(
                "bench_agent:solve", args.parallel, work / "logs", workdir=work
            )
            controller = Controller(client, reconciler, gateway_url=gateway.url)
            assert gateway.process is not None
            gateway_pid = gateway.process.pid
            stop = asyncio.Event()
            task = asyncio.create_task(controller.run(stop))
            serial = 0

            def specs(count: int, agent: str | None = None) -> list[RolloutSpec]:
                nonlocal serial
                out = []
                for _ in range(count):
                    serial += 1
                    out.append(
                        RolloutSpec(
                            rollout_id=f"b-{serial}",
                            input={"stamps": str(stamps)},
                            config=RolloutConfig(agent=agent),
                        )
                    )
                return out

            # Throughput, one kind of agent at a time.
            for label, agent in (("command", "exit 0"), ("module", None)):
                batch = specs(args.rollouts, agent)
                started = time.monotonic()
                gateway_cpu, my_cpu = cpu_seconds(gateway_pid), time.process_time()
                await client.create_rollouts(batch)
                await wait_all(client, {s.rollout_id for s in batch if s.rollout_id})
                wall = time.monotonic() - started
                gateway_cpu = cpu_seconds(gateway_pid) - gateway_cpu
                my_cpu = time.process_time() - my_cpu
                results[f"wall_s_{label}"] = wall
                results[f"rollouts_per_s_{label}"] = args.rollouts / wall
                print(f"throughput {label:8s} {args.rollouts} rollouts, {args.parallel} at a time:"
                      f" {wall:6.1f} s, {args.rollouts / wall:6.1f} rollouts/s; CPU per rollout:"
                      f" controller {1000 * my_cpu / args.rollouts:.0f} ms, gateway "
                      f"{1000 * gateway_cpu / args.rollouts:.0f} ms")  # fmt: skip

            # Latency to the agent's first instruction.
            def latencies(batch: list[RolloutSpec], created: dict[str, float]) -> list[float]:
                return [
                    float((stamps / str(s.rollout_id)).read_text()) - created[str(s.rollout_id)]
                    for s in batch
                ]

            singles: list[float] = []
            for _ in range(args.singles):
                (one,) = specs(1)
                (made,) = await client.create_rollouts([one])
                await wait_all(client, {str(one.rollout_id)})
                singles += latencies([one], {made.rollout_id: made.created_at.timestamp()})
                await asyncio.sleep(0.3)
            burst = specs(args.parallel)
            made_burst = await client.create_rollouts(burst)
            await wait_all(client, {str(s.rollout_id) for s in burst})
            bursts = latencies(burst, {r.rollout_id: r.created_at.timestamp() for r in made_burst})
            for name, values in (("single", singles), ("burst", bursts)):
                results[f"latency_p50_s_{name}"] = statistics.median(values)
                results[f"latency_max_s_{name}"] = max(values)
                print(f"latency  {name:8s} creation -> agent running: median "
                      f"{statistics.median(values):.3f} s, max {max(values):.3f} s "
                      f"({len(values)} rollouts)")  # fmt: skip

            # Idle cost.
            gateway_before = cpu_seconds(gateway_pid)
            mine_before = time.process_time()
            await asyncio.sleep(args.idle_s)
            mine = (time.process_time() - mine_before) / args.idle_s
            theirs = (cpu_seconds(gateway_pid) - gateway_before) / args.idle_s
            results["idle_cpu_controller"] = mine
            results["idle_cpu_gateway"] = theirs
            print(f"idle     {args.idle_s:.0f} s: controller {100 * mine:.1f}% of a core, "
                  f"gateway {100 * theirs:.1f}% of a core (poll every "
                  f"{controller.poll_interval_s} s)")  # fmt: skip
            stop.set()
            await task
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--singles", type=int, default=10)
    parser.add_argument("--idle-s", type=float, default=10.0)
    args = parser.parse_args()
    results = asyncio.run(run(args))
    print(json.dumps({k: round(v, 4) for k, v in results.items()}))
    print(f"controller_rollouts_per_s_module_{args.parallel}: "
          f"{results['rollouts_per_s_module']:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
