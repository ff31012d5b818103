"""`python -m reins.controller.reaper`: ends the agents of a controller that ended, however it
ended (SIGKILL included).

A controller inside the trainer ties its agents to its own life (`LocalReconciler`'s
`die_with_parent`): the kernel SIGKILLs a child when its parent ends, but only that child. That
is the `sh` wrapper of a command-line agent, whose agent runs on without it, and the forked agent
of a zygote, whose own children (a tool's shell, a sandbox) run on. This process, in a session
of its own so that a kill of the trainer's process group spares it, holds the attempts' process
groups that are running; when its stdin closes (the controller's end of the pipe, closed by the
kernel when the controller's process ends) it kills what is still listed: each group, and the
processes that carry the attempt's mark outside it (`reins.controller.marks`).

Protocol, one line each on stdin: `+ PGID MARK` when an attempt's process group starts (MARK
`-` when it has none), `- PGID` when it ended. A controller that stops normally ends its agents
itself, so nothing is listed any more when it closes the pipe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from reins.controller.marks import signal_marked


def main() -> int:
    groups: dict[int, str | None] = {}
    for line in sys.stdin:
        op, *fields = line.split()
        if op == "+" and len(fields) == 2:
            groups[int(fields[0])] = None if fields[1] == "-" else fields[1]
        elif op == "-" and len(fields) == 1:
            groups.pop(int(fields[0]), None)
    for pgid, mark in groups.items():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        signal_marked(mark, signal.SIGKILL, pgid)
    return 0


if __name__ == "__main__":
    # The controller's Ctrl-C, or its terminal's hang-up, must not end this before the agents.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sys.exit(main())
