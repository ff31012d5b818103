"""Agents (`module:function`) the controller tests launch, as `tests.controller.agents:NAME`.

Each runs in a fresh interpreter started by the controller, with the agent environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from reins.agent import AgentContext, report_reward


def succeed(task: dict[str, Any]) -> float:
    return float(task.get("reward", 1.0))


async def succeed_async(task: dict[str, Any]) -> float:
    import asyncio  # here, not above: the other agents start faster without it

    await asyncio.sleep(0.01)
    return 0.5


def report_itself(task: dict[str, Any]) -> None:
    report_reward(0.25, reason="graded by the agent")


def return_text(task: dict[str, Any]) -> str:
    return "not a reward"


def record_env(task: dict[str, Any]) -> float:
    """Writes its environment (the REINS_/OPENAI_/ANTHROPIC_ part, and whether the admin key
    leaked)."""
    context = AgentContext.from_env()
    names = [n for n in os.environ if n.startswith(("REINS_", "OPENAI_", "ANTHROPIC_"))]
    Path(task["out"]).write_text(
        json.dumps(
            {
                "env": {n: os.environ[n] for n in names},
                "context_input": context.input,
                "cwd": os.getcwd(),
            }
        )
    )
    return 1.0


def crash_once(task: dict[str, Any]) -> float:
    if os.environ["REINS_ATTEMPT_ID"] == "1":
        print("working on it", flush=True)
        raise RuntimeError("the first attempt crashes on purpose")
    return 1.0


def spawn_and_hang(task: dict[str, Any]) -> float:
    """Starts a grandchild (pid written to task['pid_file']) and hangs on attempt 1."""
    if task.get("only_first") and os.environ["REINS_ATTEMPT_ID"] != "1":
        return 1.0
    child = subprocess.Popen(["sleep", "1000"])
    Path(task["pid_file"]).write_text(f"{os.getpid()} {child.pid}")
    print("hanging", flush=True)
    time.sleep(1000)
    return 1.0


def escape(task: dict[str, Any]) -> float:
    """Starts processes that leave the attempt's process group, their pids in task['pid_file']:
    a tool in its own session (`start_new_session=True`) and a daemon (a double fork, then
    `setsid`: its parent is gone, it is no descendant of the agent). Then ends (task['then']:
    `exit`) or hangs until killed (`hang`)."""
    tool = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    daemon = subprocess.run(
        ["sh", "-c", "setsid sleep 1000 >/dev/null 2>&1 < /dev/null & echo $!"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    daemon_pid = int(daemon.stdout)
    parent = int(Path(f"/proc/{daemon_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    pids = {"agent": os.getpid(), "tool": tool.pid, "daemon": daemon_pid, "daemon_parent": parent}
    pids["python_daemon"] = _python_daemon()
    Path(task["pid_file"]).write_text(json.dumps(pids))
    if task["then"] == "hang":
        time.sleep(1000)
    return 1.0


def _python_daemon() -> int:
    """A daemon forked without an exec (fork, setsid, fork), as a Python program daemonizes:
    a zygote-forked agent's starting environment is the zygote's; its pid."""
    read, write = os.pipe()
    first = os.fork()
    if first == 0:
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            os.close(write)  # the agent reads until every writer has closed
            time.sleep(1000)
            os._exit(0)
        os.write(write, str(daemon).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(first, 0)
    with os.fdopen(read) as answer:
        return int(answer.read())


def timed(task: dict[str, Any]) -> float:
    """Sleeps `task['sleep']` seconds, appending `start end` to task['log']."""
    start = time.time()
    time.sleep(float(task["sleep"]))
    with open(task["log"], "a") as file:
        file.write(f"{start} {time.time()}\n")
    return 1.0


def scale(task: dict[str, Any]) -> float:
    """The 200-rollout test's agent: records each launch once, crashes once if asked."""
    attempt = os.environ["REINS_ATTEMPT_ID"]
    marker = Path(task["markers"]) / f"{os.environ['REINS_ROLLOUT_ID']}.{attempt}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        with open(Path(task["markers"]) / "DUPLICATES", "a") as file:
            file.write(f"{marker.name}\n")  # the same attempt launched twice
    time.sleep(float(task.get("sleep", 0.3)))
    if task.get("crash") and attempt == "1":
        print(f"crashing attempt {attempt} on purpose", file=sys.stderr)
        sys.exit(3)
    return 1.0


def exit_with(task: dict[str, Any]) -> float:
    """Ends the process with `sys.exit(task["status"])`, as some harness CLIs do."""
    sys.exit(task["status"])


def os_exit_with(task: dict[str, Any]) -> None:
    """Ends the process with `os._exit(task["status"])` (no cleanup), as many harness CLIs do."""
    sys.stdout.flush()
    os._exit(task["status"])


def kill_self(task: dict[str, Any]) -> None:
    """Dies of signal `task["signal"]` (SIGKILL, SIGSEGV)."""
    import signal

    os.kill(os.getpid(), signal.Signals[task["signal"]])
    time.sleep(30)


def interrupted(task: dict[str, Any]) -> None:
    raise KeyboardInterrupt


def report_from_a_thread(task: dict[str, Any]) -> None:
    """Reports its reward from a thread that is no daemon, after returning, and writes a file
    at exit: a fresh interpreter waits for the thread and runs `atexit` before it ends."""
    import atexit
    import threading

    def later() -> None:
        time.sleep(0.3)
        report_reward(0.75)

    atexit.register(Path(task["atexit_file"]).write_text, "ran")
    threading.Thread(target=later).start()


def return_numpy_int(task: dict[str, Any]) -> Any:
    """A reward counted with numpy (`np.sum` of a boolean array is an `np.int64`)."""
    import numpy as np

    return np.sum(np.array([True, False, True]))


def return_numpy_float32(task: dict[str, Any]) -> Any:
    import numpy as np

    return np.float32(0.5)
