"""`reins swe prepare`: the paper's pipeline on the shipped task set. The selection and the
files on a known outcome table; the whole command through real services (gateway, embedded
engine, local controller) with an agent of known solve rates (tests/swe/oracle.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reins.swe.instances import Instance, RepoSource, static_filter
from reins.swe.prepare import (
    Difficulty,
    PrepareConfig,
    PrepareError,
    load_prepare_config,
    prepare,
)
from tests.swe.conftest import DATA, ROOT, needs_sandbox
from tests.swe.oracle import rule

EXAMPLE = ROOT / "examples" / "swe"


def config(tmp_path: Path, **fields: object) -> PrepareConfig:
    base = {"instances": DATA / "instances.jsonl", "repos": DATA / "repos.json",
            "out": tmp_path / "out", "test_size": 2, "all_failed_sample": 3,
            "attempts": 4}  # fmt: skip
    return PrepareConfig.model_validate({**base, **fields})


def known_outcomes(
    shipped: tuple[list[Instance], dict[str, RepoSource]],
) -> tuple[list[Instance], Difficulty]:
    instances, repos = shipped
    kept = static_filter(instances, repos).kept
    table = {"always": [1.0] * 4, "even attempts": [1.0, 0.0, 1.0, 0.0], "never": [0.0] * 4}
    difficulty = Difficulty(4, {i.instance_id: table[rule(i.instance_id)] for i in kept})
    return kept, difficulty


def test_the_difficulty_filter_keeps_mixed_drops_solved_and_samples_never_solved(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path
) -> None:
    kept, difficulty = known_outcomes(shipped)
    rules = [rule(i.instance_id) for i in kept]
    said: list[str] = []
    result = prepare(config(tmp_path), say=said.append, attempt=lambda tasks: difficulty)
    summary = result.report["difficulty"]
    assert (summary["solved_every_time"], summary["mixed"], summary["never_solved"]) == (
        rules.count("always"), rules.count("even attempts"), rules.count("never")
    )  # fmt: skip
    assert summary["never_solved_sampled"] == 3
    chosen = set(result.train) | set(result.test)
    assert len(chosen) == rules.count("even attempts") + 3 and len(result.test) == 2
    assert not set(result.train) & set(result.test)
    for instance in kept:
        how = rule(instance.instance_id)
        if how == "always":
            assert instance.instance_id not in chosen
            assert result.report["dropped"][instance.instance_id] == "solved 4/4"
        elif how == "even attempts":
            assert instance.instance_id in chosen
    # The files: reins tasks whose input is the instance without its patch, and its repository.
    lines = (tmp_path / "out" / "train.jsonl").read_text().splitlines()
    tasks = [json.loads(line) for line in lines]
    assert [t["id"] for t in tasks] == result.train
    assert all("patch" not in t["input"]["instance"] for t in tasks)
    assert tasks[0]["input"]["repo_source"]["source"] == str(DATA / "minilib.bundle")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [s["kept"] for s in report["stages"]] == [28, 24, 24, 21, 19]
    assert said[:5] == [
        "                  loaded:       28",
        "       problem statement:       24 (-4)",
        "     a FAIL_TO_PASS test:       24",
        "          problem branch:       21 (-3)",
        "       at most 200 tests:       19 (-2)",
    ]
    # Same seed, same sample and split; another seed, another sample of the never-solved.
    again = prepare(config(tmp_path), say=said.append, attempt=lambda tasks: difficulty)
    assert (again.train, again.test) == (result.train, result.test)
    other = prepare(config(tmp_path, seed=1), say=said.append, attempt=lambda tasks: difficulty)
    mixed = {i.instance_id for i in kept if rule(i.instance_id) == "even attempts"}
    assert mixed <= set(other.train) | set(other.test) and len(other.test) == 2
    assert set(other.train) | set(other.test) != chosen


def test_without_a_policy_every_task_the_static_filters_keep_is_split(tmp_path: Path) -> None:
    result = prepare(config(tmp_path, test_size=4), say=lambda line: None)
    assert (len(result.train), len(result.test)) == (15, 4)
    assert result.report["difficulty"] == {"skipped": "no policy given"}


def test_a_split_that_leaves_nothing_to_train_on_is_refused(tmp_path: Path) -> None:
    """It wrote empty files and exited 0."""
    with pytest.raises(PrepareError, match="no task is left to train on: 19 passed the filters"):
        prepare(config(tmp_path, test_size=100_000), say=lambda line: None)
    assert not (tmp_path / "out" / "train.jsonl").exists()


def test_rollouts_that_failed_to_run_are_no_verdict(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path
) -> None:
    _, difficulty = known_outcomes(shipped)
    difficulty.failed_rollouts = 40  # of 76
    with pytest.raises(PrepareError, match="40 of 76 difficulty rollouts failed to run"):
        prepare(config(tmp_path), say=lambda line: None, attempt=lambda tasks: difficulty)


def test_the_shipped_prepare_config_reads_with_paths_beside_it() -> None:
    loaded = load_prepare_config(EXAMPLE / "prepare.yaml", ["attempts=2"])
    assert loaded.instances == EXAMPLE / "data" / "instances.jsonl"
    assert loaded.policy == EXAMPLE / "config.yaml"
    assert (loaded.attempts, loaded.test_size, loaded.all_failed_sample) == (2, 4, 1000)
    with pytest.raises(PrepareError, match="attempts: Input should be greater than or equal to 1"):
        load_prepare_config(EXAMPLE / "prepare.yaml", ["attempts=0"])


@pytest.mark.slow
def test_prepare_rolls_out_the_policy_through_real_services(tmp_path: Path) -> None:
    """The command as a user runs it, with a policy config whose agent has known solve rates:
    the gateway, the embedded engine on the default model and the local controller start, every
    task is attempted `attempts` times as `val` rollouts, and the outcomes drive the filter."""
    needs_sandbox()
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "run_name: unused\ntasks: unused.jsonl\nagent: tests.swe.oracle:run\n"
        f"runs_dir: {tmp_path / 'runs'}\nmax_parallel: 6\nrollout_timeout_s: 120\n"
    )
    prepared = config(
        tmp_path, policy=policy, limit=6, attempts=2, all_failed_sample=1, test_size=1
    )
    result = prepare(prepared, say=lambda line: None)
    summary = result.report["difficulty"]
    rules = [rule(i) for i in summary["solved_counts"]]
    assert len(rules) == 6 and summary["rollouts"] == 12 and summary["rollouts_failed_to_run"] == 0
    expected = {"always": 2, "even attempts": 1, "never": 0}
    assert summary["solved_counts"] == {i: expected[rule(i)] for i in summary["solved_counts"]}
    assert summary["mixed"] == rules.count("even attempts")
    assert len(result.train) + len(result.test) == rules.count("even attempts") + 1
    assert (tmp_path / "runs" / "swe-prepare" / "gateway.db").is_file()


def test_difficulty_rollout_ids_fit_the_gateways_ids_for_a_long_instance_id(
    tmp_path: Path,
) -> None:
    """`run_name.instance_id.k` was sent as is: an instance id of 200 characters made every
    rollout declare fail with the gateway's validation error, after the policy had loaded."""
    from reins.schemas import RolloutSpec
    from reins.swe.prepare import _rollout_id

    instance = Instance("x" * 200, "r", "", ("t",), (), {})
    ids = [_rollout_id(config(tmp_path), instance, k) for k in range(3)]
    assert [RolloutSpec(rollout_id=rid, input={}).rollout_id for rid in ids] == ids
    assert len(set(ids)) == 3


