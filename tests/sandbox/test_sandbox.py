"""The sandbox against real bubblewrap: isolation (files, network, environment) and every limit."""

from __future__ import annotations

import errno
import math
import os
import platform
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reins.sandbox import Sandbox, SandboxLimits, sandbox_problem
from tests.required import missing

REPOSITORY = Path(__file__).resolve().parents[2]
FAST = SandboxLimits(wall_s=10, cpu_s=1, memory_mb=256, processes=32, file_mb=1, output_chars=1000)


@pytest.fixture(autouse=True)
def _bwrap_available() -> None:
    problem = sandbox_problem()
    if problem:
        missing(problem)


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[Sandbox]:
    with Sandbox(tmp_path / "rollout", FAST) as box:
        yield box


def needs_cgroup(box: Sandbox) -> None:
    if box._cgroups is None:
        missing("no writable cgroup (v1 memory and pids, or v2): run as root on Linux")


def _running(marker: str, groups: list[Path]) -> bool:
    """A process of `marker` is running, inside the first of the sandbox's cgroups if any."""
    live = live_processes(marker)
    if not groups:
        return bool(live)
    try:
        members = {int(pid) for pid in (groups[0] / "cgroup.procs").read_text().split()}
    except OSError:
        return False
    return bool(members & set(live))


def live_processes(marker: str) -> list[int]:
    """Host pids (not zombies) whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def test_command_writes_into_the_host_folder_and_python_computes(sandbox: Sandbox) -> None:
    result = sandbox.run("pwd; echo $HOME; python3 -c 'print(6 * 7)' | tee answer.txt")
    assert result.ok, result.output
    assert result.output.split() == ["/work", "/work", "42"]
    assert (sandbox.path / "answer.txt").read_text() == "42\n"
    assert sandbox.run("cat", stdin="to stdin\n").output == "to stdin\n"
    assert sandbox.run("exit 3").exit_code == 3


def test_host_loopback_server_is_unreachable(sandbox: Sandbox) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # reachable from the host
        probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)"
        result = sandbox.run(f'python3 -c "{probe}"')
    assert result.exit_code == 1
    assert "ConnectionRefusedError" in result.output
    # ...while the sandbox's own loopback works, within one command
    own = "s = socket.create_server(('127.0.0.1', 0)); socket.create_connection(s.getsockname())"
    assert sandbox.run(f'python3 -c "import socket; {own}; print(1)"').output == "1\n"


def test_no_dns_and_no_route_out_fail_fast(sandbox: Sandbox) -> None:
    lookup = sandbox.run("python3 -c \"import socket; socket.getaddrinfo('example.com', 80)\"")
    assert lookup.exit_code == 1 and "gaierror" in lookup.output
    connect = sandbox.run(
        "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=10)\""
    )
    assert connect.exit_code == 1 and "Network is unreachable" in connect.output
    assert lookup.seconds + connect.seconds < 3


def test_other_sandboxes_home_and_repository_are_invisible(tmp_path: Path) -> None:
    secret = uuid.uuid4().hex
    with Sandbox(tmp_path / "a", FAST) as a, Sandbox(tmp_path / "b", FAST) as b:
        assert a.run(f"echo {secret} > secret.txt").ok
        for path in (a.path / "secret.txt", a.path, Path("/root"), REPOSITORY, Path("/etc/shadow")):
            assert path.exists()
            result = b.run(f"cat {path}/* {path}; ls {path}")
            assert "No such file or directory" in result.output, path
            assert secret not in result.output


def test_host_environment_is_not_inherited(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-must-not-leak")
    variables = dict(
        line.split("=", 1) for line in sandbox.run("env").output.splitlines() if "=" in line
    )
    assert "OPENAI_API_KEY" not in variables
    assert variables["HOME"] == "/work" and variables["PATH"] == "/usr/local/bin:/usr/bin:/bin"


def test_commands_have_no_capabilities(sandbox: Sandbox) -> None:
    result = sandbox.run("grep CapEff /proc/self/status; mount -t tmpfs none /usr")
    assert result.output.startswith("CapEff:\t0000000000000000\n")
    assert "permission denied" in result.output and result.exit_code != 0


def test_fork_bomb_ends_by_the_process_limit_and_the_host_is_fine(tmp_path: Path) -> None:
    with Sandbox(tmp_path / "bomb", FAST) as box:
        needs_cgroup(box)
        result = box.run(":(){ :|:& };:; sleep 8")
    assert result.limit == "processes" and result.exit_code is None
    assert result.seconds < 5  # not the sleep, not the wall limit
    assert result.output.endswith("[killed: processes limit 32]")
    with Sandbox(tmp_path / "after", FAST) as after:
        assert after.run("echo fine").output == "fine\n"


BURST = """python3 -c '
import os, time
for _ in range(64):
    try:
        if os.fork() == 0:
            os.closerange(0, 3)  # the output pipe closes as soon as the parent exits
            time.sleep(30)
            os._exit(0)
    except OSError:
        os._exit(0)
