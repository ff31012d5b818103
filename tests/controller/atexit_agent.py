"""An agent module that registers an `atexit` function when it is imported (as a module that
cleans up what it made does): a zygote imports it once, so only the zygote may run it."""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

_RECORD = os.environ.get("REINS_TEST_ATEXIT_RECORD")


def _at_exit() -> None:
    if _RECORD:
        with Path(_RECORD).open("a") as record:
            record.write(f"{os.getpid()}\n")


atexit.register(_at_exit)


def succeed(task: dict[str, Any]) -> float:
    return 1.0
