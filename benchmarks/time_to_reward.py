"""Sync vs collocated async training: wall time to reach the same validation reward.

Updates per second flatter async: it may train on staler, fewer rollouts for each update. What a
user wants is the wall time to a given validation reward. Each repeat trains the same model from
the same seed on the same tasks twice, in sync and in collocated async (paper 3.1), and reports:

- the wall time at which each run's validation reward first reached the sync run's final one
  (time to reward), and their ratio, async over sync;
- the final validation reward of each (async must not lose reward for its speed);
- rollouts generated per rollout trained (async drops or corrects stale groups), and how many
  groups async gave up before they finished (certain to be too stale to train).

Runs differ by luck (which answers a policy happens to sample first decides what it settles on),
so the benchmark repeats with other seeds and reports the median ratio and its spread.

The default (`--job tiny`, about 15 minutes for 3 repeats) is the real main-job stack
(`reins.trainer.runtime.train`: in-process gateway on SQLite, embedded engine sharing the trainer's
weights, agents as local processes, torch backend) with two things stubbed so that learning takes
minutes on 2 cores: the model is a tiny random Llama (2 layers, hidden 64, the real SmolLM2
tokenizer) and the agent (`vowel_agent`) stands for an agent whose tools take a long-tailed time:
it sleeps a Pareto (alpha 1.5, capped at 10x) time seeded by its rollout id and the repeat, makes
one real call through the proxy, and is rewarded by the share of the answer's letters among
"etaoin" (untrained 0.45). The tiny model's weights are drawn 35x wider than usual (std 0.7) so
that its next-token distributions are peaked (2.3 nats at the first position, not the uniform 10.8)
as a trained model's are: policy-gradient steps then move mass among a few candidates and the
reward rises from 0.45 to 0.6-0.9 in 16 updates of 4 tasks x 8 rollouts (lr 3e-2). Validation (32
held-out words, sampled at temperature 1: the reward the policy gets in expectation) does not
sleep.

`--job recall` is the main job itself (`examples/recall/config.yaml`, SmolLM2-135M, 25 steps,
validation every 5): about 13 minutes per run, so 26 minutes per repeat. `--job search` is the
search example (`examples/search/config.yaml`: 8 questions x 4 rollouts a step, up to 4 calls
each, BM25 searches, exact-match reward; 18 steps with validation every 9 by default, about an
hour per run on 2 cores; `--search-steps 8 --search-val-every 4` for about half that).

    .venv/bin/python benchmarks/time_to_reward.py                       # tiny, 3 repeats
    .venv/bin/python benchmarks/time_to_reward.py --job recall --repeats 2
    .venv/bin/python benchmarks/time_to_reward.py --job search --repeats 1 --search-steps 8 \
        --search-val-every 4
    .venv/bin/python benchmarks/time_to_reward.py --stale-groups correct --tis-cap 2
    .venv/bin/python benchmarks/time_to_reward.py --job recall --entropy-coef 0.01
    .venv/bin/python benchmarks/time_to_reward.py --budget sync-wall

By default async makes as many updates as sync (`--budget updates`), so it stops at about half
sync's wall time on the tiny job and a reward it would have reached in the other half counts as
never reached. `--budget sync-wall` gives async sync's wall time instead: it runs up to 3x the
updates and is cancelled (as Ctrl-C cancels `reins train`) when sync's wall time has passed; its
final reward is then its last validation within that time, the same budget a user who waited
as long as sync would have. Async validates more often in that time (every `--val-every` of its
faster updates), so a noisy validation has more chances to cross the target: compare the finals
too.

Both runs set glibc's allocator as `reins train` does (`malloc_mmap_threshold_mb`). Each repeat
also says where each run's time went: waiting for rollouts, updating (and how many updates moved
the policy: a step whose groups all got equal rewards has no advantage, so its update is a quick
no-op and a run stuck there looks fast), and the rest (validations, start, stop); and how long
sync's steps waited from their median rollout finishing to their last (`time/rollout_tail`),
about what collocated async can save, since the update stops generation in both.

The last line is the headline: `time_to_reward_async_over_sync: VALUE ratio` (median over the
repeats whose sync run ended above its first validation: in the others there is no learning to
time, and the report says so; lower is better, aim <= 0.6).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASE_S = 1.0
ALPHA = 1.5
CAP = 10.0
LETTERS = "etaoin"
TASKS_PER_STEP = 4


def duration_of(key: str) -> float:
    """Pareto(alpha) seconds, seeded by `key` (the same in both modes)."""
    digest = hashlib.sha256(key.encode()).digest()
    u = (int.from_bytes(digest[:8], "big") + 1) / 2**64
    return BASE_S * min(u ** (-1 / ALPHA), CAP)


def letter_share(text: str) -> float:
    letters = [c for c in text if not c.isspace()]
    return sum(c in LETTERS for c in letters) / len(letters) if letters else 0.0


def vowel_agent(task: dict[str, Any]) -> float:
    """Sleeps (training rollouts only), then one chat call through the proxy; reward from it."""
    from benchmarks.collocated import ask_policy  # agents run from the repository's root

    if os.environ["REINS_MODE"] == "train":
        # `<run>.t<position>.<task>.<k>`: without the run's name, the same in both modes.
        rollout = os.environ["REINS_ROLLOUT_ID"].split(".", 1)[1]
        time.sleep(duration_of(f"{task['repeat']}/{rollout}"))
    text = ask_policy(task["word"], max_tokens=4)
    return letter_share(text)


@dataclass
class Run:
    """One training run: its validation curve against wall time, and its rollout counts."""

    mode: str
    wall_s: float
    curve: list[tuple[float, int, float]]
    """(seconds since the run started when the validation finished, step, mean reward)."""
    generated_per_trained: float
    stale_groups: int
    given_up_groups: int = 0
    """Groups given up before they finished, too stale to train (`rollouts/cancelled_groups`)."""
    split: TimeSplit = field(default_factory=lambda: TimeSplit(0.0, 0.0, 0, 0))

    @property
    def final(self) -> float:
        return self.curve[-1][2]

    def cut(self, steps: int) -> Run:
        """This run as if it had stopped after `steps` updates: its validations up to there."""
        curve = [point for point in self.curve if point[1] <= steps]
        return replace(self, curve=curve, wall_s=curve[-1][0] if curve else 0.0)

    def time_to(self, reward: float) -> float:
        """Seconds until a validation first reached `reward` (inf when none did)."""
        return next((t for t, _, value in self.curve if value >= reward - 1e-9), math.inf)


@dataclass(frozen=True)
class TimeSplit:
    """Where a run's steps went: waiting for rollouts, updating; and how many updates moved the
    policy (a step whose groups all got equal rewards has no advantage: its update is a no-op and
    takes a fraction of the time, so a run stuck there looks fast)."""

    rollout_s: float
    update_s: float
    updates: int
    updates_moved: int
    tail_s: float = 0.0
    """Steps' waits from their median rollout finishing to their last (`time/rollout_tail`): in
    sync, about what collocated async can save."""

    @classmethod
    def of(cls, records: list[dict[str, Any]]) -> TimeSplit:
        steps = [r for r in records if "time/step" in r]
        return cls(
            rollout_s=sum(r.get("time/rollout", 0.0) + r.get("time/wait", 0.0) for r in steps),
            update_s=sum(
                r.get("time/build", 0.0) + r.get("time/update", 0.0) + r.get("time/publish", 0.0)
                for r in steps
            ),
            updates=len(steps),
            updates_moved=sum(r.get("policy/optimizer_steps", 0) > 0 for r in steps),
            tail_s=sum(r.get("time/rollout_tail", 0.0) for r in steps),
        )


def validation_curve(
    records: list[dict[str, Any]], started: float
) -> list[tuple[float, int, float]]:
    """A step's validation runs before its rollouts: it finished `time/step` before the step's
    line was written. The final validation's line is written when it finishes."""
    curve = []
    for record in records:
        if "val/reward_mean" not in record:
            continue
        done = record["time"] - record.get("time/step", 0.0)
        curve.append((done - started, int(record["step"]), float(record["val/reward_mean"])))
    return curve


