"""Fault suite: SIGKILL of `reins train`'s whole process group mid-run (async mode, rollouts in
flight, groups declared ahead of the checkpoint), then `reins train --resume`.

What it proves: no agent outlives the killed trainer; the resumed run finishes; its steps are
contiguous; no rollout is trained twice (each group id appears in one step's `rollouts/groups`);
no rollout the killed run declared runs again (one attempt each, none retried); no weight version
number names two sets of weights (the versions of the killed run's discarded steps and of its
calls are never served again)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from reins.gateway.store.journal import decode_posts
from tests.support import alive
from tests.trainer.test_loop import metrics, tasks_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
REINS = Path(sys.executable).with_name("reins")


def start(config: Path, output: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with output.open("wb") as out:
        return subprocess.Popen(
            [str(REINS), "train", str(config), *extra],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, killed whole
        )


def wait_for(
    condition: Any, process: subprocess.Popen[bytes], output: Path, limit_s: float
) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"reins train exited early: {output.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {limit_s} s: {output.read_text()[-3000:]}")
        time.sleep(0.02)  # polling a file, bounded by the deadline


def calls(db: Path) -> list[tuple[str, int, int]]:
    """(rollout id, attempt id, model version) of every recorded model call: those in the
    database, and those a killed gateway answered from its call journal and had not stored yet
    (the next start stores them: `reins.gateway.store.journal`)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
        rows = connection.execute(
            "SELECT rollout_id, attempt_id, idempotency_key, "
            "json_extract(data, '$.model_version') FROM events WHERE type = 'model_request'"
        ).fetchall()
    found = {(r, a, key): v for r, a, key, v in rows}
    journal = Path(f"{db}-calls")
    if journal.exists():
        posts, _ = decode_posts(journal.read_bytes())
        for post in posts:
            for row in post.rows:
                if row["type"] == "model_request":
                    key = (post.rollout_id, post.attempt_id, row["idempotency_key"])
                    found.setdefault(key, row["data"].value.get("model_version"))
    return [(r, a, int(v)) for (r, a, _), v in found.items() if v is not None]


def attempts(db: Path) -> dict[str, int]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
        return dict(connection.execute("SELECT rollout_id, attempt_count FROM rollouts"))


def agent_pids(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in (run_dir / "agents").glob("*/attempt-*/pid")]


def stuck_run(
    tmp_path: Path, tiny_model_dir: Path, run_name: str, agent: str, **fields: Any
) -> tuple[Path, Path]:
    """One step of two groups of two rollouts whose agents (`agent`) record their pids under
    `tmp_path/pids` and never end: the run's config file, and the file for its output."""
    pids = tmp_path / "pids"
    tasks = tmp_path / "train.jsonl"
    lines = [{"id": w, "input": {"pid_dir": str(pids)}} for w in ("ant", "bee")]
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    base = {
        "run_name": run_name,
        "runs_dir": str(tmp_path / "runs"),
        "tasks": str(tasks),
        "agent": agent,
        "model": str(tiny_model_dir),
        "steps": 1,
        "tasks_per_step": 2,
        "group_size": 2,
        "val_every": 0,
        "max_model_len": 256,
        "tensorboard": False,
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**base, **fields}))
    return config, tmp_path / "train.log"


