"""Every process of one attempt, found by a mark in its environment.

An attempt's process group holds the agent's children until one leaves it: `setsid`,
`subprocess.Popen(start_new_session=True)` (tool runners use it to kill a tool's own tree),
Node's `spawn(..., {detached: true})`, a daemon's double fork. Such a process outlives a timeout
or a stop of the group, and keeps its CPU and memory for the rest of a training run. The
environment goes with a process through all of those, so the local reconciler gives each attempt a
random mark (`ATTEMPT_MARK` in its environment) and, when the attempt ends or is killed, signals
every process whose environment carries it, read from `/proc/PID/environ` (the environment a
process was started with: the mark is there for every process the agent's tree executed).

Limits: a process started with a cleared environment (`env -i`) is not found, nor a process of
another user, nor anything outside Linux's /proc (elsewhere no process is found). A fork does
not rewrite the kernel's copy of the environment: a zygote-forked agent writes its mark over the
zygote's placeholder in its own starting environment (`zygote.mark_start_environ`), so what it
forks without an exec (a Python daemon's double fork) carries the mark too.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ATTEMPT_MARK = "REINS_ATTEMPT_MARK"
"""The environment variable holding an attempt's mark (a random hex string)."""

_PROC = Path("/proc")


def marked_processes(mark: str, proc: Path = _PROC) -> list[int]:
    """The pids of the live processes whose starting environment carries `mark` (never this
    process). A zombie's environment reads empty: it is not listed."""
    needle = f"{ATTEMPT_MARK}={mark}\0".encode()
    found = []
    own = os.getpid()
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) == own:
            continue
        try:
            with open(proc / name / "environ", "rb") as environ:
                data = environ.read()
        except OSError:  # gone, another user's, or not readable
            continue
        # Anchored at a variable's start: the mark may also appear inside another's value.
        if data.startswith(needle) or b"\0" + needle in data:
            found.append(int(name))
    return found


def signal_marked(mark: str | None, sig: signal.Signals, group: int | None = None) -> list[int]:
    """Sends `sig` to every live process carrying `mark` outside process group `group` (the
    attempt's own, signalled whole by the caller: none gets the signal twice); returns the
    pids signalled."""
    if not mark:
        return []
    signalled = []
    for pid in marked_processes(mark):
        try:
            if group is not None and os.getpgid(pid) == group:
                continue
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        signalled.append(pid)
    return signalled
