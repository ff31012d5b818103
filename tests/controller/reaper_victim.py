"""A controller (`LocalReconciler` with `die_with_parent`) that SIGKILLs itself at the worst
time: its one agent is running (it wrote its pids) and the launch has not returned yet.

`python -m tests.controller.reaper_victim command|module LOG_DIR PID_DIR`. The agent records
`<pid> <its child's pid>` in `PID_DIR/r1`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from reins.controller import LocalReconciler, local
from reins.controller.loop import Launch

ROOT = Path(__file__).resolve().parents[2]
AGENTS = {
    "command": "sleep 600 & echo $$ $! > $PID_DIR/r1.tmp && mv $PID_DIR/r1.tmp $PID_DIR/r1; wait",
    "module": "tests.trainer.paced_agents:stuck",
}


def die_once_the_agent_runs(record: Path) -> None:
    while not record.exists():
        time.sleep(0.01)  # polling a file the agent writes at once
    os.kill(os.getpid(), signal.SIGKILL)


async def main(kind: str, log_dir: Path, pid_dir: Path) -> None:
    record = pid_dir / "r1"
    if kind == "command":
        spawn = asyncio.create_subprocess_exec

        async def spawn_then_die(*args: Any, **kwargs: Any) -> Any:
            await spawn(*args, **kwargs)
            die_once_the_agent_runs(record)

        asyncio.create_subprocess_exec = spawn_then_die  # type: ignore[assignment]
    else:
        fork = local._Zygote.fork

        async def fork_then_die(self: Any, *args: Any, **kwargs: Any) -> Any:
            await fork(self, *args, **kwargs)
            die_once_the_agent_runs(record)

        local._Zygote.fork = fork_then_die  # type: ignore[method-assign]
    reconciler = LocalReconciler(AGENTS[kind], 1, log_dir, workdir=ROOT, die_with_parent=True)
    await reconciler.start(lambda: None)
    env = {
        "REINS_ROLLOUT_ID": "r1",
        "REINS_INPUT": json.dumps({"pid_dir": str(pid_dir)}),
        "PID_DIR": str(pid_dir),
    }
    await reconciler.launch(Launch("r1", 1, None, env, None, "1"))
    raise AssertionError("the launch returned: the controller should have killed itself first")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))