'"""


def test_a_process_burst_that_exits_at_once_is_still_reported(tmp_path: Path) -> None:
    """A burst of forks that hits the limit and then exits 0 by itself (as a backgrounded fork
    bomb's shell may) is reported as the processes limit, not as a success: the cgroup's counter
    is polled while the command runs and read once more after it ends."""
    with Sandbox(tmp_path / "burst", FAST) as box:
        needs_cgroup(box)
        results = [box.run(BURST) for _ in range(3)]
    assert [r.limit for r in results] == ["processes"] * 3


def test_memory_hog_ends_by_the_memory_limit(sandbox: Sandbox) -> None:
    needs_cgroup(sandbox)
    result = sandbox.run("python3 -c 'data = b\"x\" * (2 * 1024**3); print(len(data))'")
    assert result.limit == "memory" and result.exit_code is None
    assert result.output.endswith("[killed: memory limit 256 MB]")


def test_a_command_whose_child_the_memory_limit_ended_keeps_its_own_exit_code(
    sandbox: Sandbox,
) -> None:
    """The kernel ended the child at the memory limit, but the command ran on and exited by
    itself: it was reported `exit_code=None` with `[killed: memory limit ...]`, as if the
    sandbox had killed it, though it printed after the kill and chose its own status."""
    needs_cgroup(sandbox)
    hog = "python3 -c 'data = b\"x\" * (2 * 1024**3)'"
    result = sandbox.run(f"{hog}; echo after $?; exit 3")
    assert result.limit == "memory"
    assert result.exit_code == 3
    assert "after 137\n" in result.output
    assert result.output.endswith(
        "[memory limit 256 MB reached (a process of it was killed); the command ran on]"
    )
    assert not result.ok


def test_cpu_spin_ends_by_the_cpu_limit(sandbox: Sandbox) -> None:
    result = sandbox.run("python3 -c 'while True: pass'")
    assert result.limit == "cpu time" and result.exit_code is None
    assert 0.9 < result.seconds < 5


def test_wall_limit_kills_a_sleeper(sandbox: Sandbox) -> None:
    result = sandbox.run("echo before; sleep 1000", timeout_s=1)
    assert result.limit == "wall time" and result.exit_code is None
    assert result.output == "before\n\n[killed: wall time limit 1 s]"
    assert 1 <= result.seconds < 3


@pytest.mark.parametrize("seconds", [math.nan, math.inf, 0.0, -1.0])
def test_a_wall_limit_that_is_no_time_is_refused(sandbox: Sandbox, seconds: float) -> None:
    """`run(timeout_s=nan)` ran the command with no wall limit at all (every comparison with
    NaN is false); 0 and below were a kill before it started, reported as a wall-time limit."""
    with pytest.raises(ValueError, match="must be a finite number of seconds above 0"):
        sandbox.run("echo not run", timeout_s=seconds)
    with pytest.raises(ValueError, match="wall_s must be a finite number"):
        SandboxLimits(wall_s=seconds)


def test_file_size_limit_stops_a_large_write(sandbox: Sandbox) -> None:
    result = sandbox.run("head -c 3000000 /dev/zero > big")
    assert result.limit == "file size"
    assert (sandbox.path / "big").stat().st_size == 1024 * 1024


