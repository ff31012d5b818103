"""`reins swe prepare`: from SWE-smith task instances to a train and a test task file.

The paper's pipeline (section 4.3.1), each stage counted and written to `report.json`:

1. the static filters (`reins.swe.instances.static_filter`): an empty problem statement, a
   problem branch missing from its repository, more than `max_tests` tests;
2. the difficulty filter: the current policy attempts every remaining task `attempts` times
   (4 in the paper) through reins, as `val` rollouts of the policy's own config (its agent, its
   engine) sampled at `temperature`; tasks solved every time are dropped, tasks with mixed
   outcomes kept, and a sample of `all_failed_sample` of the never-solved ones added back (the
   paper: 1,000) so that the set is not made only of tasks the model half-knows;
3. a seeded split into `test_size` test tasks and the rest for training.

The task files are in reins' task format; a task's input holds the instance (without its
`patch`, the bug's diff, whose reverse is the fix) and where its repository is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reins.swe.instances import (
    MAX_TESTS,
    Instance,
    RepoSource,
    load_instances,
    load_repos,
    static_filter,
)
from reins.trainer.config import ConfigError, read_config_file, validation_problems
from reins.trainer.loop import fitted_id


class PrepareError(ValueError):
    """The prepare config, or what it names, cannot be used; the message says why."""


class PrepareConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instances: Path
    """A .jsonl/.json file of instances, or a folder of them."""
    repos: Path
    """The repositories file (`reins.swe.instances.load_repos`)."""
    out: Path
    """Where train.jsonl, test.jsonl and report.json are written."""
    max_tests: int = Field(default=MAX_TESTS, ge=1)
    policy: Path | None = None
    """A training config (`reins train`'s): the policy, its agent and services, for the
    difficulty filter. None: no difficulty filter (every task the static filters keep)."""
    run_name: str = "swe-prepare"
    """The difficulty rollouts' run (its folder under the policy's runs_dir). Re-running with
    the same name reuses the rollouts that already finished (an interrupted run goes on); after
    the policy changed, use another name or remove that folder."""
    attempts: int = Field(default=4, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    all_failed_sample: int = Field(default=1000, ge=0)
    test_size: int = Field(default=400, ge=0)
    seed: int = 0
    limit: int | None = Field(default=None, ge=1)
    """Keep only the first `limit` tasks the static filters leave (a quick trial run)."""


def load_prepare_config(path: Path, overrides: list[str] | None = None) -> PrepareConfig:
    """The YAML file at `path`, its relative paths read from its folder; `key=value` overrides."""
    try:
        data = read_config_file(path, ("instances", "repos", "out", "policy"), overrides)
        return PrepareConfig.model_validate(data)
    except ConfigError as error:
        raise PrepareError(str(error)) from error
    except ValidationError as error:
        raise PrepareError(f"invalid prepare config: {validation_problems(error)}") from error


def task_input(instance: Instance, repo: RepoSource) -> dict[str, Any]:
    """What the agent receives: the instance without its `patch`, and its repository."""
    fields = {key: value for key, value in instance.fields.items() if key != "patch"}
    return {
        "instance": fields,
        "repo_source": {
            "source": str(repo.source),
            "test_command": repo.test_command,
            "test_paths": list(repo.test_paths),
        },
    }


@dataclass
class Difficulty:
    attempts: int
    rewards: dict[str, list[float]] = field(default_factory=dict)
    """instance id -> the reward of each attempt (0 for an attempt that failed to run)."""
    failed_rollouts: int = 0
    seconds: float = 0.0

    def solved(self, instance_id: str) -> int:
        return sum(reward >= 1.0 for reward in self.rewards[instance_id])


def _rollout_id(config: PrepareConfig, instance: Instance, k: int) -> str:
    """Attempt `k`'s rollout id, within the gateway's length (a long instance id is cut and
    a digest of it put in its place, as the trainer does)."""
    return fitted_id(f"{config.run_name}.", instance.instance_id, f".{k}")


async def attempt_with_policy(
    policy: Path,
    tasks: list[tuple[Instance, RepoSource]],
    config: PrepareConfig,
    progress: Callable[[int, int], None] | None = None,
) -> Difficulty:
    """Every task `config.attempts` times as `val` rollouts of the policy's config."""
    from reins.recordbatch import record_of
    from reins.samples.records import MissingRewardError
    from reins.schemas import RolloutConfig, RolloutSpec
    from reins.trainer.config import load_config
    from reins.trainer.loop import CompletionWatch
    from reins.trainer.services import policy_services

    try:
        train = load_config(
            policy, [f"run_name={config.run_name}", f"val_temperature={config.temperature}"]
        )
    except ConfigError as error:
        raise PrepareError(f"the policy config {policy}: {error}") from error
    started = time.monotonic()
    result = Difficulty(config.attempts)
    async with policy_services(train) as services:
        client = services.client
        specs = [
            RolloutSpec(
                rollout_id=_rollout_id(config, instance, k),
                group_id=fitted_id(f"{config.run_name}.", instance.instance_id),
                input=task_input(instance, repo),
                mode="val",
                metadata={
                    "run": config.run_name,
                    "task": instance.instance_id,
                    "purpose": "difficulty",
                },
                config=RolloutConfig(
                    timeout_s=train.rollout_timeout_s, max_attempts=train.max_attempts
                ),
            )
            for instance, repo in tasks
            for k in range(config.attempts)
        ]
        for start in range(0, len(specs), 500):
            await client.create_rollouts(specs[start : start + 500])
        wanted = {spec.rollout_id for spec in specs if spec.rollout_id is not None}
        watch = CompletionWatch(client)
        watch.start()
        try:
            while True:
                done = wanted & watch.finished.keys()
                if progress is not None:
                    progress(len(done), len(wanted))
                if len(done) == len(wanted):
                    break
                await watch.changed(timeout_s=2.0)
        finally:
            await watch.stop()
        succeeded = [
            rid for rid in sorted(wanted) if watch.finished[rid].status.state == "succeeded"
        ]
        rewards: dict[str, float] = {}
        for start in range(0, len(succeeded), 256):
            chunk = succeeded[start : start + 256]
            for rollout_id, decoded in zip(chunk, await client.get_records(chunk), strict=True):
                # An agent that exited 0 without a reward gave no verdict: counted as failed
                # to run (and so seen when most did), not as a 0 the filter trusts.
                with contextlib.suppress(MissingRewardError):
                    rewards[rollout_id] = record_of(decoded).reward
    for instance, _ in tasks:
        ids = [_rollout_id(config, instance, k) for k in range(config.attempts)]
        result.rewards[instance.instance_id] = [rewards.get(rid, 0.0) for rid in ids]
        result.failed_rollouts += sum(rid not in rewards for rid in ids)
    result.seconds = time.monotonic() - started
    return result