def tiny_config(folder: Path, repeat: int, mode: str, args: argparse.Namespace) -> Any:
    from reins.trainer.config import TrainConfig
    from tests.trainer.conftest import make_tiny_model

    model = folder / f"tiny-llama-{repeat}"
    if not model.exists():
        make_tiny_model(model, seed=repeat, initializer_range=0.7)
    tasks, val_tasks = folder / f"tasks-{repeat}.jsonl", folder / f"val-{repeat}.jsonl"
    # Validation words are every 12th of the training range, held out: words of the same form
    # (`w12`..`w384`), so that what is measured is the policy, not how a random model
    # generalizes from `w0`-`w399` to another range of numbers.
    held_out = range(0, 384, 12)
    train_words = [i for i in range(400) if i not in held_out]
    for path, words in ((tasks, train_words), (val_tasks, held_out)):
        path.write_text(
            "".join(
                json.dumps({"id": f"w{i}", "input": {"word": f"w{i}", "repeat": repeat}}) + "\n"
                for i in words
            )
        )
    return TrainConfig(
        run_name=f"{mode}-{repeat}",
        runs_dir=folder / "runs",
        seed=repeat,
        tasks=tasks,
        val_tasks=val_tasks,
        agent="benchmarks.time_to_reward:vowel_agent",
        model=model,
        mode=mode,  # type: ignore[arg-type]
        steps=args.steps,
        tasks_per_step=TASKS_PER_STEP,
        group_size=args.group_size,
        val_every=args.val_every,
        val_temperature=1.0,
        max_staleness=args.max_staleness,
        stale_groups=args.stale_groups,
        tis_cap=args.tis_cap,
        rollout_mask_ratio=args.mask_ratio,
        old_logprobs=args.old_logprobs,
        entropy_coef=args.entropy_coef,
        # Every group async may keep in flight, and a validation's rollouts beside them.
        max_parallel=TASKS_PER_STEP * args.group_size * (args.max_staleness + 1) + 64,
        lr=args.lr,
        max_model_len=256,
        checkpoint_every=0,
        keep_checkpoints=1,
        tensorboard=False,
    )


