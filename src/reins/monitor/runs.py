"""Training runs on disk, as the trainer writes them.

`<runs_dir>/<run>/metrics.jsonl` holds one JSON object per training step (appended as training
goes; flat keys such as `reward/mean`, absent when not measured that step) and `config.yaml` the
run's configuration. Reading is tolerant: a line that is not a JSON object (the one being
written, say) is counted and skipped, nested objects are flattened (`samples/split_reasons`
becomes `samples/split_reasons/branch`, ...), values that are not numbers are ignored by the
charts.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"


@dataclass(frozen=True)
class Run:
    """One run directory, read."""

    name: str
    path: Path
    steps: list[dict[str, Any]]
    """One flattened object per line of metrics.jsonl, in file order."""
    skipped_lines: int
    """Lines that were not JSON objects."""
    config_text: str | None
    """config.yaml as written, or None when absent."""

    def series(self, key: str) -> list[tuple[float, float]]:
        """(step, value) of every step where `key` is a finite number."""
        points = []
        for index, row in enumerate(self.steps):
            value = number(row.get(key))
            if value is not None:
                points.append((step_of(row, index), value))
        return points

    def keys(self) -> list[str]:
        """Every numeric key of any step, in first-seen order (`step` and `time` excluded)."""
        seen: dict[str, None] = {}
        for row in self.steps:
            for key, value in row.items():
                if key not in ("step", "time") and number(value) is not None:
                    seen.setdefault(key, None)
        return list(seen)

    def last(self, key: str) -> float | None:
        points = self.series(key)
        return points[-1][1] if points else None


@dataclass(frozen=True)
class RunInfo:
    """A run as the runs list shows it."""

    name: str
    path: Path
    modified: float
    """Unix time metrics.jsonl (or the folder) last changed."""
    steps: int
    last: dict[str, Any]
    """The last step's flattened metrics."""


LARGEST = 1e300
"""Numbers larger than this are not drawn: a chart's span (highest - lowest, mean + std) of
values near a double's limit is infinite, and neither the SVG nor matplotlib can scale it."""


def number(value: Any) -> float | None:
    """`value` as a float a chart can draw (finite, at most `LARGEST` in size); None for anything
    else (booleans included)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    as_float = float(value)
    return as_float if math.isfinite(as_float) and abs(as_float) <= LARGEST else None


def step_of(row: dict[str, Any], index: int) -> float:
    """The row's `step`, or its position when it has none."""
    step = number(row.get("step"))
    return step if step is not None else float(index)


def flatten(row: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested objects become `parent/child` keys."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        else:
            out[name] = value
    return out


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The flattened steps of a metrics.jsonl and the number of lines skipped."""
    steps: list[dict[str, Any]] = []
    skipped = 0
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):  # not JSON, or nested past the reader's stack
                skipped += 1
                continue
            if isinstance(row, dict):
                steps.append(flatten(row))
            else:
                skipped += 1
    return steps, skipped


def load_run(path: Path, name: str | None = None) -> Run:
    """Read one run directory; raises FileNotFoundError when it has no metrics.jsonl."""
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(
            f"{path} has no {METRICS_FILE}: is it a run directory written by the trainer "
            "(`<runs_dir>/<run>/`)?"
        )
    steps, skipped = read_metrics(metrics)
    config = path / CONFIG_FILE
    config_text = config.read_text(errors="replace") if config.is_file() else None
    return Run(
        name=name or path.name,
        path=path,
        steps=steps,
        skipped_lines=skipped,
        config_text=config_text,
    )


def list_runs(runs_dir: Path) -> list[RunInfo]:
    """Runs under `runs_dir` (folders holding a metrics.jsonl), the latest changed first."""
    if not runs_dir.is_dir():
        return []
    infos = []
    for folder in runs_dir.iterdir():
        metrics = folder / METRICS_FILE
        if not metrics.is_file():
            continue
        steps, last = summary(metrics)
        infos.append(
            RunInfo(
                name=folder.name,
                path=folder,
                modified=metrics.stat().st_mtime,
                steps=steps,
                last=last,
            )
        )
    return sorted(infos, key=lambda info: info.modified, reverse=True)


@dataclass(frozen=True)
class _Read:
    """What `summary` read of a metrics.jsonl: its complete lines up to `offset`."""

    inode: int
    offset: int
    before: bytes
    """The bytes just before `offset`: the file is taken as the same when they still are (an
    inode number can be reused by a file renamed into place later)."""
    steps: int
    last: dict[str, Any]


_summaries: dict[Path, _Read] = {}
_summaries_lock = threading.Lock()


def summary(metrics: Path) -> tuple[int, dict[str, Any]]:
    """The step count and last step of a metrics.jsonl, as `read_metrics` counts them, reading
    only the lines appended since the last call (the trainer appends; a rewrite renames a new
    file into place): the runs list reads every run's file on each load, megabytes for long
    runs."""
    inode = metrics.stat().st_ino
    with _summaries_lock:
        known = _summaries.get(metrics)
    with metrics.open("rb") as lines:
        if known is not None and known.inode == inode:
            lines.seek(known.offset - len(known.before))
            if lines.read(len(known.before)) != known.before:
                known = None
        if known is None or known.inode != inode:
            known = _Read(inode, 0, b"", 0, {})
        lines.seek(known.offset)
        data = lines.read()
    complete, newline, tail = data.rpartition(b"\n")
    steps, raw_last = known.steps, None
    for line in complete.split(b"\n") if newline else ():
        row = _row(line)
        if row is not None:
            steps, raw_last = steps + 1, row
    last = known.last if raw_last is None else flatten(raw_last)
    offset = known.offset + len(complete) + len(newline)
    before = (known.before + (complete + newline)[-64:])[-64:]
    read = _Read(inode, offset, before, steps, last)
    with _summaries_lock:
        _summaries[metrics] = read
    row = _row(tail)  # a line being written: counted while it reads as one, not kept
    return (steps + 1, flatten(row)) if row is not None else (steps, last)


def _row(line: bytes) -> dict[str, Any] | None:
    if not line.strip():
        return None
    try:
        row = json.loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return None
    return row if isinstance(row, dict) else None


def run_names(runs_dir: Path) -> list[str]:
    """The names of the runs under `runs_dir`, the latest changed first, without reading their
    metrics (the rollouts page lists them on every load; a long run's file is megabytes)."""
    if not runs_dir.is_dir():
        return []
    found = [(folder / METRICS_FILE, folder.name) for folder in runs_dir.iterdir()]
    dated = [(metrics.stat().st_mtime, name) for metrics, name in found if metrics.is_file()]
    return [name for _, name in sorted(dated, reverse=True)]


def run_path(runs_dir: Path, name: str) -> Path:
    """The folder of run `name`; refuses names that would leave `runs_dir`, and those no folder
    can have (over 255 bytes: the page was a 500)."""
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or len(name.encode()) > 255
    ):
        raise ValueError(f"{name!r} is not a run name (a folder name under the runs directory)")
    return runs_dir / name