@dataclass
class Prepared:
    train: list[str]
    test: list[str]
    report: dict[str, Any]


def select(
    kept: list[Instance], difficulty: Difficulty | None, config: PrepareConfig
) -> tuple[list[Instance], dict[str, Any], dict[str, str]]:
    """The difficulty filter's choice: mixed outcomes, plus a seeded sample of never-solved."""
    if difficulty is None:
        return kept, {"skipped": "no policy given"}, {}
    rng = random.Random(config.seed)
    solved_all, mixed, failed_all = [], [], []
    for instance in kept:
        solved = difficulty.solved(instance.instance_id)
        if solved == config.attempts:
            solved_all.append(instance)
        elif solved == 0:
            failed_all.append(instance)
        else:
            mixed.append(instance)
    sample = rng.sample(failed_all, min(config.all_failed_sample, len(failed_all)))
    chosen = {i.instance_id for i in mixed + sample}
    dropped = {i.instance_id: f"solved {config.attempts}/{config.attempts}" for i in solved_all}
    dropped |= {
        i.instance_id: f"never solved, not in the sample of {config.all_failed_sample}"
        for i in failed_all
        if i.instance_id not in chosen
    }
    summary = {
        "attempts": config.attempts,
        "temperature": config.temperature,
        "solved_every_time": len(solved_all),
        "mixed": len(mixed),
        "never_solved": len(failed_all),
        "never_solved_sampled": len(sample),
        "rollouts": sum(len(r) for r in difficulty.rewards.values()),
        "rollouts_failed_to_run": difficulty.failed_rollouts,
        "seconds": round(difficulty.seconds, 1),
        "solved_counts": {i.instance_id: difficulty.solved(i.instance_id) for i in kept},
    }
    return [i for i in kept if i.instance_id in chosen], summary, dropped


