"""The rollout and group ids the trainer declares: a task's id may be any length, the gateway
takes ids of at most 200 characters."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from reins.schemas import RolloutSpec
from reins.trainer.config import TrainConfig
from reins.trainer.data import Task, TaskStream
from reins.trainer.loop import Trainer


class Declared(Exception):
    """Raised by the recording client once a declare was handed to it."""


class RecordingClient:
    """What the trainer would send the gateway to declare rollouts, kept."""

    def __init__(self, *, stop: bool) -> None:
        self.specs: list[RolloutSpec] = []
        self.stop = stop

    async def create_rollouts(self, specs: list[RolloutSpec]) -> list[Any]:
        self.specs += specs
        if self.stop:  # a validation then waits for its rollouts: stop there
            raise Declared
        return []


class Publisher:
    version = 12


def trainer(tmp_path: Path, client: RecordingClient, tasks: list[Task], **fields: Any) -> Trainer:
    config = TrainConfig.model_validate(
        {
            "run_name": "r" * 100,  # the longest run name there is
            "runs_dir": tmp_path,
            "tasks": tmp_path / "t.jsonl",
            "agent": "m:f",
            "tensorboard": False,
            **fields,
        }
    )
    return Trainer(
        config,
        client,  # type: ignore[arg-type]
        backend=object(),  # type: ignore[arg-type]
        publisher=Publisher(),  # type: ignore[arg-type]
        train_tasks=TaskStream(tasks, seed=0),
        val_tasks=tasks,
        incarnation=3,
    )


def test_a_long_task_id_is_declared_under_ids_the_gateway_takes(tmp_path: Path) -> None:
    """A task id of 180 characters made the declare fail (`2 validation errors for
    RolloutSpec ... String should have at most 200 characters`) once the model had loaded and
    the gateway started: with a short run name at its first resume only (the ids gain `.r1`).
    Ids are cut, with a digest of the task's id: distinct for tasks sharing their first 180
    characters, the same when declared again; ids that fit are left as they were."""
    shared = "x" * 180
    tasks = [Task(f"{shared}a", 1), Task(f"{shared}b", 2), Task("ant", 3)]
    client = RecordingClient(stop=False)
    run = trainer(tmp_path, client, tasks, group_size=12)
    groups = asyncio.run(run._declare(run.train_tasks.at([0, 1, 2])))
    again = asyncio.run(run._declare(run.train_tasks.at([0, 1, 2])))
    assert [g.rollout_ids for g in groups] == [g.rollout_ids for g in again]
    ids = [spec.rollout_id or "" for spec in client.specs[:36]]
    assert len(set(ids)) == 36 and max(len(i) for i in ids) == 200
    assert all(
        spec.rollout_id == f"{spec.group_id}.{k % 12}" for k, spec in enumerate(client.specs)
    )
    assert {spec.metadata["task"] for spec in client.specs} == {t.id for t in tasks}
    short = next(g for g in groups if g.task.id == "ant")
    assert short.rollout_ids[11] == f"{'r' * 100}.t{short.position:07d}.ant.r3.11"

    validating = RecordingClient(stop=True)
    with pytest.raises(Declared):
        asyncio.run(trainer(tmp_path, validating, tasks).validate(999999))
    ids = [spec.rollout_id or "" for spec in validating.specs]
    assert len(set(ids)) == 3 and max(len(i) for i in ids) == 200
    assert ids[2] == f"{'r' * 100}.val999999.v12.r3.ant"
