"""What the examples' training tests read back from a finished run."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any


def recorded(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The data of the run's `reward` events and of its `tool` events, from its gateway's
    SQLite file (`reins train` without `gateway_url` keeps it in the run folder)."""
    with sqlite3.connect(run_dir / "gateway.db") as db:
        rows = db.execute("SELECT type, data FROM events WHERE type IN ('reward', 'tool')")
        events = [(kind, json.loads(data)) for kind, data in rows]
    rewards = [data for kind, data in events if kind == "reward"]
    tools = [data for kind, data in events if kind == "tool"]
    return rewards, tools