def example_config(
    example: str, folder: Path, repeat: int, mode: str, args: argparse.Namespace, *extra: str
) -> Any:
    """`examples/<example>/config.yaml` in `mode`, seeded by the repeat, with `extra` overrides."""
    from reins.trainer.config import load_config

    overrides = [
        f"run_name={example}-{mode}-{repeat}",
        f"runs_dir={folder / 'runs'}",
        f"seed={repeat}",
        f"mode={mode}",
        f"max_staleness={args.max_staleness}",
        f"stale_groups={args.stale_groups}",
        f"old_logprobs={args.old_logprobs}",
        f"entropy_coef={args.entropy_coef}",
        "checkpoint_every=0",
        "tensorboard=false",
        *extra,
    ]
    if args.tis_cap is not None:
        overrides.append(f"tis_cap={args.tis_cap}")
    if args.mask_ratio is not None:
        overrides.append(f"rollout_mask_ratio={args.mask_ratio}")
    return load_config(ROOT / "examples" / example / "config.yaml", overrides)


def recall_config(folder: Path, repeat: int, mode: str, args: argparse.Namespace) -> Any:
    # recall's 2 tasks x 8 rollouts a step, as many ahead for async, 32 validation tasks.
    parallel = 2 * 8 * (args.max_staleness + 1) + 32
    return example_config("recall", folder, repeat, mode, args, f"max_parallel={parallel}")


def search_config(folder: Path, repeat: int, mode: str, args: argparse.Namespace) -> Any:
    # search's 8 tasks x 4 rollouts a step, as many ahead for async (validation's 64 questions
    # queue behind them; in sync they run alone).
    parallel = 8 * 4 * (args.max_staleness + 1)
    return example_config(
        "search",
        folder,
        repeat,
        mode,
        args,
        f"max_parallel={parallel}",
        f"steps={args.search_steps}",
        f"val_every={args.search_val_every}",
    )


