"""Per-rollout isolation for agent commands: bubblewrap namespaces plus cgroup and rlimit caps.

A `Sandbox` owns one host folder, seen inside as /work (the cwd and HOME). Each `run` is one
`bwrap` invocation with its own mount, PID, network, IPC, UTS and user namespaces and no
capabilities. What it keeps, for every command:

- the file system is read-only /usr (and the /bin, /lib symlinks), a few /etc files python3
  needs, fresh /tmp, /proc and /dev, the folder, and the `mounts` asked for (a harness's own
  installation read-only, a home of its own): no host home, repository or other sandbox;
- the network is the command's own loopback: no host 127.0.0.1 servers, no DNS, no internet;
  `relays` open one door each: a port of that loopback relayed to a Unix socket of the host, whose
  server decides what passes (`reins.sandbox.gateway`: one attempt's proxy paths of the gateway);
- the environment is built here (PATH, HOME, LANG, and what `run(env=...)` adds), so no host
  secret is inherited;
- when the command's shell exits, bwrap's init exits and the kernel kills everything left in the
  PID namespace, so no background process outlives its `run`;
- limits: wall clock (we kill the process group and the cgroup's tasks), CPU seconds and file
  size (rlimits set inside, hard limits cannot be raised without capabilities), memory and
  process count (a per-sandbox cgroup, v1 or v2; reaching the process limit ends the command).
  Without a writable cgroup memory falls back to RLIMIT_AS and the process count is bounded
  only by the wall and CPU limits, which is logged, never silent;
- output is read as it comes and only a head and a tail are kept, so `run` never fills memory,
  and it returns within the wall limit plus a few seconds whatever the command does.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import logging
import math
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger("reins.sandbox")

# What python3, bash and coreutils need from /etc (no shadow, no resolv.conf: no DNS inside).
_ETC = (
    "ld.so.cache ld.so.conf ld.so.conf.d alternatives localtime hosts nsswitch.conf passwd group "
    "ssl ca-certificates"  # public CA certificates: a TLS client fails on the network, not before
)
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8", "USER": "root"}
_KILLED = (128 + signal.SIGKILL, -signal.SIGKILL)
"""The command's status when its own last process was SIGKILLed (by the kernel's OOM killer):
bash's and bwrap's 137, or Popen's -9."""
_GRACE_S = 5.0  # after a kill: how long to wait for the pipe to close and the process to go


class SandboxError(RuntimeError):
    """A sandbox cannot be set up here; the message says what to install or change."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 20.0
    """Wall-clock seconds per command."""
    cpu_s: int = 20
    """CPU seconds per process of a command (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Memory of the sandbox's processes together (cgroup; RLIMIT_AS per process without one)."""
    processes: int = 64
    """Tasks (processes and threads) alive at once in the sandbox; reaching it ends the command."""
    file_mb: int = 32
    """Largest file a command may write (RLIMIT_FSIZE)."""
    output_chars: int = 8000
    """Output kept per command: head and tail, the middle elided with a note."""

    def __post_init__(self) -> None:
        _check_wall(self.wall_s, "wall_s")


def _check_wall(seconds: float, name: str) -> None:
    """A wall limit is a finite number of seconds above 0: NaN compared false with every time
    spent, so a command ran on with no wall limit at all."""
    if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name} must be a finite number of seconds above 0, not {seconds!r}")


@dataclass(frozen=True)
class Mount:
    """A host path shown inside the sandbox (at the same path unless `inside` says otherwise)."""

    host: Path
    inside: str | None = None
    writable: bool = False

    @property
    def target(self) -> str:
        return self.inside or str(Path(self.host).resolve())


_RELAY_SCRIPT = Path(__file__).with_name("relay.py")
_RELAY_DIR = "/run/reins"  # inside: the relay script and the relays' Unix sockets


