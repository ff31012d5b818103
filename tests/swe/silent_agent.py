"""An agent that ends well (exit 0) and reports no reward: a policy's agent that forgot to
(`tests/swe/test_prepare.py`)."""

from __future__ import annotations

from typing import Any


def run(task: dict[str, Any]) -> None:
    return None
