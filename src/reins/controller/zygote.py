"""`python -m reins.controller.zygote module:function`: a preloaded parent for one agent.

A fresh interpreter per attempt pays for the agent's imports every time: `import openai` alone
costs about 1.4 s of CPU here, which for a few hundred short rollouts per training run is most of
two cores. The zygote imports the agent's module once, then forks one child per attempt (a few
milliseconds each). A child starts its own session (its process group is killed whole on a
timeout), sends its output to the attempt's `agent.log`, takes the attempt's environment, runs
the agent exactly as `run_agent` does, and writes its `exit` file as the shell wrapper would (the
zygote writes its `pid` and `pid.start` before answering); the controller watches it like an
adopted agent. A child that leaves no `exit` (it ended through `os._exit` or a signal) gets one
from the zygote, which reaps its children: the status as the shell wrapper would have written it
(128 + N for signal N), before the child's pid is released.

With `REINS_ZYGOTE_DIE_WITH_PARENT=1` in its environment (the trainer's own controller sets it),
the zygote and every child die with their parent (`die_with_parent`): a SIGKILL of the trainer
leaves no agent behind.

Protocol: one JSON request per line on stdin, `{"folder": ..., "env": {...}, "cwd": ...}`, one
answer per line on stdout, `{"pid": N}` or `{"error": "..."}`. When stdin closes (the controller
stopped, or died) the zygote forks no more, and exits once its last child has ended and has its
`exit` file: only a parent sees how its child ended, so a zygote gone first would leave an agent
that a restarted controller adopted without an outcome. Anything else written to stdout (by the
agent's module, say) goes to stderr instead.

Caveat (documented in docs/controller.md): a module that reads the environment at import time sees
the controller's environment, not the attempt's; such agents can opt out (`reins controller
--no-preload`, or `LocalReconciler(preload=False)`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reins.controller.marks import ATTEMPT_MARK


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/PID/stat): with the pid, a process's
    identity (pids are reused, this pair is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


DIE_WITH_PARENT = "REINS_ZYGOTE_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, prctl: Callable[..., int] | None = None) -> None:
    """Has the kernel SIGKILL this process when `parent` (its parent) ends (Linux; elsewhere
    nothing). Called in a freshly forked child; if the parent is already gone, dies now. A child
    forked from a threaded process must not import or load anything: pass `pdeathsig_call()`,
    taken before the fork."""
    prctl = prctl or pdeathsig_call()
    if prctl is None or prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def pdeathsig_call() -> Callable[..., int] | None:
    """libc's `prctl` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    return prctl


MARK_PLACEHOLDER = "0" * 32
"""The zygote's own `ATTEMPT_MARK` (an attempt's, a uuid4's hex, is never all zeros): each child
writes its attempt's mark over it (`mark_start_environ`)."""


