"""An agent with a known solve rate, for `reins swe prepare`'s difficulty filter through real
services (`tests.swe.oracle:run`): no model call; by the task's place in the shipped set it
always applies the gold fix, applies it on even attempts only, or never does. The fix is the
reverse of the instance's `patch`, read from the shipped file (the task input has no patch)."""

from __future__ import annotations

import subprocess
from typing import Any

from examples.swe.agent import play, report, task_of
from reins.agent import AgentContext
from reins.swe.environment import SandboxEnvironment
from reins.swe.instances import load_instances
from tests.swe.conftest import DATA


def rule(instance_id: str) -> str:
    ids = sorted(i.instance_id for i in load_instances(DATA / "instances.jsonl"))
    return ("always", "even attempts", "never")[ids.index(instance_id) % 3]


def run(task: dict[str, Any]) -> None:
    context = AgentContext.from_env()
    instance, repo = task_of(task)
    attempt = int(context.rollout_id.rsplit(".", 1)[1])
    (shipped,) = [
        i for i in load_instances(DATA / "instances.jsonl") if i.instance_id == instance.instance_id
    ]
    how = rule(instance.instance_id)
    solve = how == "always" or (how == "even attempts" and attempt % 2 == 0)

    def run_agent(environment: SandboxEnvironment) -> str:
        if solve:
            subprocess.run(
                ["git", "apply", "-R", "-"], input=shipped.fields["patch"], text=True,
                cwd=environment.sandbox.path, env={"GIT_DIR": "/nonexistent"}, check=True,
            )  # fmt: skip
        return "Submitted"

    report(play(instance, repo, run_agent))