def test_sigkill_of_reins_train_resumes_without_training_a_rollout_twice(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    words = ["ant", "bee", "cat", "dog", "eel", "fox"]
    fields = {
        "run_name": "sk",
        "runs_dir": str(tmp_path / "runs"),
        "tasks": str(tasks_file(tmp_path, "train.jsonl", words)),
        "agent": "tests.trainer.paced_agents:paced",
        "model": str(tiny_model_dir),
        "mode": "async",
        "max_staleness": 1,
        "steps": 4,
        "tasks_per_step": 1,
        "group_size": 2,
        "val_every": 0,
        "checkpoint_every": 2,
        "lr": 1e-3,
        "max_model_len": 256,
        "rollout_timeout_s": 120,
        "tensorboard": False,
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(fields))
    run_dir = tmp_path / "runs" / "sk"
    lines = run_dir / "metrics.jsonl"

    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start(config, first_log)
    try:
        # Past the checkpoint of step 2 (written after step 1) and step 2's update.
        wait_for(lambda: lines.exists() and '"step": 2' in lines.read_text(), first, first_log, 120)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # The agents (own sessions, out of the killed group) die with the trainer.
    pids = agent_pids(run_dir)
    assert pids
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [pid for pid in pids if alive(pid)]
    killed_lines = metrics(run_dir)
    killed_calls = calls(run_dir / "gateway.db")
    checkpoint = json.loads((run_dir / "checkpoints" / "step-000002" / "trainer.json").read_text())
    # Groups declared ahead of the checkpoint and not trained by it (async).
    assert checkpoint["data_position"] > checkpoint["next_step"] * fields["tasks_per_step"]

    second = start(config, second_log, "--resume")
    try:
        second.wait(timeout=120)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait()
    text = second_log.read_text()
    assert second.returncode == 0, text
    assert f"resumed run sk from step 2 (checkpoint {run_dir / 'checkpoints' / 'step-000002'})" in (
        " ".join(text.split())
    )

    final = metrics(run_dir)
    assert [line["step"] for line in final] == [0, 1, 2, 3]
    assert final[:2] == killed_lines[:2]  # committed steps are kept as they were
    groups = [g for line in final for g in line["rollouts/groups"]]
    assert len(groups) == len(set(groups)) == 4
    # By task stream position (`<run>.t<position>.<task>[.r<incarnation>]`): each of the four
    # tasks trained once, whichever incarnation declared it.
    assert sorted(g.split(".")[1] for g in groups) == [f"t{p:07d}" for p in range(4)]
    assert all(line["rollouts/trained"] == 2 * len(line["rollouts/groups"]) for line in final)

    # Version numbers: the killed run's discarded weights (its step 2 line, its calls) are never
    # named again; the resumed run's versions go up at each step that moved the weights (a
    # step whose groups all had equal rewards, likely with rewards of 0, 0.5 or 1 in groups of
    # two, takes no optimizer step and keeps its version).
    discarded = {line["weight_version"] for line in killed_lines[2:]}
    resumed_versions = [line["weight_version"] for line in final[2:]]
    moved = [line.get("policy/optimizer_steps", 0) > 0 for line in final[3:]]
    pairs = zip(resumed_versions[:-1], resumed_versions[1:], moved, strict=True)
    assert all(after > before if step else after == before for before, after, step in pairs)
    assert not discarded & set(resumed_versions)
    every_call = calls(run_dir / "gateway.db")
    old = {v for r, _, v in killed_calls}
    new = {v for r, _, v in every_call if ".r1." in r}
    assert new and min(new) > max(old | discarded)
    # Nothing the killed run declared ran again after the kill: one attempt each, no new call.
    counts = attempts(run_dir / "gateway.db")
    assert all(n <= 1 for rollout_id, n in counts.items() if ".r1." not in rollout_id)
    assert {(r, a, v) for r, a, v in every_call if ".r1." not in r} <= set(killed_calls)


@pytest.mark.parametrize("kind", ["command", "module"])
def test_sigkill_of_reins_train_leaves_no_agent_nor_child_of_one(
    tmp_path: Path, tiny_model_dir: Path, kind: str
) -> None:
    """The kernel kills only the trainer's direct children with it (`die_with_parent`): a
    command's `sh` wrapper, whose agent ran on, and a forked agent, whose own children ran on.
    Whatever of a running attempt is left is killed by the reaper (`reins.controller.reaper`)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    # Written under a hidden name, then renamed: the `sk.*` glob sees only whole records.
    record, partial = f"{pids}/$REINS_ROLLOUT_ID", f"{pids}/.$REINS_ROLLOUT_ID"
    agents = {
        "command": f"sleep 600 & echo $$ $! > {partial} && mv {partial} {record}; wait",
        "module": "tests.trainer.paced_agents:stuck",
    }
    config, output = stuck_run(tmp_path, tiny_model_dir, "sk", agents[kind])
    trainer = start(config, output)
    try:
        wait_for(lambda: len(list(pids.glob("sk.*"))) == 4, trainer, output, 120)
        running = [int(pid) for p in pids.glob("sk.*") for pid in p.read_text().split()]
        assert len(running) == 8 and all(alive(pid) for pid in running)
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in running) and time.monotonic() < deadline:
        time.sleep(0.02)  # polling /proc, bounded by the deadline
    assert not [pid for pid in running if alive(pid)]
