"""A scripted stand-in for the model, for the coding example's safeguard tests: `run` is an agent
module the controller launches (`tests.swe.scripted:run`) that plays the example's real rollout
(checkout, sandbox with git disabled and no network, events, the test reward) with the task's
`script`, a list of shell commands decided in advance (no LLM), sent one by one through the
example's mini-swe-agent environment as the model's bash calls would be."""

from __future__ import annotations

from typing import Any

from examples.swe.agent import play, post_command, report, task_of
from reins.sandbox import SandboxLimits
from reins.swe.environment import SandboxEnvironment


def run(task: dict[str, Any]) -> None:
    from minisweagent.exceptions import Submitted

    instance, repo = task_of(task)

    def run_agent(environment: SandboxEnvironment) -> str:
        for command in task["script"]:
            try:
                environment.execute({"command": command})
            except Submitted:
                return "Submitted"
        return "LimitsExceeded"

    limits = SandboxLimits(wall_s=30)
    report(play(instance, repo, run_agent, on_command=post_command, limits=limits))