def train_once(config: Any, budget_s: float | None = None) -> Run:
    """Trains `config` to its last step, or until `budget_s` seconds of wall time have passed:
    the run is then cancelled as Ctrl-C cancels `reins train`, and only the validations that
    finished within the budget count."""
    from reins.trainer.runtime import train

    async def bounded() -> None:
        if budget_s is None:
            await train(config)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(train(config), budget_s)

    started = time.time()
    asyncio.run(bounded())
    wall = time.time() - started
    metrics = (config.run_dir / "metrics.jsonl").read_text().splitlines()
    lines = [json.loads(line) for line in metrics]
    curve = validation_curve(lines, started)
    if budget_s is not None:
        curve = [point for point in curve if point[0] <= budget_s]
        wall = min(wall, budget_s)
    steps = [line for line in lines if "time/step" in line]
    return Run(
        mode=config.mode,
        wall_s=wall,
        curve=curve,
        generated_per_trained=(steps[-1] if steps else {}).get(
            "rollouts/generated_per_trained", math.nan
        ),
        stale_groups=sum(r.get("rollouts/stale_groups", 0) for r in steps),
        given_up_groups=sum(r.get("rollouts/cancelled_groups", 0) for r in steps),
        split=TimeSplit.of(steps),
    )


def ratio_of(sync: Run, async_: Run) -> float | None:
    """Async's time to sync's final validation reward over sync's; None when sync ended no
    higher than its first validation (the untrained policy's): both runs then "reach" it at
    their first validation and the ratio would time only that, not any learning."""
    if sync.final <= sync.curve[0][2] + 1e-9:
        return None
    sync_s = sync.time_to(sync.final)
    return async_.time_to(sync.final) / sync_s if sync_s > 0 else math.nan


