"""`LocalReconciler`: agents as local processes, at most `max_parallel` at a time.

Each attempt gets a folder `LOG_DIR/<rollout id>/attempt-<n>/`:

- `launch.json`: what was launched, when, with which timeout (written before the spawn);
- `agent.log`: the agent's stdout and stderr, combined, kept under `log_max_bytes` (its head
  and tail, with a note where its middle was left out: `_cap_log`);
- `pid`: written by a tiny `sh` wrapper as its first act (the wrapper leads the process group);
- `exit`: the wrapper's last act writes the agent's exit status; the controller writes
  `timeout`, `stopped` or `signal N` when it killed the group or the wrapper died, and
  `not started: ERROR` when the process could not be started.

The files are what lets a restarted controller converge: a live wrapper is adopted (watched until
it exits, its deadline still enforced), an `exit` file is an outcome nobody reported yet, a `pid`
without a live process and without `exit` is a lost agent. Nothing is launched for an attempt
that has a `pid` or `exit` file. `LOG_DIR/controller.lock` is held (`flock`) while a controller
uses the folder: a second one on the same folder is refused at its start.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from reins.controller.loop import (
    _MODULE_FUNCTION,
    RUNNING,
    TAIL_BYTES,
    AgentLog,
    Ended,
    Key,
    Launch,
    LaunchError,
    State,
    agent_command,
)
from reins.controller.marks import ATTEMPT_MARK, marked_processes, signal_marked
from reins.controller.zygote import (
    DIE_WITH_PARENT,
    MARK_PLACEHOLDER,
    die_with_parent,
    pdeathsig_call,
)

# Runs the agent as its child so that the exit status is written even when no controller is
# alive to wait for it. `"$@"` is the agent's argv, so nothing of it is parsed by this shell.
_WRAPPER = 'd=$1; shift\necho $$ > "$d/pid"\n"$@"\nrc=$?\necho $rc > "$d/exit"\nexit $rc\n'

_ATTEMPT_FOLDER = re.compile(r"attempt-\d+")
_ZYGOTE_WAIT_S = 600.0
"""How long an attempt without a timeout waits for its zygote's answer (its imports)."""
_ZOMBIE_WAITS = 500
"""How many times (10 ms apart) the watch waits for a zygote to reap its ended child."""
_UNSTARTED_GRACE_S = 5.0
"""A `launch.json` this old without a `pid` means the wrapper never started."""
_NOT_STARTED = "not started: "
"""How `exit` begins for a process that could not be started; the error follows."""
LOG_MAX_BYTES = 64 * 1024 * 1024
"""An attempt's `agent.log` is cut back to its first and last quarters of this, with a note
between them, once it passes it (`LocalReconciler(log_max_bytes=...)`): an agent printing in a
loop filled the disk."""
_LOG_CHECK_S = 1.0
"""How often the running agents' logs are measured: one `stat` each."""


@dataclass
class _Execution:
    key: Key
    folder: Path
    pid: int
    deadline: float | None
    """Wall-clock time past which the agent is killed (time.time()), or None."""
    timeout_s: float | None
    incarnation: str | None
    process: asyncio.subprocess.Process | None = None
    """None for an agent adopted from a previous controller (not our child)."""
    monitor: asyncio.Task[None] | None = None
    ended: Ended | None = None
    mark: str | None = None
    """The attempt's `marks.ATTEMPT_MARK`: its processes outside its group are found by it."""