def prepare(
    config: PrepareConfig,
    *,
    say: Callable[[str], None] = print,
    progress: Callable[[int, int], None] | None = None,
    attempt: Callable[[list[tuple[Instance, RepoSource]]], Difficulty] | None = None,
) -> Prepared:
    """Runs the pipeline and writes `config.out`. `attempt` replaces the policy's rollouts
    (tests give a scripted one); by default they run through `config.policy`."""
    instances = load_instances(config.instances)
    repos = load_repos(config.repos)
    filtered = static_filter(instances, repos, max_tests=config.max_tests)
    for stage in filtered.stages:
        note = f" (-{stage.dropped:,})" if stage.dropped else ""
        say(f"{stage.name:>24}: {stage.kept:>8,}{note}")
    if config.limit is not None and len(filtered.kept) > config.limit:
        say(f"{'limit':>24}: {config.limit:>8,} (-{len(filtered.kept) - config.limit:,})")
        filtered.kept = filtered.kept[: config.limit]
    tasks = [(i, repos[i.repo]) for i in filtered.kept]
    difficulty = None
    if attempt is not None:
        difficulty = attempt(tasks)
    elif config.policy is not None and tasks:
        say(f"difficulty filter: {len(tasks):,} tasks x {config.attempts} attempts")
        difficulty = asyncio.run(attempt_with_policy(config.policy, tasks, config, progress))
    chosen, summary, dropped = select(filtered.kept, difficulty, config)
    dropped = {**filtered.dropped, **dropped}
    if difficulty is not None:
        failed = difficulty.failed_rollouts
        total = summary["rollouts"]
        if total and failed * 2 > total:
            raise PrepareError(
                f"{failed} of {total} difficulty rollouts failed to run or ended without a "
                f"reward (not a reward of 0: no reward at all); see the agents' logs under the "
                "policy's run folder before "
                "trusting a filter built on them"
            )
        say(
            f"{'difficulty':>24}: {len(chosen):>8,} (solved every time: "
            f"-{summary['solved_every_time']:,}; mixed: {summary['mixed']:,}; never solved: "
            f"{summary['never_solved']:,}, {summary['never_solved_sampled']:,} sampled)"
        )
    order = sorted(chosen, key=lambda i: i.instance_id)
    random.Random(config.seed).shuffle(order)
    test, train = order[: config.test_size], order[config.test_size :]
    say(f"{'split':>24}: {len(train):>8,} train + {len(test):,} test")
    if not train:  # it wrote empty files and exited 0
        raise PrepareError(
            f"no task is left to train on: {len(order)} passed the filters and test_size takes "
            f"{config.test_size}; check the instances and repos, or lower test_size"
        )
    config.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", train), ("test", test)):
        with (config.out / f"{name}.jsonl").open("w") as out:
            for instance in part:
                record = {
                    "id": instance.instance_id,
                    "input": task_input(instance, repos[instance.repo]),
                }
                out.write(json.dumps(record) + "\n")
    report = {
        "instances": str(config.instances),
        "stages": [asdict(stage) for stage in filtered.stages],
        "difficulty": summary,
        "split": {"train": len(train), "test": len(test), "seed": config.seed},
        "dropped": dropped,
    }
    (config.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    say(f"wrote {config.out / 'train.jsonl'}, {config.out / 'test.jsonl'} and report.json")
    return Prepared([i.instance_id for i in train], [i.instance_id for i in test], report)
