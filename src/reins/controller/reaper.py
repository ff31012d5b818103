"""`python -m reins.controller.reaper`: ends the agents of a controller that ended, however it
ended (SIGKILL included).

A controller inside the trainer ties its agents to its own life (`LocalReconciler`'s
`die_with_parent`): the kernel SIGKILLs a child when its parent ends, but only that child. That
is the `sh` wrapper of a command-line agent, whose agent runs on without it, and the forked agent
of a zygote, whose own children (a tool's shell, a sandbox) run on. This process, in a session
of its own so that a kill of the trainer's process group spares it, holds the attempts that are
running; when its stdin closes (the controller's end of the pipe, closed by the kernel when the
controller's process ends) it kills what is left of each one still listed: its process group
(whose id is in the attempt folder's `pid` file) and the processes that carry the attempt's mark
outside it (`reins.controller.marks`).

An attempt is listed before its process starts, by its folder: the group id is read at the
end, so that a controller killed between starting an agent and hearing its pid (the wrapper
writes `pid` before it runs the agent) still has it killed.

Protocol, one JSON array per line on stdin: `["+", FOLDER, MARK]` before an attempt's process
starts (MARK null when it has none), `["-", FOLDER]` when it ended. A controller that stops
normally ends its agents itself, so nothing is listed any more when it closes the pipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from reins.controller.marks import signal_marked


def main() -> int:
    attempts: dict[str, str | None] = {}
    for line in sys.stdin:
        with contextlib.suppress(ValueError, TypeError):  # a line cut short by a killed writer
            op, folder, *mark = json.loads(line)
            if op == "+":
                attempts[folder] = mark[0] if mark else None
            elif op == "-":
                attempts.pop(folder, None)
    for folder, mark in attempts.items():
        group = _read_group(Path(folder))
        if group is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        signal_marked(mark, signal.SIGKILL, group)
    return 0


def _read_group(folder: Path) -> int | None:
    """The attempt's process group id: its leader's pid, which `pid` holds once it is running
    (an empty or missing file: its agent never started)."""
    try:
        pid = int((folder / "pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if pid > 1 else None


if __name__ == "__main__":
    # The controller's Ctrl-C, or its terminal's hang-up, must not end this before the agents.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sys.exit(main())