def mark_start_environ(name: str, value: str) -> bool:
    """Writes `value` over the value of `name` in this process's starting environment: the copy
    /proc/PID/environ shows, which a fork does not rewrite (`os.environ` is another copy), so a
    process forked from this one without an exec (a daemon's double fork) is found by its mark
    too (`reins.controller.marks`). Only over a value of the same length, which the zygote
    starts with (`MARK_PLACEHOLDER`); False when it cannot (not Linux, no such variable)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[-1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start and env_end: fields 50, 51
        environ = Path("/proc/self/environ").read_bytes()
    except (OSError, IndexError, ValueError):
        return False
    needle = f"{name}=".encode()
    found = -1 if environ.startswith(needle) else environ.find(b"\0" + needle)
    if (found < 0 and not environ.startswith(needle)) or len(environ) != end - start:
        return False
    new = value.encode()
    at = found + 1 + len(needle)
    if environ.find(b"\0", at) - at != len(new):
        return False
    import ctypes

    ctypes.memmove(start + at, new, len(new))
    return True


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)


def _exit_status(code: object) -> int:
    """The status Python's own exit gives `SystemExit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(
    agent: str, function: Any, request: dict[str, Any], parent: int | None, protocol: int
) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    try:
        # The zygote's `atexit` functions (its modules', registered when they were imported) are
        # not this child's to run: a module's cleanup of what it made would run at every end.
        atexit._clear()
        os.close(protocol)  # the zygote's answers are its own: a child holding them open would
        os.setsid()  # keep the controller from seeing a dead zygote's end of file
        if parent is not None:
            die_with_parent(parent)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the agent's own subprocesses are waited
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})  # blocked by the zygote
        folder = Path(request["folder"])
        log = os.open(folder / "agent.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.stdin = open(0)  # noqa: SIM115 (the child's whole life)
        os.environ.clear()
        os.environ.update(request["env"])
        mark = request["env"].get(ATTEMPT_MARK)
        if mark:
            mark_start_environ(ATTEMPT_MARK, mark)
        os.chdir(request["cwd"])
        from reins.controller.run_agent import call_agent

        code = call_agent(agent, function)
    except SystemExit as exit_:  # sys.exit(N) in the agent: status N, as in a fresh interpreter
        code = _exit_status(exit_.code)
    except KeyboardInterrupt:  # a fresh interpreter dies of the SIGINT: the shell says 130
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException as error:  # the child must reach os._exit whatever happens
        print(f"reins: the agent's process failed before it ran: {error!r}", file=sys.stderr)
    finally:
        _finalize()
        try:
            _write(Path(request["folder"]) / "exit", str(code))
        finally:
            os._exit(code)


def _finalize() -> None:
    """What a fresh interpreter does before it exits, in its order: wait for the threads that
    are not daemons (an agent reporting its reward from one lost it), run the `atexit`
    functions the agent registered, flush the output. `os._exit` then skips the zygote's own
    frames above the fork."""
    shutdown = getattr(threading, "_shutdown", None)  # what Py_FinalizeEx calls first
    for step in (shutdown, atexit._run_exitfuncs, sys.stdout.flush, sys.stderr.flush):
        if step is None:
            continue
        try:
            step()
        except BaseException:  # as the interpreter's exit does, go on to the next step
            with contextlib.suppress(BaseException):
                traceback.print_exc()


def _reap(children: dict[int, Path], *, until_none_left: bool = False) -> None:
    """Writes the `exit` file of every ended child that left none, then reaps it; with
    `until_none_left`, waits for every child in `children` to end.

    The status is read without reaping (WNOWAIT) and the `exit` file written first: while the
    child is a zombie its pid (and start time) still name it, so the controller, which waits for
    the zombie to go before it reads `exit`, finds the file there."""
    flags = os.WEXITED | os.WNOWAIT | (0 if until_none_left else os.WNOHANG)
    while not until_none_left or children:
        try:
            ended = os.waitid(os.P_ALL, 0, flags)
        except ChildProcessError:
            return
        if ended is None or ended.si_pid == 0:
            return
        pid = ended.si_pid
        folder = children.get(pid)
        if folder is not None:
            code = ended.si_status
            if ended.si_code != os.CLD_EXITED:  # killed by signal N: what `sh` reports
                code = 128 + ended.si_status
            if not (folder / "exit").exists():
                try:
                    _write(folder / "exit", str(code))
                except OSError as error:
                    print(f"reins: cannot write {folder / 'exit'}: {error!r}", file=sys.stderr)
        children.pop(pid, None)
        with contextlib.suppress(ChildProcessError):  # reaped by a nested call already
            os.waitpid(pid, 0)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or ":" not in argv[0]:
        print("usage: python -m reins.controller.zygote module:function", file=sys.stderr)
        return 2
    agent = argv[0]
    from reins.controller.run_agent import load_agent

    # The answers go to a copy of stdout; stdout itself becomes stderr (the zygote's log), so
    # what the agent's module prints when imported (mini-swe-agent's banner) cannot corrupt them.
    protocol = os.dup(sys.stdout.fileno())
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    out = os.fdopen(protocol, "w")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    function = load_agent(agent)
    if function is None:
        return 2
    parent = None
    if os.environ.pop(DIE_WITH_PARENT, "") == "1":
        die_with_parent(int(os.environ.pop(DIE_WITH_PARENT + "_PID", "0")) or os.getppid())
        parent = os.getpid()
    children: dict[int, Path] = {}
    """Each live child's attempt folder, for its `exit` file."""
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: _reap(children))
    for line in sys.stdin:
        if not line.strip():
            continue
        # SIGCHLD waits until the child is registered: one that ended at once still gets `exit`.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            out.flush()
            pid = os.fork()
        except (ValueError, OSError) as error:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            out.write(json.dumps({"error": repr(error)}) + "\n")
            out.flush()
            continue
        if pid == 0:
            _child(agent, function, request, parent, protocol)
        folder = Path(request["folder"])
        children[pid] = folder
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        # Written here, before the answer, so the controller never sees a pid it cannot check.
        _write(folder / "pid.start", process_start_time(pid) or "")
        _write(folder / "pid", str(pid))
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
    # Only the agents are waited for (a helper process the module started when imported may
    # live as long as the zygote). SIGCHLD is blocked so that its handler cannot reap the last
    # agent while this wait blocks.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    _reap(children, until_none_left=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