def test_huge_output_keeps_head_and_tail(sandbox: Sandbox) -> None:
    result = sandbox.run("echo START; head -c 100000000 /dev/zero | tr '\\0' x; echo; echo END")
    assert result.ok
    assert result.output.startswith("START\nxxx") and result.output.endswith("xxx\nEND\n")
    assert "output truncated: 100000011 bytes in all" in result.output
    assert len(result.output) < 1100


def test_file_access_refuses_paths_out_of_the_folder(sandbox: Sandbox, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "host.txt").write_text("host")
    (sandbox.path / "link").symlink_to(outside)
    for bad in ("../x", str(outside / "x"), "/etc/passwd", "link/x", "link/host.txt", "a/../../x"):
        with pytest.raises(ValueError, match="outside the sandbox folder"):
            sandbox.write_file(bad, "escaped")
        with pytest.raises(ValueError, match="outside the sandbox folder"):
            sandbox.read_file(bad)
    assert sorted(p.name for p in outside.iterdir()) == ["host.txt"]
    assert (outside / "host.txt").read_text() == "host"
    sandbox.write_file("sub/in.txt", "inside")
    assert sandbox.read_file("sub/in.txt") == "inside"
    assert sandbox.run("cat sub/in.txt").output == "inside"


def test_a_write_that_cannot_be_encoded_leaves_the_file_as_it_was(sandbox: Sandbox) -> None:
    """A lone surrogate (a model's JSON can hold one) failed the write after the file had been
    truncated: the tool said "error" and the file's old content was gone."""
    sandbox.write_file("notes.txt", "old")
    with pytest.raises(ValueError, match=r"the content holds '\\ud800', which has no UTF-8 form"):
        sandbox.write_file("notes.txt", "new \ud800")
    assert sandbox.read_file("notes.txt") == "old"
    for path in ("bad\ud800.txt", "nul\0.txt"):
        with pytest.raises(ValueError, match="the path holds"):
            sandbox.write_file(path, "x")
        with pytest.raises(ValueError, match="the path holds"):
            sandbox.read_file(path)
    sandbox.write_file("utf8.txt", "caf\u00e9 \U0001f642")
    assert (sandbox.path / "utf8.txt").read_bytes() == "caf\u00e9 \U0001f642".encode()


def test_background_process_does_not_outlive_its_command(sandbox: Sandbox) -> None:
    marker = f"{1000 + uuid.uuid4().int % 1000}.{os.getpid()}"
    assert sandbox.run(f"sleep {marker} & echo started").output == "started\n"
    assert live_processes(f"sleep {marker}") == []


def test_close_kills_a_running_command_and_removes_the_cgroups(tmp_path: Path) -> None:
    box = Sandbox(tmp_path / "rollout", FAST)
    groups = box._cgroups.dirs if box._cgroups else []
    assert all(group.is_dir() for group in groups)
    marker = f"{1000 + uuid.uuid4().int % 1000}.{os.getpid()}"
    results: list[Any] = []

    def run() -> None:
        try:
            results.append(box.run(f"sleep {marker}"))
        except BaseException as error:  # shown by the assert below, not lost with the thread
            results.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 5
    # Running: in the sandbox's cgroups. Its wrapper's command line names it before it has
    # joined them; a close then makes the join fail (the command never runs: exit 125), and
    # the shell's error joined the output.
    while not _running(f"sleep {marker}", groups):
        assert time.monotonic() < deadline, "the command never started"
    box.close()
    assert live_processes(f"sleep {marker}") == []
    worker.join(timeout=10)
    assert len(results) == 1, "box.run still running 10 s after the close"
    assert not isinstance(results[0], BaseException), repr(results[0])
    assert results[0].exit_code is None and results[0].seconds < 5
    assert results[0].output == "[killed: sandbox closed]"
    assert not any(group.exists() for group in groups)