def _lock_folder(log_dir: Path) -> int:
    """Holds `log_dir/controller.lock` until it is closed (or this process ends, however).

    Two controllers on one log folder are one holder of the gateway's controller lease (its
    holder names the folder, so that a restarted controller takes its lease back at once): both
    launched every rollout, and the second adopted the first one's agents and killed them when
    it stopped."""
    path = log_dir / "controller.lock"
    lock = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(lock, 200, 0).decode(errors="replace").strip() or "a live process"
        os.close(lock)
        raise ValueError(
            f"another controller ({holder}) uses the log folder {log_dir}: give each "
            "controller a log folder of its own (--log-dir)"
        ) from None
    os.ftruncate(lock, 0)
    os.pwrite(lock, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    return lock


class LocalReconciler:
    """A local process pool: one process group per attempt, killed whole on timeout or stop."""

    runner = "local"

    def __init__(
        self,
        agent: str,
        max_parallel: int,
        log_dir: Path,
        *,
        workdir: Path | None = None,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        kill_grace_s: float = 2.0,
        adopt_poll_s: float = 0.2,
        preload: bool = True,
        die_with_parent: bool = False,
        log_max_bytes: int = LOG_MAX_BYTES,
        log_check_s: float = _LOG_CHECK_S,
    ) -> None:
        if max_parallel < 1:
            raise ValueError(f"max_parallel must be at least 1, not {max_parallel}")
        if log_max_bytes < 4 * TAIL_BYTES:
            raise ValueError(
                f"log_max_bytes must be at least {4 * TAIL_BYTES}, not {log_max_bytes}"
            )
        if not agent.strip():
            raise ValueError("the agent is empty: give `module:function` or a command line")
        self.agent = agent
        """`module:function` or a command line; a rollout's `config.agent` overrides it."""
        self.max_parallel = max_parallel
        self.log_dir = Path(log_dir).resolve()
        self.lease_holder = f"local {socket.gethostname()}:{self.log_dir}"
        self.workdir = Path(workdir or Path.cwd()).resolve()
        self.env = dict(env or {})
        """Extra environment for every agent (the contract's variables win over these)."""
        self.python = python
        self.kill_grace_s = kill_grace_s
        self.adopt_poll_s = adopt_poll_s
        self.preload = preload
        """`module:function` agents are forked from a zygote that imported their module once
        (`reins.controller.zygote`), instead of a fresh interpreter per attempt."""
        self.die_with_parent = die_with_parent
        """Agents (and zygotes) are killed by the kernel when this process ends, even by
        SIGKILL: for a controller inside the trainer, whose gateway dies with it. A standalone
        controller leaves it off, so that its agents outlive a crash and are adopted. The kernel
        kills only the direct child (a command's `sh` wrapper, a forked agent): the rest of each
        running attempt (the command's agent itself, an agent's own children) is killed by a
        reaper process (`reins.controller.reaper`)."""
        self._reaper: subprocess.Popen[bytes] | None = None
        self._zygotes: dict[str, _Zygote] = {}
        self._unloadable: set[str] = set()
        self._execs: dict[Key, _Execution] = {}
        self._on_change: Callable[[], None] = lambda: None
        self._host = socket.gethostname()
        self._folder_lock: int | None = None
        self.log_max_bytes = log_max_bytes
        """Each `agent.log` is kept under about this size (plus what an agent writes in
        `log_check_s`): its first and last quarters, a note in place of the rest."""
        self.log_check_s = log_check_s
        self._log_guard: asyncio.Task[None] | None = None

    # -- protocol ---------------------------------------------------------------------------

    async def start(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self._folder_lock is None:
            self._folder_lock = _lock_folder(self.log_dir)
        # Adopt every live agent a previous controller left here, so that the controller can
        # stop those whose rollout ended meanwhile, and watch the others to their end.
        for pid_file in self.log_dir.glob("*/attempt-*/pid"):
            folder = pid_file.parent
            if not _ATTEMPT_FOLDER.fullmatch(folder.name) or (folder / "exit").exists():
                continue
            launched = _read_json(folder / "launch.json")
            pid = _read_int(pid_file)
            if launched is None or pid is None or not _alive(pid, folder):
                continue
            key = (str(launched["rollout_id"]), int(str(launched["attempt_id"])))
            if key not in self._execs:
                self._adopt(key, folder, pid, launched)
        if self._log_guard is None:
            self._log_guard = asyncio.create_task(self._guard_logs())

    async def close(self) -> None:
        guard, self._log_guard = self._log_guard, None
        if guard is not None:
            guard.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await guard
        running = [e for e in self._execs.values() if e.ended is None]
        await asyncio.gather(*(self._stop(e, "stopped") for e in running))
        self._execs.clear()
        for zygote in self._zygotes.values():
            await zygote.close()
        self._zygotes.clear()
        reaper, self._reaper = self._reaper, None
        if reaper is not None:  # every attempt ended: it has nothing to kill, and exits
            assert reaper.stdin is not None
            with contextlib.suppress(OSError):
                reaper.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(reaper.wait, 10)
        lock, self._folder_lock = self._folder_lock, None
        if lock is not None:
            os.close(lock)

    def free_slots(self) -> int:
        return self.max_parallel - sum(1 for e in self._execs.values() if e.ended is None)

    def executions(self) -> Iterable[Key]:
        return list(self._execs)

    def state(self, key: Key) -> State | None:
        execution = self._execs.get(key)
        if execution is None:
            return None
        return execution.ended or RUNNING

    def incarnation(self, key: Key) -> str | None:
        execution = self._execs.get(key)
        return None if execution is None else execution.incarnation

    async def find(self, key: Key, incarnation: str) -> State | None:
        known = self.state(key)
        if known is not None:
            return known
        folder = self.folder(key)
        launched = _read_json(folder / "launch.json")
        if launched is None or launched.get("incarnation") != incarnation:
            return None  # nothing, or the files of an older rollout with this id
        ended = _read_exit(folder)
        pid = _read_int(folder / "pid")
        while pid is None and ended is None:
            started = launched.get("started_at")
            age = time.time() - (started if isinstance(started, int | float) else 0.0)
            if age > _UNSTARTED_GRACE_S:
                return None  # the controller stopped between writing launch.json and spawning
            await asyncio.sleep(0.1)
            ended, pid = _read_exit(folder), _read_int(folder / "pid")
        if ended is None and pid is not None:
            if _alive(pid, folder):
                return self._adopt(key, folder, pid, launched).ended or RUNNING
            await _reaped(pid, folder)
            ended = _read_exit(folder) or _lost(pid, folder)
        assert ended is not None
        # It ended while no controller watched: what it left outside its group goes now.
        mark = launched.get("mark")
        signal_marked(str(mark) if mark else None, signal.SIGKILL, pid)
        self._execs[key] = _Execution(key, folder, pid or 0, None, None, incarnation, ended=ended)
        return ended

    async def launch(self, launch: Launch) -> str:
        key = launch.key
        folder = self.folder(key)
        if key in self._execs:
            return self._where(folder, self._execs[key].pid)
        if folder.exists():
            launched = _read_json(folder / "launch.json") or {}
            if launched.get("incarnation") == launch.incarnation:
                if await self.find(key, launch.incarnation) is not None:
                    return self._where(folder)  # launched before: never a second time
            else:
                # An older rollout with this id left its files here: keep them, start clean.
                folder.rename(folder.with_name(f"{folder.name}.replaced-{time.time_ns()}"))
        agent = launch.agent or self.agent
        if not agent.strip():
            raise LaunchError("the rollout's agent is empty")
        argv = agent_command(agent, self.python)
        folder.mkdir(parents=True, exist_ok=True)
        started = time.time()
        mark = uuid.uuid4().hex
        _write_json(
            folder / "launch.json",
            {
                "rollout_id": key[0],
                "attempt_id": key[1],
                "agent": agent,
                "argv": argv,
                "started_at": started,
                "timeout_s": launch.timeout_s,
                "incarnation": launch.incarnation,
                "mark": mark,
            },
        )
        env = self._base_env()
        env.update(launch.env)
        env[ATTEMPT_MARK] = mark
        deadline = started + launch.timeout_s if launch.timeout_s else None
        # Before the agent can run: a controller killed while it starts must not leave it.
        self._hold(folder, mark)
        try:
            pid = await self._fork(agent, folder, env, deadline) if self.preload else None
        except _ZygoteTimeout:
            # The attempt's time went by while the zygote imported the agent's module.
            _write_exit(folder, "timeout")
            execution = _Execution(key, folder, 0, deadline, launch.timeout_s, launch.incarnation)
            self._execs[key] = execution
            self._end(execution, _timeout(execution))
            return f"not started: the agent's module was still being imported, log {folder}"
        except (_ZygoteFailed, OSError) as error:
            return self._not_started(launch, folder, deadline, error)
        if pid is not None:
            execution = _Execution(
                key, folder, pid, deadline, launch.timeout_s, launch.incarnation, mark=mark
            )
            self._execs[key] = execution
            execution.monitor = asyncio.create_task(self._watch_adopted(execution))
            return self._where(folder, pid)
        try:
            with (folder / "agent.log").open("ab") as output:
                process = await asyncio.create_subprocess_exec(
                    "/bin/sh",
                    "-c",
                    _WRAPPER,
                    "reins-agent",
                    str(folder),
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=output,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    cwd=self.workdir,
                    start_new_session=True,  # its own process group, killed whole
                    preexec_fn=self._preexec(),
                )
        except OSError as error:  # E2BIG, EMFILE, EAGAIN, a missing workdir
            return self._not_started(launch, folder, deadline, error)
        execution = _Execution(
            key, folder, process.pid, deadline, launch.timeout_s, launch.incarnation, process,
            mark=mark,
        )  # fmt: skip
        self._execs[key] = execution
        execution.monitor = asyncio.create_task(self._watch_child(execution, process))
        return self._where(folder, process.pid)

    def _not_started(
        self, launch: Launch, folder: Path, deadline: float | None, error: Exception
    ) -> str:
        """An attempt whose process could not be started: it ended, crashed, with the error
        (a failed attempt: retried up to max_attempts, not relaunched forever). `exit` says so,
        for a controller restarted before this one reported it."""
        detail = f"could not be started: {error}"
        with contextlib.suppress(OSError), (folder / "agent.log").open("a") as log:
            log.write(f"reins: the agent {detail}\n")
        with contextlib.suppress(OSError):
            _write_exit(folder, f"{_NOT_STARTED}{error}")
        key, incarnation = launch.key, launch.incarnation
        execution = _Execution(key, folder, 0, deadline, launch.timeout_s, incarnation)
        self._execs[key] = execution
        self._end(execution, Ended("crashed", None, detail))
        return f"not started ({error}), log {folder / 'agent.log'}"

    async def agent_log(self, key: Key) -> AgentLog:
        path = self.folder(key) / "agent.log"
        await asyncio.to_thread(_cap_log, path, self.log_max_bytes)  # since the last check
        return AgentLog(path=str(path), tail=_tail(path))

    async def remove(self, key: Key) -> None:
        execution = self._execs.pop(key, None)
        if execution is not None and execution.ended is None:
            await self._stop(execution, "stopped")

    # -- helpers ----------------------------------------------------------------------------

    async def _guard_logs(self) -> None:
        """Every `log_check_s`, cuts each running agent's log (and the zygotes' log) back once
        it passed `log_max_bytes`. The controller measures them rather than reading the output
        through a pipe: an agent outlives its controller (to be adopted by the next one), and
        would block or die on a pipe nobody reads. Not RLIMIT_FSIZE: it would limit every file
        the agent writes."""
        while True:
            await asyncio.sleep(self.log_check_s)
            logs = [e.folder / "agent.log" for e in self._execs.values() if e.ended is None]
            for path in [*logs, self.log_dir / "zygote.log"]:
                if _size(path) > self.log_max_bytes:  # a cut copies a quarter: not on the loop
                    await asyncio.to_thread(_cap_log, path, self.log_max_bytes)

    async def _fork(
        self, agent: str, folder: Path, env: Mapping[str, str], deadline: float | None
    ) -> int | None:
        """The pid of the agent forked from its zygote; None when it must run the plain way (a
        command line, or a module the zygote cannot load: the plain run reports why).

        The zygote's answer is awaited until the attempt's deadline (`_ZYGOTE_WAIT_S` without
        one): a module that hangs when imported would otherwise hold every launch of its agent.
        Past it the zygote is killed and the agent runs the plain way from then on (where a hang
        is an attempt's timeout like any other); raises `_ZygoteTimeout` when the attempt's own
        deadline passed."""
        if not _MODULE_FUNCTION.match(agent) or agent in self._unloadable:
            return None
        zygote = self._zygotes.get(agent)
        if zygote is None:
            zygote = self._zygotes[agent] = _Zygote(agent, self)
        wait_s = _ZYGOTE_WAIT_S if deadline is None else deadline - time.time()
        try:
            return await asyncio.wait_for(zygote.fork(folder, env), max(0.0, wait_s))
        except _CannotLoad:
            self._unloadable.add(agent)
            self._zygotes.pop(agent, None)
            return None
        except TimeoutError:
            self._unloadable.add(agent)
            if self._zygotes.get(agent) is zygote:
                del self._zygotes[agent]
            await zygote.kill()
            if deadline is None:
                return None
            raise _ZygoteTimeout(agent) from None

    def _preexec(self) -> Callable[[], None] | None:
        if not self.die_with_parent:
            return None
        parent, prctl = os.getpid(), pdeathsig_call()  # nothing is loaded after the fork
        return lambda: die_with_parent(parent, prctl)

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "REINS_API_KEY"}  # never the admin key
        env.update(self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")  # so the log tail is current when it ends
        return env

    def _where(self, folder: Path, pid: int | None = None) -> str:
        pid = pid or _read_int(folder / "pid")
        return f"pid {pid} on {self._host}, log {folder / 'agent.log'}"

    def folder(self, key: Key) -> Path:
        """Where one attempt's files are (rollout ids are URL-safe, so path-safe too)."""
        return self.log_dir / key[0] / f"attempt-{key[1]}"

    def _adopt(
        self, key: Key, folder: Path, pid: int, launched: Mapping[str, object]
    ) -> _Execution:
        timeout = launched.get("timeout_s")
        timeout_s = float(timeout) if isinstance(timeout, int | float) else None
        started = launched.get("started_at")
        deadline = (
            float(started) + timeout_s
            if timeout_s is not None and isinstance(started, int | float)
            else None
        )
        incarnation, mark = launched.get("incarnation"), launched.get("mark")
        execution = _Execution(
            key, folder, pid, deadline, timeout_s, str(incarnation) if incarnation else None,
            mark=str(mark) if mark else None,
        )  # fmt: skip
        self._execs[key] = execution
        self._hold(folder, execution.mark)
        execution.monitor = asyncio.create_task(self._watch_adopted(execution))
        return execution

    async def _watch_child(
        self, execution: _Execution, process: asyncio.subprocess.Process
    ) -> None:
        remaining = None if execution.deadline is None else execution.deadline - time.time()
        try:
            code = await asyncio.wait_for(process.wait(), remaining)
        except TimeoutError:
            own = await self._kill_group(execution)
            self._end(execution, own or _timeout(execution))
            return
        _kill_leftovers(execution)
        ended = _read_exit(execution.folder)
        if ended is None:
            # The wrapper itself died (a signal from outside): say so for a later controller.
            name = _signal_name(-code) if code < 0 else f"status {code}"
            _write_exit(execution.folder, f"signal {-code}" if code < 0 else str(code))
            ended = Ended("crashed", None if code < 0 else code, f"was killed ({name})")
        self._end(execution, ended)

    async def _watch_adopted(self, execution: _Execution) -> None:
        """Waits for a process that is not this one's child (forked by a zygote, or adopted).

        On Linux a pidfd says when it exits, at no cost while it runs; elsewhere (or where
        pidfds are refused) its pid is polled every `adopt_poll_s`, which for 64 agents in flight
        took a tenth of a core here (three /proc reads per poll)."""
        pidfd = _open_pidfd(execution.pid)
        try:
            while _alive(execution.pid, execution.folder):
                remaining = None
                if execution.deadline is not None:
                    remaining = execution.deadline - time.time()
                    if remaining <= 0:
                        own = await self._kill_group(execution)
                        self._end(execution, own or _timeout(execution))
                        return
                if pidfd is None:
                    await asyncio.sleep(self.adopt_poll_s)
                else:
                    await _readable(pidfd, remaining)
        finally:
            if pidfd is not None:
                os.close(pidfd)
        _kill_leftovers(execution)
        await _reaped(execution.pid, execution.folder)
        ended = _read_exit(execution.folder) or _lost(execution.pid, execution.folder)
        self._end(execution, ended)

    def _end(self, execution: _Execution, ended: Ended) -> None:
        execution.ended = ended
        self._release(execution)
        self._on_change()

    def _hold(self, folder: Path, mark: str | None) -> None:
        """With `die_with_parent`: the reaper kills this attempt's process group (and its marked
        processes) if this process ends before the attempt does, by SIGKILL too."""
        if self.die_with_parent:
            self._tell_reaper(["+", str(folder), mark])

    def _release(self, execution: _Execution) -> None:
        """The attempt ended: its group id may name another group one day, never to be killed."""
        if self.die_with_parent:
            self._tell_reaper(["-", str(execution.folder)])

    def _tell_reaper(self, message: list[str | None]) -> None:
        reaper = self._reaper
        if reaper is None or reaper.poll() is not None:
            # Its own session: a kill of this process's group (a terminal's Ctrl-C, a test's
            # killpg) must leave it to do its work. Its stdin is this process's only reference
            # to it: the kernel closes it when this process ends, however it ends.
            reaper = self._reaper = subprocess.Popen(
                [sys.executable, "-m", "reins.controller.reaper"],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        assert reaper.stdin is not None
        try:
            reaper.stdin.write(json.dumps(message).encode() + b"\n")
            reaper.stdin.flush()
        except OSError:  # it died: the next line starts another one
            self._reaper = None

    async def _stop(self, execution: _Execution, why: str) -> None:
        """Kills a running execution on the controller's behalf (not an outcome of its own)."""
        monitor = execution.monitor
        if monitor is not None and monitor is not asyncio.current_task():
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
        if execution.ended is None:
            own = await self._kill_group(execution)
            execution.ended = own or Ended("stopped", None, f"was {why} by the controller")
            self._release(execution)

    async def _kill_group(self, execution: _Execution) -> Ended | None:
        """SIGTERM to the whole group and the attempt's processes outside it, SIGKILL once they
        are all gone or after the grace period; records why in `exit`, unless the agent had
        recorded its own outcome before the SIGTERM (it ended as it was stopped: its outcome
        stands, and is returned; a stop or a timeout written over it ran it again)."""
        own = _read_exit(execution.folder)
        _killpg(execution.pid, signal.SIGTERM)
        signal_marked(execution.mark, signal.SIGTERM, execution.pid)
        deadline = time.monotonic() + self.kill_grace_s
        process = execution.process
        # The grace is the agent's, not its `sh` wrapper's: sh dies of the SIGTERM at once,
        # while the agent (and whatever left the group) may still be cleaning up.
        while time.monotonic() < deadline:
            if process is not None and process.returncode is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(process.wait(), 0.05)
            elif not _group_exists(execution.pid) and not _marked_alive(execution):
                break
            else:
                await asyncio.sleep(0.05)
        _kill_leftovers(execution)
        if process is not None:
            await process.wait()
        # SIGKILL is delivered, not yet acted on: let the group die before saying it is dead.
        for _ in range(100):
            if not _group_exists(execution.pid) and not _marked_alive(execution):
                break
            await asyncio.sleep(0.01)
        if own is not None:
            return own
        is_timeout = execution.deadline is not None and time.time() >= execution.deadline
        _write_exit(execution.folder, "timeout" if is_timeout else "stopped")
        return None


def _kill_leftovers(execution: _Execution) -> None:
    """SIGKILL to what is left of the attempt: its process group, and its processes that left
    the group (`reins.controller.marks`)."""
    _killpg(execution.pid, signal.SIGKILL)
    signal_marked(execution.mark, signal.SIGKILL, execution.pid)


def _marked_alive(execution: _Execution) -> bool:
    return bool(execution.mark and marked_processes(execution.mark))


def _timeout(execution: _Execution) -> Ended:
    return Ended("timeout", None, f"timed out after {execution.timeout_s:g} s")


def _read_exit(folder: Path) -> Ended | None:
    """The outcome recorded in `exit`, or None while there is none."""
    try:
        text = (folder / "exit").read_text().strip()
    except OSError:
        return None
    if not text:
        return None  # being written
    if text == "timeout":
        launched = _read_json(folder / "launch.json") or {}
        return Ended("timeout", None, f"timed out after {launched.get('timeout_s')} s")
    if text == "stopped":
        return Ended("stopped", None, "was stopped by the controller's shutdown")
    if text.startswith("signal "):
        return Ended("crashed", None, f"was killed ({_signal_name(int(text.split()[1]))})")
    if text.startswith(_NOT_STARTED):
        return Ended("crashed", None, f"could not be started: {text.removeprefix(_NOT_STARTED)}")
    code = int(text)
    if code == 0:
        return Ended("succeeded", 0, "exited with status 0")
    return Ended("crashed", code, f"exited with status {code}")


def _lost(pid: int, folder: Path) -> Ended:
    """An agent that is gone without an `exit` file."""
    detail = f"process (pid {pid}) is gone and left no exit status"
    if _read_text(folder / "pid.start"):
        # A forked agent that could not write `exit` gets it from its zygote, the only process
        # that sees how it ended; the zygote waits for its agents unless killed itself.
        detail += "; its zygote, which alone could see how it ended, was gone before it"
    return Ended("lost", None, detail)


def _write_exit(folder: Path, text: str) -> None:
    tmp = folder / "exit.tmp"
    tmp.write_text(text + "\n")
    tmp.replace(folder / "exit")


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of `pid` (readable once it has exited), or None where there is none.

    Opened before `_alive` checks the pid's identity, so a reused pid cannot slip in between."""
    open_pidfd = getattr(os, "pidfd_open", None)
    if open_pidfd is None:
        return None
    try:
        fd: int = open_pidfd(pid)
    except OSError:  # gone already (then `_alive` says so), or pidfds refused: poll instead
        return None
    return fd


async def _readable(fd: int, timeout_s: float | None) -> None:
    """Returns when `fd` is readable or after `timeout_s`, whichever comes first."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await asyncio.wait_for(ready, timeout_s)
    except TimeoutError:
        pass
    finally:
        loop.remove_reader(fd)


def _alive(pid: int, folder: Path) -> bool:
    """Whether `pid` is still the wrapper of this attempt (pids are reused, folders are not)."""
    proc = Path(f"/proc/{pid}")
    if not Path("/proc/self").exists():  # not Linux: trust the pid
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        stat = (proc / "stat").read_text()
        cmdline = (proc / "cmdline").read_bytes()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()
    if fields[0] == "Z":
        return False
    started = _read_text(folder / "pid.start")
    if started:  # forked by a zygote: same cmdline as its parent; the start time tells it apart
        return fields[19] == started
    return str(folder).encode() in cmdline.split(b"\0")


async def _reaped(pid: int, folder: Path) -> None:
    """Returns once an ended agent has its `exit` file or is reaped (bounded).

    A zygote's child that ended through os._exit or a signal gets its `exit` from the zygote,
    written before the zygote reaps it: while it is a zombie, the file may be on its way."""
    for _ in range(_ZOMBIE_WAITS):
        if _read_exit(folder) is not None or not _zombie(pid, folder):
            return
        await asyncio.sleep(0.01)


def _zombie(pid: int, folder: Path) -> bool:
    """Whether `pid` is this attempt's zygote-forked agent, ended and not yet reaped."""
    started = _read_text(folder / "pid.start")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return False
    return bool(started) and fields[0] == "Z" and fields[19] == started


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


class _CannotLoad(Exception):
    """The zygote cannot import the agent (its log says why)."""


class _ZygoteFailed(Exception):
    """The zygote could not fork this attempt (EAGAIN, or it died twice): a failed attempt."""


class _ZygoteTimeout(Exception):
    """The attempt's deadline passed before the zygote answered (its import hangs, say)."""


class _Zygote:
    """One `reins.controller.zygote` process per agent: forks a child per attempt."""

    def __init__(self, agent: str, owner: LocalReconciler) -> None:
        self.agent = agent
        self.owner = owner
        self.process: asyncio.subprocess.Process | None = None
        self.lock = asyncio.Lock()
        self.killed = False

    async def fork(self, folder: Path, env: Mapping[str, str]) -> int:
        request = json.dumps(
            {"folder": str(folder), "env": dict(env), "cwd": str(self.owner.workdir)}
        )
        async with self.lock:  # one request, one answer, in order
            for _ in range(2):  # a zygote that died is started again once
                if self.killed:  # for hanging (`LocalReconciler._fork`): run the plain way
                    raise _CannotLoad(self.agent)
                process = await self._process()
                assert process.stdin is not None and process.stdout is not None
                try:
                    process.stdin.write(request.encode() + b"\n")
                    await process.stdin.drain()
                    line = await process.stdout.readline()
                except (BrokenPipeError, ConnectionResetError):
                    line = b""
                if line:
                    answer = json.loads(line)
                    if "pid" not in answer:
                        raise _ZygoteFailed(
                            f"the agent's zygote could not fork: {answer.get('error')}"
                        )
                    return int(answer["pid"])
                await process.wait()
                self.process = None
                if process.returncode == 2:
                    raise _CannotLoad(self.agent)
                forked = _read_text(folder / "pid")
                if forked is not None and forked.isdigit():
                    # It died after the fork, before its answer: the agent runs (or ran);
                    # a second zygote would start the attempt twice.
                    return int(forked)
            log = self.owner.log_dir / "zygote.log"
            raise _ZygoteFailed(
                f"the zygote of agent {self.agent!r} exited ({process.returncode}); its log "
                f"{log} ends: {_tail(log)[-1000:]}"
            )

    async def _process(self) -> asyncio.subprocess.Process:
        if self.process is None or self.process.returncode is not None:
            self.owner.log_dir.mkdir(parents=True, exist_ok=True)
            with (self.owner.log_dir / "zygote.log").open("ab") as log:
                self.process = await asyncio.create_subprocess_exec(
                    self.owner.python,
                    "-m",
                    "reins.controller.zygote",
                    self.agent,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log,
                    env=self._env(),
                    cwd=self.owner.workdir,
                    start_new_session=True,  # a Ctrl-C at the controller's terminal is ours
                )
        return self.process

    def _env(self) -> dict[str, str]:
        env = self.owner._base_env()
        env[ATTEMPT_MARK] = MARK_PLACEHOLDER  # room for each child's own (`mark_start_environ`)
        if self.owner.die_with_parent:
            env[DIE_WITH_PARENT] = "1"
            env[DIE_WITH_PARENT + "_PID"] = str(os.getpid())
        return env

    async def kill(self) -> None:
        """Kills the zygote and what its import started (its process group), at once."""
        self.killed = True
        process = self.process
        if process is None or process.returncode is not None:
            return
        _killpg(process.pid, signal.SIGKILL)
        await process.wait()

    async def close(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 5)
        except TimeoutError:
            process.kill()
            await process.wait()


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tail(path: Path) -> str:
    """The last `TAIL_BYTES` of the agent's log; '' when it is no regular file. The harness
    can write its folder: a log it replaced by a link (to `/dev/zero`, or a host file whose end
    would go into an event) or a FIFO (the open waited forever) is not read, and the read is
    bounded (the agent may still be appending: an unbounded `read()` took all of it)."""
    from stat import S_ISREG  # here: `stat` names a local variable elsewhere in this module

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # missing, or a link
        return ""
    try:
        with open(fd, "rb") as file:
            status = os.fstat(file.fileno())
            if not S_ISREG(status.st_mode):
                return ""
            file.seek(max(0, status.st_size - TAIL_BYTES))
            return file.read(TAIL_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _size(path: Path) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except OSError:
        return 0


_CUTTING = threading.Lock()
"""One cut at a time (the guard's and an ended attempt's, in worker threads)."""


def _cap_log(path: Path, max_bytes: int) -> None:
    """Cuts the log at `path` back to its first and last quarters of `max_bytes`, with a note in
    place of the middle, once it is larger than `max_bytes`; nothing else (a link, a FIFO: as in
    `_tail`, what the agent put there is not followed).

    Its writers append (O_APPEND: the wrapper's output, the zygote's children, `_not_started`),
    so each write after the cut lands at the new end. What is written while the cut is made is
    copied after the tail, but output written between the last copy and the truncation
    (microseconds) is lost with the middle, uncounted."""
    if _size(path) <= max_bytes:
        return  # the usual case: one stat
    with _CUTTING:
        _cut(path, max_bytes)


def _cut(path: Path, max_bytes: int) -> None:
    from stat import S_ISREG

    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    try:
        status = os.fstat(fd)
        if not S_ISREG(status.st_mode) or status.st_size <= max_bytes:
            return
        keep = max_bytes // 4
        size = status.st_size
        # A log cut before has its note where the middle starts: the count goes on from it.
        earlier = _LOG_NOTE.match(os.pread(fd, 300, keep))
        left_out = size - 2 * keep
        if earlier is not None:
            left_out += int(earlier[1]) - len(earlier[0])
        note = (
            f"\n[reins: {left_out} bytes of the agent's output left out here: this log is "
            f"kept under {max_bytes} bytes, its first and last {keep}]\n"
        ).encode()
        tail = os.pread(fd, keep, size - keep)
        end = keep + len(note) + len(tail)
        os.pwrite(fd, note + tail, keep)
        for _ in range(3):  # what the agent wrote meanwhile follows the tail
            grown = os.fstat(fd).st_size
            if grown <= size:
                break
            end += os.pwrite(fd, os.pread(fd, grown - size, size), end)
            size = grown
        os.ftruncate(fd, end)
    except OSError:
        return
    finally:
        os.close(fd)


_LOG_NOTE = re.compile(rb"\n\[reins: (\d+) bytes of the agent's output left out here: [^\n]*\]\n")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_json(path: Path) -> dict[str, object] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_json(path: Path, value: Mapping[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)