def spread(values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "none reached"
    low, high = min(finite), max(finite)
    missed = len(values) - len(finite)
    return f"{low:.2f}-{high:.2f}" + (f" ({missed} not reached)" if missed else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", choices=["tiny", "recall", "search"], default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--first-repeat", type=int, default=0, help="seed of the first repeat (to add repeats)"
    )
    parser.add_argument("--steps", type=int, default=16, help="tiny job: updates per run")
    parser.add_argument("--val-every", type=int, default=2, help="tiny job")
    parser.add_argument("--group-size", type=int, default=8, help="tiny job")
    parser.add_argument("--lr", type=float, default=3e-2, help="tiny job")
    parser.add_argument("--search-steps", type=int, default=18, help="search job")
    parser.add_argument("--search-val-every", type=int, default=9, help="search job")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--stale-groups", choices=["drop", "correct"], default="drop")
    parser.add_argument("--tis-cap", type=float, default=None)
    parser.add_argument("--mask-ratio", type=float, default=None)
    parser.add_argument(
        "--old-logprobs",
        choices=["recompute", "rollout"],
        default="recompute",
        help="the PPO ratio's denominator (both modes): `rollout` clips against the engine's",
    )
    parser.add_argument(
        "--entropy-coef", type=float, default=0.0, help="the entropy bonus (both modes)"
    )
    parser.add_argument(
        "--budget",
        choices=["updates", "sync-wall"],
        default="updates",
        help="async's run: as many updates as sync's (updates), or as many as fit in sync's "
        "wall time, stopped there (sync-wall): its final reward is then its last validation "
        "within that time",
    )
    parser.add_argument(
        "--keep", type=Path, help="a folder to keep the runs in (metrics, checkpoints) for a look"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)  # agents import `benchmarks.time_to_reward` or `examples.*` from here
    make_config = {"tiny": tiny_config, "recall": recall_config, "search": search_config}[args.job]
    from reins.trainer.runtime import configure_allocator

    rows: list[tuple[int, Run, Run]] = []
    with tempfile.TemporaryDirectory(prefix="reins-time-to-reward-") as tmp:
        folder = args.keep or Path(tmp)
        for repeat in range(args.first_repeat, args.first_repeat + args.repeats):
            configs = [make_config(folder, repeat, mode, args) for mode in ("sync", "async")]
            # As `reins train` sets it (a process-wide setting: ~20 % of update time for memory).
            configure_allocator(configs[0])
            sync = train_once(configs[0])
            if args.budget == "sync-wall":
                # As many updates as fit in sync's wall time: more than async can make in it.
                longer = configs[1].model_copy(update={"steps": configs[1].steps * 3})
                runs = [sync, train_once(longer, budget_s=sync.wall_s)]
            else:
                runs = [sync, train_once(configs[1])]
            rows.append((repeat, runs[0], runs[1]))
            print(f"repeat {repeat}: " + "; ".join(
                f"{r.mode} " + " ".join(f"{t:.0f}s:{v:.3f}" for t, _, v in r.curve) for r in runs
            ), flush=True)  # fmt: skip

    settings = f"stale groups {args.stale_groups}, max staleness {args.max_staleness}"
    if args.tis_cap is not None:
        settings += f", tis cap {args.tis_cap}"
    if args.mask_ratio is not None:
        settings += f", mask ratio {args.mask_ratio}"
    if args.old_logprobs != "recompute":
        settings += f", old logprobs {args.old_logprobs}"
    if args.entropy_coef:
        settings += f", entropy coef {args.entropy_coef} (both modes)"
    load = os.getloadavg()[0]
    budget = {
        "updates": "as many updates as sync",
        "sync-wall": "as many updates as fit in sync's wall time",
    }[args.budget]
    print(f"job {args.job}, {args.repeats} repeats; async: {settings}; {budget}; load {load:.1f}")
    print(
        f"{'repeat':>6} {'target':>7} {'sync s':>7} {'async s':>8} {'ratio':>6}"
        f" {'sync final':>11} {'async final':>12} {'wall sync/async':>16} {'async gen/trained':>18}"
    )
    ratios, final_gaps, flat = [], [], []
    for repeat, sync, async_ in rows:
        target = sync.final
        sync_s, async_s = sync.time_to(target), async_.time_to(target)
        ratio = ratio_of(sync, async_)
        if ratio is None:
            flat.append(repeat)
        else:
            ratios.append(ratio)
        final_gaps.append(async_.final - sync.final)
        shown = "n/a" if ratio is None else f"{ratio:.2f}"
        print(
            f"{repeat:>6} {target:7.3f} {sync_s:7.0f} {async_s:8.0f} {shown:>6}"
            f" {sync.final:11.3f} {async_.final:12.3f}"
            f" {sync.wall_s:7.0f}/{async_.wall_s:<8.0f} {async_.generated_per_trained:18.2f}"
        )
    if flat:
        print(
            f"repeats {', '.join(map(str, flat))}: sync ended no higher than its first "
            "validation, so there is no time to reward to compare (left out of the ratio; "
            "compare their final rewards and wall times)"
        )
    print("where the time went (rollouts: waiting for them; the rest: validations, start, stop):")
    for repeat, sync, async_ in rows:
        print(f"  repeat {repeat}: " + "; ".join(
            f"{r.mode} {r.split.rollout_s:.0f}s rollouts + {r.split.update_s:.0f}s updates"
            f" ({r.split.updates_moved}/{r.split.updates} moved the policy)"
            f" + {r.wall_s - r.split.rollout_s - r.split.update_s:.0f}s rest"
            for r in (sync, async_)
        ))  # fmt: skip
        print(f"    async dropped {async_.stale_groups} stale groups it had taken and gave up "
              f"{async_.given_up_groups} before they finished")  # fmt: skip
        tail = sync.split.tail_s
        print(f"    sync waited {tail:.0f}s ({tail / sync.wall_s:.1%} of its wall time) from its "
              "steps' median rollout to their last: about what async can save")  # fmt: skip
    if args.budget == "sync-wall":
        # The same async runs read as the `updates` budget reads them: one run, both measures.
        cut = [(sync, async_.cut(sync.split.updates)) for _, sync, async_ in rows]
        found = [r for r in (ratio_of(sync, a) for sync, a in cut) if r is not None]
        print(
            "the same async runs after sync's number of updates (`--budget updates`): ratios "
            + ", ".join(f"{r:.2f}" for r in found)
            + f" (median {statistics.median(found) if found else math.nan:.2f}); final reward, "
            "async minus sync: " + ", ".join(f"{a.final - sync.final:+.3f}" for sync, a in cut)
        )
    median = statistics.median(ratios) if ratios else math.nan
    print(f"ratio spread over repeats: {spread(ratios) if ratios else 'n/a'}")
    print(f"final reward, async minus sync: median {statistics.median(final_gaps):+.3f}, "
          f"range {min(final_gaps):+.3f} to {max(final_gaps):+.3f}")  # fmt: skip
    print(f"time_to_reward_async_over_sync: {median:.2f} ratio")


if __name__ == "__main__":
    main()
