"""An agent that cleans up when it gets SIGTERM (0.3 s of work, then a file): the controller
gives it `kill_grace_s` before the SIGKILL. Run as a command (`python graceful_agent.py FILE`)
or as `tests.controller.graceful_agent:hang` with `input: {"file": FILE}`."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any


def _wait_for_sigterm(file: Path) -> None:
    def cleanup(*_: object) -> None:
        time.sleep(0.3)  # what a real agent does: stop its container, save what it has
        file.write_text("cleaned up")
        sys.exit(0)

    signal.signal(signal.SIGTERM, cleanup)
    print("waiting", flush=True)
    time.sleep(1000)


def hang(task: dict[str, Any]) -> None:
    _wait_for_sigterm(Path(task["file"]))


def hang_in_try(task: dict[str, Any]) -> None:
    """No handler of its own: its `finally` is its cleanup (a temporary folder's, a sandbox's)."""
    print("waiting", flush=True)
    try:
        time.sleep(1000)
    finally:
        Path(task["file"]).write_text("cleaned up")


if __name__ == "__main__":
    _wait_for_sigterm(Path(sys.argv[1]))