def test_a_kill_racing_a_close_that_removes_the_cgroups_does_not_fail(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run` kills its command (at its end, a limit, or the close) while `close()` may be
    removing the cgroups in another thread: a folder being removed answers ENODEV, and the
    sandbox's handle on its groups becomes None between two reads. Either raised out of `run`
    (the command's result lost: a test here failed 1 run in ~45)."""
    needs_cgroup(sandbox)
    group = sandbox._cgroups
    assert group is not None
    read_text = Path.read_text

    def being_removed(path: Path, *args: Any, **kwargs: Any) -> str:
        if path.name == "cgroup.procs":
            raise OSError(errno.ENODEV, "No such device", str(path))
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", being_removed)
    group.kill()  # no error: nothing left to kill in a group being removed
    monkeypatch.undo()

    # The handle as a concurrent close() leaves it: there at `_kill`'s first read, None after.
    reads: list[int] = []

    def closed_meanwhile(_: Sandbox) -> Any:
        reads.append(1)
        return group if len(reads) == 1 else None

    monkeypatch.setattr(Sandbox, "_cgroups", property(closed_meanwhile), raising=False)
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        sandbox._kill(proc)
    finally:
        proc.kill()
        monkeypatch.undo()
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_a_disabled_command_is_a_stub_however_called_and_hidden_paths_are_empty(
    tmp_path: Path,
) -> None:
    assert Path("/usr/bin/git").exists() and any(Path("/usr/lib/git-core").iterdir())  # on host
    with Sandbox(
        tmp_path / "rollout", FAST, disabled_commands=("git",), hidden_paths=("/usr/lib/git-core",)
    ) as box:
        stubs = box._stubs
        assert stubs is not None and stubs.is_dir()
        from_python = "python3 -c \"import subprocess; subprocess.run(['git', 'log'], check=True)\""
        for command in ("git log", "/usr/bin/git status", "/bin/git --version", from_python):
            result = box.run(command)
            assert result.exit_code != 0, command
            assert "git: disabled in this sandbox (reins)" in result.output, command
        assert box.run("git log").exit_code == 126
        assert box.run("ls -A /usr/lib/git-core").output == ""
        assert box.run("ls /usr/bin/python3").ok  # the rest of /usr is there
    assert not stubs.exists()  # removed by close()
    with Sandbox(tmp_path / "plain", FAST) as plain:  # nothing disabled by default
        assert plain.run("git --version").output.startswith("git version")
    with pytest.raises(ValueError, match="is not a command name"):
        Sandbox(tmp_path / "bad", FAST, disabled_commands=("/usr/bin/git",))


# -- what a command may not do to the host (a probe's findings, 2026-12-06) --------------------


def test_a_command_cannot_change_the_hosts_kernel_settings(sandbox: Sandbox) -> None:
    """uid 0 without capabilities could write most of /proc/sys (global settings). The same
    value is written back, so the test changes nothing on a host where the write goes through."""
    setting = "/proc/sys/kernel/printk_ratelimit_burst"
    before = Path(setting).read_text()
    done = sandbox.run(f"cat {setting} > /tmp/v && cat /tmp/v > {setting} && echo wrote")
    assert "wrote" not in done.output and done.exit_code != 0, done.output
    assert "Read-only file system" in done.output
    assert Path(setting).read_text() == before
    assert sandbox.run(f"cat {setting}").output == before  # still readable


def test_no_setuid_program_is_left_on_the_host(sandbox: Sandbox) -> None:
    done = sandbox.run("cp /usr/bin/id rootid && chmod 6755 rootid && mkdir d && chmod 2755 d")
    assert done.exit_code == 0, done.output
    assert (sandbox.path / "rootid").stat().st_mode & 0o7777 == 0o755
    assert (sandbox.path / "d").stat().st_mode & 0o7777 == 0o755


def test_the_host_side_refuses_a_fifo_instead_of_waiting_on_it(sandbox: Sandbox) -> None:
    assert sandbox.run("mkfifo answer.txt").exit_code == 0
    with pytest.raises(ValueError, match="not a regular file"):
        sandbox.read_file("answer.txt")
    with pytest.raises(ValueError, match="not a regular file"):
        sandbox.write_file("answer.txt", "x")


def test_a_folder_swapped_for_a_link_meanwhile_never_leads_the_host_out(tmp_path: Path) -> None:
    """The host resolved a path, then opened it by name: a command swapping a folder for a link
    to a host folder in between made 4 in 10 host reads read the host's file, and host writes
    land there. Now each open walks the resolved folders without following links."""
    sandbox = Sandbox(tmp_path / "rollout", SandboxLimits(wall_s=20, cpu_s=10))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("HOST SECRET")
    (sandbox.path / "real").mkdir()
    (sandbox.path / "real" / "secret.txt").write_text("inside")
    # `d` and `link` swapped atomically (renameat2 with RENAME_EXCHANGE), as fast as it goes.
    number = {"x86_64": 316, "aarch64": 276}[platform.machine()]
    swap = (
        f"ln -s {outside} link && mkdir d && cp real/secret.txt d/ && python3 - <<'EOF'\n"
        "import ctypes, time\nlibc = ctypes.CDLL(None)\nend = time.monotonic() + 3\n"
        "while time.monotonic() < end:\n"
        f"    libc.syscall({number}, -100, b'd', -100, b'link', 2)\nEOF"
    )
    runner = threading.Thread(target=sandbox.run, args=(swap,), kwargs={"timeout_s": 10})
    runner.start()
    started = time.monotonic()
    while not os.path.lexists(sandbox.path / "link") and time.monotonic() < started + 10:
        time.sleep(0.01)  # the swapping has begun (a host write first would make `d` itself)
    reads, escapes, refusals = 0, 0, 0
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        for action in ("read", "write"):
            try:
                if action == "read":
                    reads += 1
                    escapes += sandbox.read_file("d/secret.txt") == "HOST SECRET"
                else:
                    sandbox.write_file(f"d/note{reads}.txt", "x")
            except (ValueError, OSError):
                refusals += 1
    runner.join()
    sandbox.close()
    assert reads > 50
    assert escapes == 0
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


@pytest.mark.parametrize(
    ("command", "says"),
    [("echo a\0b", "NUL byte"), ("echo \ud800", "'\\ud800', which has no UTF-8 form")],
    ids=["nul", "surrogate"],
)
def test_a_command_no_shell_can_take_is_answered_not_raised(
    sandbox: Sandbox, command: str, says: str
) -> None:
    done = sandbox.run(command)
    assert (done.exit_code, done.limit) == (2, None)
    assert done.output.startswith("[not run: the command holds") and says in done.output


def test_a_command_longer_than_an_argument_runs(sandbox: Sandbox) -> None:
    """Linux caps one argument at 128 KiB: a longer command (a heredoc writing a file) was an
    OSError out of `run`."""
    body = "x" * 200_000
    done = sandbox.run(f"cat > big.txt <<'EOF'\n{body}\nEOF\nwc -c < big.txt")
    assert done.exit_code == 0, done.output[-300:]
    assert done.output.strip() == str(len(body) + 1)


def test_output_cut_to_its_characters_never_shows_a_split_one(tmp_path: Path) -> None:
    limits = SandboxLimits(output_chars=8000)
    with Sandbox(tmp_path / "box", limits) as box:
        done = box.run('python3 -c \'print("€" * 12000, end="")\'')
    head, _, tail = done.output.partition("\n[... output truncated")
    assert (len(head), "\ufffd" in done.output) == (4000, False)
    assert tail.split("...]\n", 1)[1] == "€" * 4000
    with Sandbox(tmp_path / "none", SandboxLimits(output_chars=0)) as box:
        assert len(box.run("head -c 100000 /dev/zero").output) < 100  # the note alone


def test_two_commands_asked_at_once_run_one_after_the_other(sandbox: Sandbox) -> None:
    """They share the cgroups: the first's wall-time kill also killed the second."""
    results: dict[str, Any] = {}
    first = threading.Thread(target=lambda: results.update(a=sandbox.run("sleep 3", timeout_s=0.5)))
    first.start()
    time.sleep(0.1)  # the first holds the sandbox
    results["b"] = sandbox.run("sleep 1; echo second")  # running when the first is killed
    first.join()
    assert results["a"].limit == "wall time"
    assert (results["b"].exit_code, results["b"].output) == (0, "second\n")


def test_the_stubs_of_a_process_that_died_unclosed_are_removed(tmp_path: Path) -> None:
    """Left in the temporary folder for ever (the cgroups of such a process were removed)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = Path(tempfile.gettempdir()) / f"reins-sandbox-stubs-{dead.pid}-x"
    stale.mkdir()
    (stale / "git").write_text("")
    with Sandbox(tmp_path / "rollout", FAST, disabled_commands=("git",)) as box:
        assert not stale.exists()
        assert box.run("git status").exit_code == 126
