"""Per-step metrics: appended to `<run>/metrics.jsonl` (the dashboard and `reins report` read it)
and, when the `tensorboard` package is installed, to TensorBoard scalars in `<run>/tensorboard`.

A resumed run never deletes a line: `settle` moves the lines of the steps it will redo (those after
its checkpoint) to `metrics.discarded.jsonl`, and puts back the checkpoint's own step line if a
crash came between the checkpoint and the line."""

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

    def records(self) -> list[dict[str, Any]]:
        """The lines written so far (a torn last line, from a crash mid-write, is skipped)."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out

    def settle(
        self, next_step: int, *, steps: int, checkpoint_record: dict[str, Any] | None
    ) -> list[dict[str, Any]]:
        """Makes the file match a resume at `next_step`; returns the lines moved away.

        Kept: the lines of steps before `next_step`, and the final validation line (step
        `steps`) when the run is finished. Moved to `metrics.discarded.jsonl`: the others (steps
        a resumed run redoes). The checkpoint's record comes back when its line is missing."""
        kept: list[dict[str, Any]] = []
        moved: list[dict[str, Any]] = []
        for record in self.records():
            step = record.get("step", -1)
            final = step == steps == next_step
            (kept if (isinstance(step, int) and step < next_step) or final else moved).append(
                record
            )
        if checkpoint_record is not None and not any(
            r.get("step") == checkpoint_record.get("step") for r in kept
        ):
            kept.append(checkpoint_record)
            kept.sort(key=lambda r: int(r.get("step", -1)))
        if moved:
            with (self.path.parent / "metrics.discarded.jsonl").open("a") as out:
                out.writelines(json.dumps(r) + "\n" for r in moved)
        staging = self.path.with_suffix(".jsonl.tmp")
        staging.write_text("".join(json.dumps(r) + "\n" for r in kept))
        staging.replace(self.path)
        return moved

    def has_final_validation(self, steps: int) -> bool:
        return any(
            r.get("step") == steps and r.get("val/reward_mean") is not None for r in self.records()
        )

    def prepare(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """The line `write` would append (a checkpoint stores it before it is appended)."""
        return {"step": step, "time": time.time(), **_finite(metrics)}

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        return self.append(self.prepare(step, metrics))

    def append(self, record: dict[str, Any]) -> dict[str, Any]:
        step = int(record["step"])
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
