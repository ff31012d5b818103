"""An agent module whose import never ends (a network call at import time, say): the zygote that
preloads it never answers."""

from __future__ import annotations

import time
from typing import Any

time.sleep(3600)


def succeed(task: dict[str, Any]) -> float:
    return 1.0
