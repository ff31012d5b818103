"""mini-swe-agent's environment over a `reins.sandbox.Sandbox`.

mini-swe-agent runs unmodified: its agent and model classes as they ship, this class in place
of its `LocalEnvironment` (an environment is its documented extension point: `execute`,
`get_template_vars`, `serialize`). Each command the model sends runs in the rollout's sandbox:
a fresh shell in the checkout (`/work`), no network at all, git disabled and git's programs
hidden, limits on time, memory and processes. The harness process itself stays outside: it
alone holds the attempt's token, so no command can post an event (a reward) or reach anything.

Every command goes to `on_command` with its result and the hacks it tried
(`reins.swe.hacks`), for the harness to post as `tool` and `hack_attempt` events.
"""

from __future__ import annotations

import dataclasses
import platform
import shlex
from collections.abc import Callable
from typing import Any

from reins.agent import trimmed
from reins.sandbox import CommandResult, Sandbox
from reins.swe.hacks import HackAttempt, attempted_hacks

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""mini-swe-agent's end of task: a command whose output starts with this line."""

OnCommand = Callable[[str, CommandResult, list[HackAttempt]], None]


def _limit_info(result: CommandResult) -> str:
    """What a limit did to the command, for mini-swe-agent's `exception_info`."""
    if result.limit is None:
        return ""
    if result.exit_code is None:
        return f"stopped by the {result.limit} limit"
    return f"the command ran on after reaching the {result.limit} limit"


class SandboxEnvironment:
    """A mini-swe-agent environment: `execute` runs a command in `sandbox`."""

    def __init__(
        self,
        sandbox: Sandbox,
        *,
        on_command: OnCommand | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.sandbox = sandbox
        self.on_command = on_command
        self.timeout_s = timeout_s
        self.hacks: list[HackAttempt] = []
        self.commands = 0

    def execute(
        self, action: dict[str, Any] | str, cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        command = action if isinstance(action, str) else str(action.get("command", ""))
        if cwd and cwd not in ("/work", "."):
            # Shell quoting: Python's repr is not (a `'` in the path made it a "..." in which
            # bash expanded `$`, and an escape such as `\t` stayed two characters).
            command = f"cd {shlex.quote(cwd)} && {command}"
        result = self.sandbox.run(command, timeout_s=timeout or self.timeout_s)
        self.record(command, result)
        output: dict[str, Any] = {
            "output": result.output,
            # mini-swe-agent shows the code to the model; a command a limit stopped has none.
            "returncode": result.exit_code if result.exit_code is not None else -1,
            "exception_info": _limit_info(result),
        }
        self._check_finished(output)
        return output

    def record(self, command: str, result: CommandResult) -> None:
        """Counts a command that ran in the sandbox, its hacks, and passes it to `on_command`
        (`execute` calls it; so does a harness that runs its commands itself), its text and
        output cut to `POSTED_CHARS` each (a harness that runs its commands itself, Codex,
        reports outputs of any size, past the gateway's 32 MB event post): the hacks are looked
        for in the whole of them."""
        hacks = attempted_hacks(command, result.output)
        self.commands += 1
        self.hacks += hacks
        if self.on_command is not None:
            output = trimmed(result.output, "output")
            if output is not result.output:
                result = dataclasses.replace(result, output=output)
            self.on_command(trimmed(command, "command"), result, hacks)

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = output["output"].lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and output["returncode"] == 0:
            from minisweagent.exceptions import Submitted

            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """What mini-swe-agent's templates read (`{{system}}`, `{{machine}}`...): the host's
        uname, the sandbox's own environment (never the host's: it holds the token)."""
        return {
            **platform.uname()._asdict(),
            "cwd": "/work",
            "timeout": self.timeout_s or self.sandbox.limits.wall_s,
            **kwargs,
        }

    def serialize(self) -> dict[str, Any]:
        limits = self.sandbox.limits
        return {
            "info": {
                "config": {
                    "environment": {"limits": dataclasses.asdict(limits)},
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                }
            }
        }
