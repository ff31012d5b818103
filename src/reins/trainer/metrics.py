"""Per-step metrics: appended to `<run>/metrics.jsonl` (the dashboard and `reins report` read it)
and, when the `tensorboard` package is installed, to TensorBoard scalars in `<run>/tensorboard`."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._writer: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.info("tensorboard is not installed: metrics go to %s only", self.path)
            else:
                self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drops lines of steps after `step` (a resumed run redoes them)."""
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", -1) <= step
        ]
        self.path.write_text("".join(f"{line}\n" for line in kept))

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {"step": step, "time": time.time(), **_finite(metrics)}
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key not in ("step", "time"):
                    self._writer.add_scalar(key, value, step)
                elif isinstance(value, dict):
                    for sub, number in value.items():
                        if isinstance(number, int | float):
                            self._writer.add_scalar(f"{key}/{sub}", number, step)
            self._writer.flush()
        return record

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinity are not JSON: they become null."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
        elif isinstance(value, dict):
            out[key] = _finite(value)
        else:
            out[key] = value
    return out
