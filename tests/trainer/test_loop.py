"""The main job's loop end to end on real parts, with a tiny random model for speed: an
in-process gateway on SQLite, the embedded engine sharing the trainer's weights, the local
reconciler running real `openai`-SDK agents as processes, the torch backend."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import sqlite3
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reins.trainer import checkpoint
from reins.trainer.config import TrainConfig
from reins.trainer.data import TaskStream, load_tasks
from reins.trainer.loop import AgentCannotRun
from reins.trainer.runtime import train

pytestmark = pytest.mark.slow


def tasks_file(folder: Path, name: str, words: list[str], crash: set[str] = frozenset()) -> Path:
    path = folder / name
    lines = [{"id": w, "input": {"word": w, "crash": w in crash}} for w in words]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def config(tmp_path: Path, model: Path, **fields: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "run_name": "t",
        "runs_dir": tmp_path / "runs",
        "tasks": tasks_file(tmp_path, "train.jsonl", ["ant", "bee", "cat", "dog", "eel", "fox"]),
        "val_tasks": tasks_file(tmp_path, "val.jsonl", ["gnu", "hen"]),
        "agent": "tests.trainer.agents:two_calls",
        "model": model,
        "steps": 2,
        "tasks_per_step": 2,
        "group_size": 2,
        "val_every": 1,
        "lr": 1e-3,
        "max_model_len": 256,
        "rollout_timeout_s": 120,
        "tensorboard": False,
    }
    return TrainConfig.model_validate({**base, **fields})


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sync_run_updates_publishes_and_checkpoints(tmp_path: Path, tiny_model_dir: Path) -> None:
    run = config(tmp_path, tiny_model_dir, checkpoint_every=1)
    serving: list[int] = []  # metrics lines written when the trainer says it serves

    def on_serving() -> None:
        log = run.run_dir / "metrics.jsonl"
        serving.append(len(log.read_text().splitlines()) if log.exists() else 0)

    records = asyncio.run(train(run, on_serving=on_serving))
    assert serving == [0]
    assert [r["step"] for r in records] == [0, 1]
    lines = metrics(run.run_dir)
    assert [line["step"] for line in lines] == [0, 1, 2]  # the last line: final validation
    for record in records:
        assert record["rollouts/trained"] == 4
        assert record["samples/per_rollout"] >= 1
        for key in ("reward/mean", "time/rollout", "time/update"):
            assert key in record
        # Entropy is measured on the sequences the update ran: none when every group's rewards
        # were equal (all advantages 0, all skipped), as the tiny random model's may be.
        ran = record["samples/zero_advantage_skipped"] < record["samples/sequences"]
        assert ("policy/entropy" in record) == ran
    assert [r["weight_version"] for r in records] == [1, 2]
    assert "val/reward_mean" in lines[0] and "val/reward_mean" in lines[2]
    assert (run.run_dir / "checkpoints" / "step-000002" / "trainer.json").exists()


def test_a_resumed_run_goes_on_from_its_checkpoint(tmp_path: Path, tiny_model_dir: Path) -> None:
    first = config(tmp_path, tiny_model_dir, steps=1, val_every=0)
    asyncio.run(train(first))
    longer = config(tmp_path, tiny_model_dir, steps=2, val_every=0)
    with pytest.raises(FileExistsError):
        asyncio.run(train(longer))
    saved = checkpoint.read_state(checkpoint.latest(first.run_dir) or first.run_dir)
    assert saved.stream == TaskStream(load_tasks(first.tasks), first.seed).identity()
    records = asyncio.run(train(longer, resume=True))
    assert [r["step"] for r in records] == [1]
    assert records[0]["weight_version"] == 2  # the version went on from the checkpoint
    assert [line["step"] for line in metrics(longer.run_dir)] == [0, 1]


def test_an_async_run_resumed_in_sync_mode_trains_the_groups_it_left_first(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Async keeps groups declared ahead (`max_staleness` 1): its checkpoint names them, and a
    sync incarnation trained fresh tasks and lost them."""
    first = config(
        tmp_path, tiny_model_dir, mode="async", steps=2, val_every=0, max_staleness=1,
        checkpoint_every=1, keep_checkpoints=2,
    )  # fmt: skip
    asyncio.run(train(first))
    after_first, last = checkpoint.saved(first.run_dir / "checkpoints")[-2:]
    shutil.rmtree(last)  # as if the run had died before its last checkpoint
    pending = checkpoint.read_state(after_first).pending
    assert len(pending) == 2, "async declared step 1's groups during step 0"
    resumed = config(tmp_path, tiny_model_dir, mode="sync", steps=2, val_every=0)
    (record,) = asyncio.run(train(resumed, resume=True))
    trained = sorted(int(group.split(".t")[1][:7]) for group in record["rollouts/groups"])
    assert trained == pending
    assert checkpoint.read_state(checkpoint.latest(resumed.run_dir) or tmp_path).pending == []


