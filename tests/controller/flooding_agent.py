"""An agent that prints in a loop (`tests/controller/test_agent_limits.py`): it writes
`task["bytes"]`, past its log's cap, waits until the controller has cut its `agent.log` back (its
stdout shrank), then writes its last line and succeeds."""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def flood(task: dict[str, Any]) -> float:
    print("the first line of the agent", flush=True)
    line = "x" * 99 + "\n"
    written = 0
    while written < task["bytes"]:
        sys.stdout.write(line * 100)
        sys.stdout.flush()
        written += 100 * len(line)
    deadline = time.monotonic() + 30
    # Until the log is smaller than what this agent wrote: the controller cut it while it ran.
    while os.fstat(sys.stdout.fileno()).st_size >= written:
        if time.monotonic() > deadline:
            raise RuntimeError("the controller never cut agent.log back")
        time.sleep(0.01)
    print(f"the last line of the agent, after {written} bytes", flush=True)
    return 1.0
