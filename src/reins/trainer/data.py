"""Tasks from a JSONL file, served in a seeded order that a checkpoint can resume exactly."""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import JsonValue, TypeAdapter, ValidationError

_json = TypeAdapter(JsonValue)
_TASK_ID = re.compile(r"[A-Za-z0-9._:-]+")
"""What a task id may hold: it is part of its rollouts' ids (`reins.schemas.Identifier`)."""


@dataclass(frozen=True)
class Task:
    id: str
    input: JsonValue


def _unprepared(path: Path) -> str:
    """What to run when the missing tasks are made by a preparation step beside them (the swe
    example's `prepare.yaml` writes `prepared/train.jsonl`)."""
    if path.exists():
        return ""
    for folder in (path.parent, path.parent.parent):
        if (folder / "prepare.yaml").is_file():
            return f"; prepare them first: reins swe prepare {folder / 'prepare.yaml'}"
    return ""


def load_tasks(path: Path) -> list[Task]:
    """One task per non-empty line: `{"id": ..., "input": ...}` (`id` defaults to the line number).

    Ids end up in rollout ids, so they are kept to letters, digits and `._:-`.
    """
    tasks: list[Task] = []
    seen: set[str] = set()
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ValueError(f"cannot read tasks from {path}: {error}{_unprepared(path)}") from error
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not JSON: {error}") from error
        if not isinstance(record, dict) or "input" not in record:
            raise ValueError(f'{path}:{number} must be an object with an "input" field')
        task_id = str(record.get("id", number))
        if not _TASK_ID.fullmatch(task_id):  # ASCII: `isalnum` took `é`, refused at declare
            raise ValueError(f"{path}:{number}: task id {task_id!r} may hold only [A-Za-z0-9._:-]")
        if task_id in seen:
            raise ValueError(f"{path}:{number}: task id {task_id!r} appears twice")
        seen.add(task_id)
        try:
            tasks.append(Task(task_id, _json.validate_python(record["input"])))
        except ValidationError as error:
            raise ValueError(f"{path}:{number}: input is not JSON data: {error}") from error
    if not tasks:
        raise ValueError(f"{path} holds no task")
    return tasks


class TaskStream:
    """Tasks in a seeded shuffle per epoch; `position` (tasks served) and the positions of groups
    declared but not trained (`at`) are all a resume needs."""

    def __init__(self, tasks: list[Task], seed: int, position: int = 0) -> None:
        self.tasks = tasks
        self.seed = seed
        self.position = position
        self._digest: str | None = None

    def identity(self) -> dict[str, Any]:
        """What a position means: the seed, and the tasks (their count and a digest of their ids
        and inputs, in order). A resume whose stream has another identity would serve other
        tasks at the checkpoint's positions."""
        if self._digest is None:
            hashed = hashlib.sha256()
            for task in self.tasks:
                hashed.update(json.dumps([task.id, task.input], sort_keys=True).encode())
                hashed.update(b"\n")
            self._digest = hashed.hexdigest()
        return {"seed": self.seed, "tasks": len(self.tasks), "digest": self._digest}

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def at(self, positions: list[int]) -> list[tuple[int, Task]]:
        """The tasks at these stream positions (served already: the position does not move)."""
        out = []
        for position in positions:
            epoch, index = divmod(position, len(self.tasks))
            out.append((position, self.tasks[self._order(epoch)[index]]))
        return out

    def take(self, count: int) -> list[tuple[int, Task]]:
        """The next `count` tasks, each with its position in the stream (a stable id)."""
        out = self.at(list(range(self.position, self.position + count)))
        self.position += count
        return out