@dataclass(frozen=True)
class CommandResult:
    exit_code: int | None
    """The command's exit status; None when a limit (or `close`) killed it."""
    output: str
    """stdout and stderr interleaved, truncated to `output_chars`, with a note when killed."""
    limit: str | None
    """"wall time" | "cpu time" | "memory" | "processes" | "file size" | None."""
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None


def _bwrap() -> str | None:
    return shutil.which("bwrap") or (
        "/usr/bin/bwrap" if os.access("/usr/bin/bwrap", os.X_OK) else None
    )


@cache
def sandbox_problem() -> str | None:
    """Why sandboxes cannot run on this machine, or None."""
    if not sys.platform.startswith("linux"):
        return f"sandboxes need Linux namespaces; this is {sys.platform}"
    bwrap = _bwrap()
    if bwrap is None:
        return "bwrap not found: install Debian's bubblewrap (apt-get install bubblewrap)"
    with tempfile.TemporaryDirectory() as folder:
        argv = [bwrap, *_mounts(Path(folder)), "--", "/bin/true"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        return (
            f"bwrap cannot create namespaces here ({done.stderr.strip()}): run as root or "
            "allow user namespaces (sysctl kernel.unprivileged_userns_clone=1)"
        )
    return None


def _mounts(
    folder: Path,
    hidden: tuple[str, ...] = (),
    disabled: Path | None = None,
    mounts: tuple[Mount, ...] = (),
    relays: tuple[tuple[int, Path], ...] = (),
) -> list[str]:
    # --cap-drop ALL: bwrap run by root keeps every capability in the sandbox unless told not to.
    args = ["--unshare-all", "--cap-drop", "ALL", "--die-with-parent", "--new-session"]
    args += ["--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        top = Path("/") / name
        if top.is_symlink():
            args += ["--symlink", os.readlink(top), str(top)]
        elif top.is_dir():
            args += ["--ro-bind", str(top), str(top)]
    for name in _ETC.split():
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    args += ["--bind", str(folder), "/work", "--chdir", "/work", "--clearenv"]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    # The command is uid 0 without capabilities: enough to write most of /proc/sys (global
    # kernel settings: core_pattern, drop_caches...), which bwrap leaves writable once the
    # capabilities are dropped (its own check then reads the folder as read-only already).
    args += ["--ro-bind", "/proc/sys", "/proc/sys"]
    args += ["--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger"]
    for mount in mounts:
        args += ["--bind" if mount.writable else "--ro-bind", str(mount.host), mount.target]
    if relays:
        args += ["--ro-bind", str(_RELAY_SCRIPT), f"{_RELAY_DIR}/relay.py"]
        for port, socket_path in relays:
            args += ["--bind", str(socket_path), f"{_RELAY_DIR}/{port}.sock"]
    for path in hidden:
        # An empty folder over a folder, an empty file over a file: gone from the inside.
        args += ["--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]
    if disabled is not None:
        for stub in sorted(disabled.iterdir()):
            for place in _command_paths(stub.name):
                args += ["--ro-bind", str(stub), place]
    for key, value in _ENV.items():
        args += ["--setenv", key, value]
    return args


def _command_paths(name: str) -> list[str]:
    """Where a command `name` of the host is visible inside: its files on the PATH (the /bin
    links lead into /usr, so /usr is where they are)."""
    places = []
    for folder in ("/usr/local/bin", "/usr/bin", "/usr/local/sbin", "/usr/sbin"):
        if os.path.lexists(f"{folder}/{name}"):
            places.append(f"{folder}/{name}")
    return places


_COMMAND_FILE = "/run/reins-command.sh"
"""Inside: a command too long to be an argument (`_LONGEST_ARGUMENT`), run from a file."""
_LONGEST_ARGUMENT = 128 * 1024
"""Linux's cap on one argument's bytes (MAX_ARG_STRLEN): a longer command string was an
OSError ("Argument list too long") out of `run`."""
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _unfit(text: str, what: str) -> str | None:
    """Why `text` cannot reach a shell, or None."""
    if "\0" in text:
        return f"the {what} holds a NUL byte, which no shell command or input can carry"
    try:
        text.encode()
    except UnicodeEncodeError as error:
        return f"the {what} holds {text[error.start : error.end]!r}, which has no UTF-8 form"
    return None


_STUBS_PREFIX = "reins-sandbox-stubs-"


def _remove_stale_stubs() -> None:
    """The stub folders of processes that died without `close()` (as their cgroups are)."""
    for stale in Path(tempfile.gettempdir()).glob(f"{_STUBS_PREFIX}*"):
        pid = stale.name.removeprefix(_STUBS_PREFIX).split("-")[0]
        if not pid.isdigit():
            continue  # made before the folders were named by their process
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except OSError:  # alive, another user's
            pass


_DISABLED_STUB = """#!/bin/sh
echo "{name}: disabled in this sandbox (reins)" >&2
exit 126
"""


_REMOVED = (errno.ENOENT, errno.ENODEV)
"""What reading a file of a cgroup folder that a concurrent close() removes answers: ENODEV
("No such device") while it is being removed, then ENOENT."""


def _counter(path: Path, key: str) -> int:
    """The `key N` line of a cgroup events file (0 if absent)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        # Removed by a concurrent close().
        if error.errno in _REMOVED:
            return 0
        raise
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


class _Cgroups:
    """The sandbox's memory and pids cgroups: two v1 groups, or one v2 group with both."""

    PREFIX = "reins-sandbox-"

    def __init__(self, memory: Path, pids: Path, v2: bool) -> None:
        self.memory, self.pids, self.v2 = memory, pids, v2
        self.dirs = [memory] if v2 else [memory, pids]

    @classmethod
    def create(cls, limits: SandboxLimits) -> _Cgroups:
        """Raises OSError when no writable cgroup with memory and pids controllers exists."""
        own: dict[str, str] = {}  # controller -> our own group, to nest under it
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            own.update(dict.fromkeys(controllers.split(","), path))
        root, bytes_ = Path("/sys/fs/cgroup"), limits.memory_mb * 1024 * 1024

        def parent(mount: Path, controller: str) -> Path:
            base = mount / own.get(controller, "/").lstrip("/")
            base = base if base.is_dir() else mount
            for stale in base.glob(f"{cls.PREFIX}*"):  # left by a process that died unclosed
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(stale.name.split("-")[2]), 0)
                    continue
                with contextlib.suppress(OSError):
                    stale.rmdir()
            return base

        name = f"{cls.PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if (root / "memory" / "tasks").exists() and (root / "pids" / "tasks").exists():
            memory, pids = parent(root / "memory", "memory"), parent(root / "pids", "pids")
            group = cls(memory / name, pids / name, v2=False)
            settings = {"memory.limit_in_bytes": bytes_, "memory.memsw.limit_in_bytes": bytes_}
        elif (root / "cgroup.controllers").exists():
            base = parent(root, "")  # v2 lists our group as "0::/path"
            (base / "cgroup.subtree_control").write_text("+memory +pids")
            group = cls(base / name, base / name, v2=True)
            settings = {"memory.max": bytes_, "memory.swap.max": 0}
        else:
            raise OSError("neither cgroup v1 memory and pids hierarchies nor cgroup v2 is mounted")
        for folder in group.dirs:
            folder.mkdir()
        try:
            for key, value in settings.items():
                if (group.memory / key).exists():  # the swap files need swap accounting
                    (group.memory / key).write_text(str(value))
            (group.pids / "pids.max").write_text(str(limits.processes))
        except OSError:
            group.remove()
            raise
        return group

    def procs_files(self) -> list[str]:
        return [str(folder / "cgroup.procs") for folder in self.dirs]

    def oom_kills(self) -> int:
        return _counter(
            self.memory / ("memory.events" if self.v2 else "memory.oom_control"), "oom_kill"
        )

    def process_limit_hits(self) -> int:
        return _counter(self.pids / "pids.events", "max")

    def kill(self) -> None:
        for folder in self.dirs:
            pids: list[str] = []
            try:
                pids = (folder / "cgroup.procs").read_text().split()
            except OSError as error:  # a group a concurrent close() removes has no tasks
                if error.errno not in _REMOVED:
                    raise
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    def remove(self) -> None:
        """Kill what is left and remove the groups (waiting briefly for killed tasks to exit)."""
        deadline = time.monotonic() + _GRACE_S
        for folder in self.dirs:
            while folder.exists():
                self.kill()
                try:
                    folder.rmdir()
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: killed tasks are still exiting
                    if time.monotonic() > deadline:
                        log.warning("cgroup %s still busy; left behind", folder)
                        break
                    time.sleep(0.01)


class _Output:
    """Keeps the head and the tail of a stream, dropping the middle as it passes."""

    def __init__(self, chars: int) -> None:
        self.chars, self.cap = chars, 4 * chars  # bytes: a character is up to 4 bytes of UTF-8
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        take = max(0, self.cap - len(self.head))
        self.head += chunk[:take]
        self.tail += chunk[take:]
        if len(self.tail) > self.cap:  # (`del tail[:-0]` would keep it all)
            del self.tail[: len(self.tail) - self.cap]

    def text(self) -> str:
        note = f"\n[... output truncated: {self.total} bytes in all, the middle left out ...]\n"
        half = self.chars // 2
        if self.total == len(self.head) + len(self.tail):  # nothing dropped
            whole = (self.head + self.tail).decode(errors="replace")
            if len(whole) <= self.chars:
                return whole
            return whole[:half] + note + whole[max(0, len(whole) - half) :]
        # The byte caps may cut a character: a head's last and a tail's first partial ones are
        # left out, not shown as U+FFFD.
        head = codecs.getincrementaldecoder("utf-8")("replace").decode(bytes(self.head))
        start = next((i for i in range(min(4, len(self.tail))) if self.tail[i] & 0xC0 != 0x80), 0)
        tail = self.tail[start:].decode(errors="replace")
        return head[:half] + note + tail[max(0, len(tail) - half) :]


class Sandbox:
    """One rollout's isolated folder; commands run in it with `run`. A context manager."""

    def __init__(
        self,
        folder: Path,
        limits: SandboxLimits = SandboxLimits(),
        *,
        disabled_commands: Sequence[str] = (),
        hidden_paths: Sequence[str] = (),
        mounts: Sequence[Mount] = (),
        relays: Mapping[int, Path] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`disabled_commands`: commands of the host (say `git`) replaced inside by one that
        prints `NAME: disabled in this sandbox (reins)` to stderr and exits 126.
        `hidden_paths`: absolute paths of the host's read-only tree shown empty inside (say
        /usr/lib/git-core, where git's own programs are).
        `mounts`: host paths shown inside, read-only unless `writable`.
        `relays`: {port: Unix socket}: before each command, `127.0.0.1:port` inside starts
        listening and relays each connection to that socket of the host (needs python3 in /usr);
        nothing else of the network is reachable.
        `env`: variables for every command (a task image's PATH), under each run's own."""
        problem = sandbox_problem()
        if problem:
            raise SandboxError(problem)
        self.path = Path(folder).resolve()
        self.path.mkdir(parents=True, exist_ok=True)
        self.limits = limits
        self.hidden_paths = tuple(p for p in hidden_paths if os.path.lexists(p))
        for mount in mounts:
            if not os.path.lexists(mount.host):
                raise SandboxError(f"cannot mount {mount.host} in the sandbox: it does not exist")
            if not mount.target.startswith("/"):
                raise ValueError(f"{mount.target!r} is not an absolute path inside the sandbox")
        self.mounts = tuple(mounts)
        self.env = dict(env or {})
        self.relays = tuple((int(port), Path(path)) for port, path in (relays or {}).items())
        if self.relays and not os.access("/usr/bin/python3", os.X_OK):
            raise SandboxError("relays run /usr/bin/python3 inside the sandbox: install python3")
        self._stubs: Path | None = None
        for name in disabled_commands:
            if not name or "/" in name:
                raise ValueError(f"{name!r} is not a command name")
        if disabled_commands:
            _remove_stale_stubs()
            self._stubs = Path(tempfile.mkdtemp(prefix=f"{_STUBS_PREFIX}{os.getpid()}-"))
            for name in disabled_commands:
                stub = self._stubs / name
                stub.write_text(_DISABLED_STUB.format(name=name))
                stub.chmod(0o755)
        self._running: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        # One command at a time: a second one running beside it was killed with it at its
        # wall limit and blamed for its memory (they share the cgroups).
        self._one_run = threading.Lock()
        self._closed = False
        self._cgroups: _Cgroups | None = None
        try:
            self._cgroups = _Cgroups.create(limits)
        except OSError as error:
            log.warning(
                "sandbox %s has no cgroup (%s): memory is capped per process by RLIMIT_AS, "
                "the process count only by the wall and CPU limits",
                *(self.path, error),
            )

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _argv(self, command: str, env: Mapping[str, str], script: Path | None) -> list[str]:
        limits, group = self.limits, self._cgroups
        # Set inside, after bwrap dropped the capabilities, so the hard limits cannot be raised;
        # the soft CPU limit sends SIGXCPU a second before the hard one kills.
        ulimits = f"ulimit -c 0 -f {limits.file_mb * 1024} -t {limits.cpu_s + 1}"
        if group is None:
            ulimits += f" -v {limits.memory_mb * 1024}"
        start = 'exec /bin/bash -c "$1"' if script is None else f"exec /bin/bash {_COMMAND_FILE}"
        if self.relays:
            doors = " ".join(f"{port}={_RELAY_DIR}/{port}.sock" for port, _ in self.relays)
            start = f"/usr/bin/python3 -I -S {_RELAY_DIR}/relay.py {doors} && {start}"
        inner = f"{ulimits} && ulimit -S -t {limits.cpu_s} && {start}"
        mounts = _mounts(self.path, self.hidden_paths, self._stubs, self.mounts, self.relays)
        for key, value in env.items():
            mounts += ["--setenv", key, value]
        if script is not None:
            mounts += ["--ro-bind", str(script), _COMMAND_FILE]
        argv = [_bwrap() or "bwrap", *mounts, "--", "/bin/bash", "-c", inner]
        argv += ["sandbox", "" if script is not None else command]
        if group is None:
            return argv
        # Join the cgroups before exec'ing bwrap, so every process of the command starts in them.
        join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", join, "sh", *group.procs_files(), "--", *argv]

    def run(
        self,
        command: str,
        *,
        stdin: str | None = None,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run bash `command` in /work, with `env` added to the sandbox's few variables; never
        raises for the command's own failure (one no shell can take, with a NUL byte or an
        unpaired surrogate, is answered exit code 2 and says so). One command at a time: a
        second call waits for the first."""
        if timeout_s is not None:
            _check_wall(timeout_s, "timeout_s")
        env = {**self.env, **(env or {})}
        for key, value in env.items():
            if not _ENV_NAME.fullmatch(key) or "\0" in value:
                raise ValueError(f"{key!r}={value!r} is not an environment variable")
        with self._one_run:
            if self._closed:
                raise SandboxError(f"sandbox {self.path} is closed")
            unfit = _unfit(command, "command") or _unfit(stdin or "", "stdin")
            if unfit:
                return CommandResult(2, f"[not run: {unfit}]", None, 0.0)
            with tempfile.TemporaryDirectory(prefix="reins-command-") as scratch:
                script = None
                if len(command) > _LONGEST_ARGUMENT // 4:  # its bytes may pass the cap
                    script = Path(scratch) / "command.sh"
                    script.write_text(command)
                try:
                    return self._run(command, stdin, timeout_s, env, script)
                finally:
                    self._strip_setuid()

    def _strip_setuid(self) -> None:
        """Setuid and setgid bits off every file of the folder: the command runs as the host's
        root, and `chmod u+s` on a copy of a program left a root program on the host for any
        user who can reach the folder. Nothing of the sandbox runs any more at this point."""
        folders: list[str | Path] = [self.path]
        while folders:
            with contextlib.suppress(OSError), os.scandir(folders.pop()) as entries:
                for entry in entries:
                    with contextlib.suppress(OSError):
                        mode = entry.stat(follow_symlinks=False).st_mode
                        if stat.S_ISLNK(mode):
                            continue
                        setuid = stat.S_ISUID | stat.S_ISGID
                        if mode & setuid:
                            os.chmod(entry.path, stat.S_IMODE(mode) & ~setuid)
                        if stat.S_ISDIR(mode):
                            folders.append(entry.path)

    def _run(
        self,
        command: str,
        stdin: str | None,
        timeout_s: float | None,
        env: Mapping[str, str],
        script: Path | None,
    ) -> CommandResult:
        limits, group = self.limits, self._cgroups
        wall = limits.wall_s if timeout_s is None else timeout_s
        oom0 = group.oom_kills() if group else 0
        hits0 = group.process_limit_hits() if group else 0
        out = _Output(limits.output_chars)
        start = time.monotonic()
        with tempfile.TemporaryFile() as stdin_file:  # a file, so no writer thread can block
            stdin_file.write((stdin or "").encode())
            stdin_file.seek(0)
            proc = subprocess.Popen(
                self._argv(command, env, script),
                stdin=stdin_file, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env={}, start_new_session=True,
            )  # fmt: skip
        with self._lock:
            self._running.add(proc)
        killed, killed_at, eof = None, 0.0, False
        assert proc.stdout is not None
        try:
            while True:
                now = time.monotonic()
                if killed is None:
                    if self._closed:  # first: close() removes the cgroups read below
                        killed = "closed"
                    elif now - start >= wall:
                        killed = "wall time"
                    elif group and group.process_limit_hits() > hits0:
                        killed = "processes"  # a fork bomb would otherwise spin to the wall limit
                    if killed:
                        killed_at = now
                        self._kill(proc)
                elif now - killed_at > _GRACE_S:
                    break  # something still holds the pipe: give up on the rest of the output
                if eof:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=0.05)
                        break
                elif select.select([proc.stdout], [], [], 0.05)[0]:
                    chunk = os.read(proc.stdout.fileno(), 1 << 16)
                    out.add(chunk)
                    eof = not chunk
        finally:
            proc.stdout.close()
            if proc.poll() is None:
                self._kill(proc)
            proc.wait()
            with self._lock:
                self._running.discard(proc)
        seconds, code, text = time.monotonic() - start, proc.returncode, out.text()
        limit = killed
        if limit is None and group is not None and group.oom_kills() > oom0:
            limit = "memory"
        elif limit is None and group is not None and group.process_limit_hits() > hits0:
            limit = "processes"  # a backgrounded fork bomb whose shell exited before we looked
        elif limit is None and code in (128 + signal.SIGXCPU, 128 + signal.SIGXFSZ):
            limit = "cpu time" if code == 128 + signal.SIGXCPU else "file size"
        if limit is None:
            return CommandResult(code, text, None, seconds)
        size = {"wall time": f"{wall:g} s", "cpu time": f"{limits.cpu_s} s", "closed": "",
                "memory": f"{limits.memory_mb} MB", "processes": str(limits.processes),
                "file size": f"{limits.file_mb} MB"}  # fmt: skip
        # The memory and process limits are seen in the cgroup's counters, which also count a
        # child the kernel ended while the command's shell ran on to an exit of its own
        # (`python3 big.py; echo $?`): that command was not killed, and its code is its own.
        ran_on = killed is None and limit in ("memory", "processes") and code not in _KILLED
        if ran_on:
            what = "a process of it was killed" if limit == "memory" else "a fork was refused"
            note = f"[{limit} limit {size[limit]} reached ({what}); the command ran on]"
        elif size[limit]:
            note = f"[killed: {limit} limit {size[limit]}]"
        else:
            note = "[killed: sandbox closed]"
        output = f"{text}\n{note}" if text else note
        return CommandResult(
            code if ran_on else None, output, None if limit == "closed" else limit, seconds
        )

    def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):  # bwrap; --die-with-parent takes its init
            os.killpg(proc.pid, signal.SIGKILL)
        group = self._cgroups  # read once: a concurrent close() sets it to None
        if group is not None:
            group.kill()

    def _inside(self, relative: str) -> Path:
        """`relative` resolved within the folder; refuses absolute paths, `..` and symlinks out."""
        target = (self.path / relative).resolve()
        if os.path.isabs(relative) or not target.is_relative_to(self.path):
            raise ValueError(f"{relative!r} is outside the sandbox folder {self.path}")
        return target

    def _open(self, relative: str, flags: int, *, create_parents: bool = False) -> int:
        """A descriptor of the regular file `relative` in the folder (`flags`: os.open's).

        Resolved once (`_inside`), then walked a folder at a time from the folder's own
        descriptor without following any link: a command running meanwhile may swap a folder
        for a symlink (a host read of `d/x` read a host file 4 times in 10), and an open that
        followed it would leave the folder. A FIFO or a device is refused, not waited on."""
        unfit = _unfit(relative, "path")
        if unfit:
            raise ValueError(f"{unfit}: no file is named so")
        target = self._inside(relative)
        *parents, name = target.relative_to(self.path).parts or ("",)
        if not name:
            raise ValueError(f"{relative!r} is the sandbox folder itself, not a file in it")
        folder = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parents:
                if create_parents:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=folder)
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
                os.close(folder)
                folder = inner
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=folder)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
                raise ValueError(
                    f"{relative!r} changed into a link, or is not a regular file, while it was "
                    f"opened in the sandbox folder {self.path}"
                ) from error
            raise
        finally:
            os.close(folder)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(f"{relative!r} in the sandbox folder is not a regular file")
        return fd

    def write_file(self, relative: str, content: str) -> None:
        """Write `content` to `relative` in the folder (host side), creating parent folders."""
        try:
            # Encoded before the file is opened: content with no UTF-8 form (a lone surrogate
            # from a model's JSON) failed after the truncation and left the file empty.
            data = content.encode()
        except UnicodeEncodeError as error:
            bad = content[error.start : error.end]
            raise ValueError(f"the content holds {bad!r}, which has no UTF-8 form") from None
        fd = self._open(relative, os.O_WRONLY | os.O_CREAT, create_parents=True)
        with open(fd, "wb") as file:  # truncated once it is known to be a regular file
            file.truncate()
            file.write(data)

    def read_file(self, relative: str, max_chars: int = 100_000) -> str:
        """The first `max_chars` characters of `relative` in the folder (host side)."""
        with open(self._open(relative, os.O_RDONLY), errors="replace") as file:
            return file.read(max_chars)

    def close(self) -> None:
        """Kill anything still running in the sandbox and remove its cgroups; the folder stays."""
        self._closed = True
        with self._lock:
            running = list(self._running)
        for proc in running:
            self._kill(proc)
        if self._cgroups is not None:
            self._cgroups.remove()
            self._cgroups = None
        if self._stubs is not None:
            shutil.rmtree(self._stubs, ignore_errors=True)
            self._stubs = None