@pytest.mark.slow
def test_rollouts_that_end_without_a_reward_are_no_verdict(tmp_path: Path) -> None:
    """An agent that exited 0 without reporting a reward was read as a reward of 0, so a
    policy whose agent never reported built a filter of "never solved" tasks, silently."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "run_name: unused\ntasks: unused.jsonl\nagent: tests.swe.silent_agent:run\n"
        f"runs_dir: {tmp_path / 'runs'}\nmax_parallel: 2\nrollout_timeout_s: 60\n"
    )
    prepared = config(tmp_path, policy=policy, limit=2, attempts=1, test_size=1)
    with pytest.raises(PrepareError, match="2 of 2 difficulty rollouts failed to run or ended"):
        prepare(prepared, say=lambda line: None)


def test_the_help_of_prepare_names_its_set_option_as_train_does() -> None:
    """`reins swe prepare --help` showed `--set <list[str]>` (typer writes an option's Python
    type when it has no metavar); `reins train`'s `--set` says `KEY=VALUE`."""
    from typer.testing import CliRunner

    from reins.cli import app

    shown = CliRunner().invoke(app, ["swe", "prepare", "--help"], terminal_width=100)
    assert shown.exit_code == 0, shown.output
    assert "--set KEY=VALUE" in shown.output
    assert "list[" not in shown.output