def test_a_group_with_a_crashing_rollout_is_dropped_and_counted(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run = config(
        tmp_path,
        tiny_model_dir,
        tasks=tasks_file(tmp_path, "crashy.jsonl", ["ant", "bee"], crash={"bee"}),
        steps=1,
        val_every=0,
        max_attempts=2,
    )
    (record,) = asyncio.run(train(run))
    assert record["rollouts/failed"] == 2
    assert record["rollouts/dropped_groups"] == 1
    assert record["rollouts/trained"] == 2


def test_rollouts_that_made_no_call_are_not_counted_as_trained(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    tasks = tmp_path / "silent.jsonl"
    lines = [{"id": "ant", "input": {"word": "ant", "silent": True}}]
    lines.append({"id": "bee", "input": {"word": "bee"}})
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = config(tmp_path, tiny_model_dir, tasks=tasks, steps=1, val_every=0)
    (record,) = asyncio.run(train(run))
    assert record["rollouts/trained"] == 2
    assert record["rollouts/generated_per_trained"] == 2.0
    assert record["samples/empty_rollouts"] == 2


@pytest.mark.parametrize("val_every", [0, 1], ids=["in-training", "in-validation"])
def test_an_agent_that_cannot_run_stops_the_run_at_its_first_rollouts(
    tmp_path: Path, tiny_model_dir: Path, val_every: int
) -> None:
    """A mistyped command line failed every rollout of every step, and the run went through all
    its steps, training on nothing, and ended as if it had worked."""
    run = config(tmp_path, tiny_model_dir, agent="pyhton -m no_agent", steps=3, max_attempts=1)
    run = run.model_copy(update={"val_every": val_every})
    with pytest.raises(AgentCannotRun) as stopped:
        asyncio.run(train(run))
    message = str(stopped.value)
    failed = 2 if val_every else 4  # the validation's two tasks, or step 0's four rollouts
    assert message.startswith(f"every rollout so far failed ({failed} of {failed}, none succeeded)")
    assert "check the agent setting ('pyhton -m no_agent') and rollout_timeout_s" in message
    # The agent's log, as the shell wrote it (dash: "pyhton: not found", bash: "command not found").
    assert "pyhton" in message.partition("its log ends:")[2]
    assert "not found" in message.partition("its log ends:")[2]
    assert not (run.run_dir / "metrics.jsonl").exists() or metrics(run.run_dir) == []


def test_every_rollout_without_a_reward_is_counted(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Agents that exit 0 without a reward: the groups are dropped and each of their rollouts is
    counted (only the first of each group was)."""
    tasks = tmp_path / "half.jsonl"
    words = {"ant": True, "bee": False, "cat": False}  # one task's agents report a reward
    tasks.write_text(
        "".join(
            json.dumps({"id": w, "input": {"word": w, "rewarded": r}}) + "\n"
            for w, r in words.items()
        )
    )
    agent = "tests.trainer.agents:no_reward"
    run = config(
        tmp_path, tiny_model_dir, agent=agent, steps=1, val_every=0, tasks=tasks, tasks_per_step=3
    )
    (record,) = asyncio.run(train(run))
    assert record["rollouts/missing_reward"] == 4
    assert record["rollouts/dropped_groups"] == 2
    assert (record["rollouts/trained"], record["rollouts/failed"]) == (2, 0)


@pytest.mark.parametrize("val_every", [0, 1], ids=["in-training", "in-validation"])
def test_an_agent_that_reports_no_reward_stops_the_run_at_its_first_rollouts(
    tmp_path: Path, tiny_model_dir: Path, val_every: int
) -> None:
    """Agents that exit 0 and never report a reward: every group was dropped (and validation read
    0 for each) in every step, and the run ended as if it had worked."""
    agent = "tests.trainer.agents:no_reward"
    run = config(tmp_path, tiny_model_dir, agent=agent, steps=3, val_every=val_every)
    with pytest.raises(AgentCannotRun) as stopped:
        asyncio.run(train(run))
    total = 2 if val_every else 4
    assert str(stopped.value).startswith(
        f"no rollout so far reported a reward ({total} of {total} ended without one, 0 failed): "
        "the run stops rather than go through its steps training on nothing; check the agent "
        f"setting ('{agent}'): an agent reports its reward with reins.agent.report_reward"
    )


def test_a_sync_step_reports_how_long_it_waited_on_its_slowest_rollouts(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Rollout 1 of each group pauses 1.5 s after each of its three calls, rollout 0 0.1 s: the
    last two of the step's four rollouts finish ~4 s after the first two, so from the median
    (between the 2nd and the 3rd) to the last is ~2 s; with every rollout alike it would be ~0."""
    tasks = tmp_path / "paced.jsonl"
    words = ["ant", "bee", "cat", "dog"]
    lines = [{"id": w, "input": {"word": w, "pause_s": 0.1, "slow_pause_s": 1.5}} for w in words]
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = config(
        tmp_path,
        tiny_model_dir,
        tasks=tasks,
        agent="tests.trainer.paced_agents:one_slow",
        steps=1,
        val_every=0,
    )
    (record,) = asyncio.run(train(run))
    # ~2.3 s measured (the step's rollouts: ~6 s); the first to the last would be ~4.5 s.
    assert 1.0 < record["time/rollout_tail"] < 3.5
    assert record["time/rollout_tail"] < record["time/rollout"]


def test_async_run_drains_updates_and_resumes_the_gateway(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run = config(tmp_path, tiny_model_dir, mode="async", steps=3, val_every=0, max_staleness=1)
    records = asyncio.run(train(run))
    assert [r["weight_version"] for r in records] == [1, 2, 3]
    assert all(r["rollouts/trained"] + 2 * r["rollouts/stale_groups"] == 4 for r in records)
    trained = np.cumsum([r["rollouts/trained"] for r in records])
    generated = 4 * np.arange(1, 4)  # two groups of two a step, trained or stale
    # A group given up before it finished (too stale to train: rare with agents this quick)
    # adds the rollouts of it that had finished, 0 to 2.
    given_up = np.cumsum([r["rollouts/cancelled_groups"] for r in records])
    waste = [r.get("rollouts/generated_per_trained") for r in records]
    for w, g, t, extra in zip(waste, generated, trained, given_up, strict=True):
        if not t:
            assert w is None
        else:
            assert g / t <= w <= (g + 2 * extra) / t
    assert all("time/wait" in r for r in records)


def test_async_steps_that_move_no_weight_keep_the_version_and_age_no_rollout(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Every rollout rewarded the same: no advantage, no optimizer step, so the version stays
    (it used to go up at every step: a rollout running across such a step counted as served
    by an older policy, and was dropped as stale past `max_staleness`)."""
    run = config(
        tmp_path, tiny_model_dir, mode="async", steps=3, val_every=0, max_staleness=0,
        agent="tests.trainer.agents:same_reward",
    )  # fmt: skip
    records = asyncio.run(train(run))
    assert [r["weight_version"] for r in records] == [0, 0, 0]
    assert [r["policy/optimizer_steps"] for r in records] == [0, 0, 0]
    assert [r["rollouts/stale_groups"] for r in records] == [0, 0, 0]
    assert [r["rollouts/cancelled_groups"] for r in records] == [0, 0, 0]


def test_async_run_with_importance_correction_reports_gaps_by_version_lag(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The embedded engine serves the trainer's own weights: a token served by the version being
    trained has the trainer's logprob (gap ~0); one served a version before is an update away."""
    run = config(
        tmp_path, tiny_model_dir, mode="async", steps=3, val_every=0, max_staleness=1,
        tis_cap=2.0, rollout_mask_ratio=1e6,
    )  # fmt: skip
    records = asyncio.run(train(run))
    lag0 = [r["correction/logprob_gap_lag0"] for r in records if "correction/logprob_gap_lag0" in r]
    lag1 = [r["correction/logprob_gap_lag1"] for r in records if "correction/logprob_gap_lag1" in r]
    assert lag0 and lag1, records
    assert max(lag0) < 1e-4 < min(lag1), (lag0, lag1)
    for record in records:
        assert record["rollouts/staleness_max"] <= 1
        if "correction/ratio_mean" in record:
            assert record["correction/masked_rollouts"] == 0
            assert 0 < record["correction/ratio_min"] <= record["correction/ratio_max"]


def test_rollouts_the_correction_masks_whole_are_not_counted_as_trained(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A mask bound of 1 + 1e-9 leaves out every rollout whose tokens the engine served at
    other weights than the trained ones (async: some at the previous version): those are not
    trained, and `rollouts/trained` and the waste figure say so."""
    run = config(
        tmp_path, tiny_model_dir, mode="async", steps=3, val_every=0, max_staleness=1,
        rollout_mask_ratio=1 + 1e-9,
    )  # fmt: skip
    records = asyncio.run(train(run))
    masked = [r.get("correction/masked_rollouts", 0) for r in records]
    assert sum(masked) > 0, records
    trained = [4 - 2 * r["rollouts/stale_groups"] - m for r, m in zip(records, masked, strict=True)]
    assert [r["rollouts/trained"] for r in records] == trained
    # `reward/mean` and `reward/std` are over the rollouts trained: a subset of the groups'
    # rollouts as large as `rollouts/trained` has them (the masked ones left out).
    rewards = group_rewards(run.run_dir)
    for record in records:
        taken = [v for g in record["rollouts/groups"] for v in rewards[g]]
        if not record["rollouts/trained"]:
            assert "reward/mean" not in record, record
            continue
        assert any(
            np.isclose(np.mean(s), record["reward/mean"])
            and np.isclose(np.std(s), record["reward/std"])
            for s in itertools.combinations(taken, record["rollouts/trained"])
        ), (record, taken)
    waste = records[-1].get("rollouts/generated_per_trained")
    if not sum(trained):
        assert waste is None
    else:  # 12 rollouts taken, and those finished of any group given up (0 to 2 each)
        given_up = sum(r["rollouts/cancelled_groups"] for r in records)
        assert 12 - 1e-9 <= waste * sum(trained) <= 12 + 2 * given_up + 1e-9


def group_rewards(run_dir: Path) -> dict[str, list[float]]:
    """Each group's rewards, as its rollouts reported them to the run's gateway."""
    with sqlite3.connect(f"file:{run_dir / 'gateway.db'}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT r.group_id, json_extract(e.data, '$.value') FROM events e"
            " JOIN rollouts r ON r.rollout_id = e.rollout_id"
            " WHERE e.type = 'reward' AND e.attempt_id = r.attempt_count"
        ).fetchall()
    out: dict[str, list[float]] = {}
    for group, value in rows:
        out.setdefault(group, []).append(float(value))
    return out


def slow_task_first(tmp_path: Path, wait_for: Path, words: tuple[str, ...]) -> tuple[Path, int]:
    """Tasks where `slow`'s rollouts wait between their two calls until `wait_for` exists, and a
    seed whose shuffle declares it first (async: two groups then start together)."""
    tasks = tmp_path / "slow.jsonl"
    lines = [{"id": "slow", "input": {"word": "slow", "wait_for": str(wait_for)}}]
    lines += [{"id": w, "input": {"word": w}} for w in words]
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    seed = next(
        seed for seed in range(100)
        if TaskStream(load_tasks(tasks), seed).take(1)[0][1].id == "slow"
    )  # fmt: skip
    return tasks, seed


@pytest.mark.parametrize("spanning", ["keep", "drop"])
def test_async_stale_groups_trained_with_the_correction_waste_nothing(
    tmp_path: Path, tiny_model_dir: Path, spanning: str
) -> None:
    """`stale_groups: correct`: the slow task's rollouts make a call, then wait until three
    updates have trained the other tasks, then make another: that group is 3 versions stale when
    it finishes (`max_staleness` 1). It is trained, with the correction, not dropped: every
    rollout generated is trained. Its two rollouts spanned updates: with `spanning_rollouts:
    drop` the group is dropped for that (counted as spanning, not as corrected)."""
    release = tmp_path / "release"
    tasks, seed = slow_task_first(tmp_path, release, ("ant", "bee", "cat"))
    run = config(
        tmp_path, tiny_model_dir, mode="async", steps=4, val_every=0, tasks=tasks, seed=seed,
        tasks_per_step=1, max_staleness=1, stale_groups="correct", tis_cap=2.0,
        spanning_rollouts=spanning,
    )  # fmt: skip
    stop = threading.Event()

    def release_after_three_steps() -> None:
        log = run.run_dir / "metrics.jsonl"
        while not stop.is_set():
            if log.exists() and len(log.read_text().splitlines()) >= 3:
                release.touch()
                return
            stop.wait(0.1)

    watcher = threading.Thread(target=release_after_three_steps, daemon=True)
    watcher.start()
    try:
        records = asyncio.run(train(run))
    finally:
        stop.set()
        watcher.join()
    assert [r["rollouts/stale_groups"] for r in records] == [0, 0, 0, 0]
    if spanning == "drop":
        # The slow group is dropped for its spanning rollouts: taken at step 3 and dropped, or
        # given up before (when the check after the third update already saw its second call).
        dropped = records[3]["rollouts/spanning_groups_dropped"]
        assert dropped + records[3]["rollouts/cancelled_groups"] >= 1
        assert [r["rollouts/stale_groups_corrected"] for r in records] == [0, 0, 0, 0]
        trained = [r["rollouts/trained"] for r in records]
        assert trained == [2 * len(r["rollouts/groups"]) for r in records]
        # 8 rollouts taken, and those finished of any group given up (0 to 2 each).
        given_up = sum(r["rollouts/cancelled_groups"] for r in records)
        generated = records[3]["rollouts/generated_per_trained"] * sum(trained)
        assert 8 - 1e-9 <= generated <= 8 + 2 * given_up + 1e-9
        return
    # The slow group's two rollouts spanned updates (another rollout may too, when an update
    # came between its two calls).
    assert records[3]["rollouts/spanning"] >= 2
    assert [r["rollouts/stale_groups_corrected"] for r in records] == [0, 0, 0, 1]
    assert records[3]["rollouts/staleness_max"] >= 2  # 3: first call by v0, trained at v3
    assert [r["rollouts/generated_per_trained"] for r in records] == [1.0] * 4


def test_async_gives_up_a_group_too_stale_to_train_and_declares_another(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`stale_groups: drop`: the slow task's two rollouts make their first call under v0, then
    wait for a file that never comes (the agent would wait 300 s). Once two updates have trained
    the other tasks, the group is two versions stale whatever it does next (`max_staleness` 1):
    the trainer fails its rollouts (the controller stops their agents) and declares a fresh
    group in its place, so every update trains one whole group and the run ends in seconds."""
    # Enough other tasks that the run (at most 7 groups) never declares the slow one again.
    words = ("ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen")
    tasks, seed = slow_task_first(tmp_path, tmp_path / "never", words)
    run = config(
        tmp_path, tiny_model_dir, mode="async", steps=5, val_every=0, tasks=tasks, seed=seed,
        tasks_per_step=1, max_staleness=1, rollout_timeout_s=600,
    )  # fmt: skip
    records = asyncio.run(train(run))
    # Given up in the wait after the second update past its first call: step 2's wait (the
    # usual case), or step 3's if a slow agent's first call came after the first update.
    given_up = [r["rollouts/cancelled_groups"] for r in records]
    assert given_up in ([0, 0, 1, 0, 0], [0, 0, 0, 1, 0]), given_up
    assert [r["rollouts/cancelled"] for r in records] == [2 * n for n in given_up]
    assert [r["rollouts/stale_groups"] for r in records] == [0] * 5
    assert [len(r["rollouts/groups"]) for r in records] == [1] * 5
    assert "slow" not in "".join(g for r in records for g in r["rollouts/groups"])
    # Nothing of the slow group finished on its own: no work counted as lost.
    assert records[-1]["rollouts/generated_per_trained"] == 1.0
    with sqlite3.connect(f"file:{run.run_dir / 'gateway.db'}?mode=ro", uri=True) as db:
        slow = db.execute(
            "SELECT state, reason FROM rollouts WHERE rollout_id LIKE '%.slow.%'"
        ).fetchall()
    assert slow == [
        ("failed", "trainer: its group can no longer be trained: a call was served 2 updates "
         "back (max_staleness 1)"),
    ] * 2  # fmt: skip
