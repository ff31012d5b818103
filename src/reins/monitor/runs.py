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
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
Columns = dict[str, list[tuple[float, float]]]
"""A run's series by key: (step, value) of every step where the key is a finite number."""
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
    columns: Columns
    """Every numeric key's (step, value) points, keys in first-seen order (`read_metrics`)."""

    def series(self, key: str) -> list[tuple[float, float]]:
        """(step, value) of every step where `key` is a finite number."""
        return list(self.columns.get(key, ()))

    def keys(self) -> list[str]:
        """Every numeric key of any step, in first-seen order (`step` and `time` excluded)."""
        return [key for key in self.columns if key not in ("step", "time")]

    @property
    def training_steps(self) -> int:
        """Lines of a training step (`is_training_step`), the final validation's not."""
        return sum(1 for row in self.steps if is_training_step(row))

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
    """Training steps (`is_training_step`): lines of validation alone are not steps."""
    last: dict[str, Any]
    """The latest value of each flattened key (over all lines)."""
    problem: str | None = None
    """Why metrics.jsonl could not be read (then no steps or values), else None."""
    reachable: bool = True
    """Whether the run's page can be asked for by `name` (not when its folder's name is not
    UTF-8 text: `name` then shows it with U+FFFD in place of the bytes that are not)."""


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


@dataclass(frozen=True)
class Metrics:
    """A metrics.jsonl, read."""

    steps: list[dict[str, Any]]
    """One flattened object per line that is a JSON object, in file order."""
    skipped: int
    """Lines that were not JSON objects."""
    columns: Columns


def read_metrics(path: Path) -> Metrics:
    """A metrics.jsonl's lines, reading only those appended since the last call for the same
    file (the run page's charts poll it every 10 s: a 5,000-step run's whole file took ~2 s to
    parse each time, and its series were read again, key by key). The last few files read are
    kept (`MAX_CACHED_RUNS`)."""
    with _parsed_lock:
        known = _parsed.pop(path, None)
    position, continued, lines, tail = _appended(path, known.position if known else None)
    read = known.metrics if continued and known else Metrics([], 0, {})
    rows, skipped = [], read.skipped
    for line in lines:
        row = _row(line)
        if row is not None:
            rows.append(flatten(row))
        elif line.strip():
            skipped += 1
    if rows or skipped != read.skipped:
        columns = _with_points(read.columns, rows, len(read.steps))
        read = Metrics([*read.steps, *rows], skipped, columns)
    with _parsed_lock:
        _parsed[path] = _Parsed(position, read)
        while len(_parsed) > MAX_CACHED_RUNS:
            del _parsed[next(iter(_parsed))]  # the least recently read
    row = _row(tail)  # a line being written: read while it reads as one, not kept
    if row is not None:
        flat = flatten(row)
        columns = _with_points(read.columns, [flat], len(read.steps))
        return Metrics([*read.steps, flat], read.skipped, columns)
    return Metrics(read.steps, read.skipped + (1 if tail.strip() else 0), read.columns)


def _with_points(columns: Columns, rows: list[dict[str, Any]], first: int) -> Columns:
    """`columns` with the points of `rows`, the steps from index `first` on. New lists for the
    keys they add to: a `Run` read before keeps its own."""
    out = dict(columns)
    copied: set[str] = set()
    for index, row in enumerate(rows, start=first):
        step = step_of(row, index)
        for key, raw in row.items():
            value = number(raw)
            if value is None:
                continue
            if key not in copied:
                out[key] = list(out.get(key, ()))
                copied.add(key)
            out[key].append((step, value))
    return out


def load_run(path: Path, name: str | None = None) -> Run:
    """Read one run directory; raises FileNotFoundError when it has no metrics.jsonl."""
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(
            f"{path} has no {METRICS_FILE}: is it a run directory written by the trainer "
            "(`<runs_dir>/<run>/`)?"
        )
    read = read_metrics(metrics)
    config = path / CONFIG_FILE
    config_text = config.read_text(errors="replace") if config.is_file() else None
    return Run(
        name=name or path.name,
        path=path,
        steps=read.steps,
        skipped_lines=read.skipped,
        config_text=config_text,
        columns=read.columns,
    )


def list_runs(runs_dir: Path) -> list[RunInfo]:
    """Runs under `runs_dir` (folders holding a metrics.jsonl), the latest changed first. A run
    whose file cannot be read (no permission, an I/O error) is listed with the reason: it made
    the whole list a 500."""
    infos = []
    for folder in _folders(runs_dir):
        metrics = folder / METRICS_FILE
        try:
            if not metrics.is_file():
                continue
        except OSError as error:
            # A folder it may not look into (EACCES): `is_file` raises for it, and the whole
            # list was a 500. Listed, as a run it may not read is.
            why = f"cannot look into its folder: {error.strerror or error}"
            infos.append(RunInfo(_shown(folder.name), folder, 0.0, 0, {}, why))
            continue
        if not is_text(folder.name):
            # Not readable as UTF-8 (a folder copied from a Latin-1 system): such a name could
            # not be written into the page, and the whole list was a 500.
            why = "its folder's name is not UTF-8 text: rename the folder to see the run"
            infos.append(RunInfo(_shown(folder.name), folder, 0.0, 0, {}, why, reachable=False))
            continue
        problem = None
        try:
            steps, last = summary(metrics)
            modified = metrics.stat().st_mtime
        except OSError as error:
            steps, last, modified = 0, {}, 0.0
            problem = f"cannot read {METRICS_FILE}: {error.strerror or error}"
        infos.append(RunInfo(folder.name, folder, modified, steps, last, problem))
    return sorted(infos, key=lambda info: info.modified, reverse=True)


def is_training_step(row: dict[str, Any]) -> bool:
    """Whether a (flattened) line holds a training step's metrics: a value besides the step's
    bookkeeping and validation's (`val/...`). The trainer's final validation is a line of its
    own (`val/reward_mean` at step `steps`), no step trained."""
    return any(
        value is not None and key not in _BOOKKEEPING and not key.startswith("val/")
        for key, value in row.items()
    )


_BOOKKEEPING = ("step", "time", "weight_version")


def latest_values(last: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """`last` (the latest value of each key) updated with a flattened line's values: a key a
    line does not measure keeps its value from before (the final validation line holds no
    training reward; a step without validation no validation reward)."""
    return {**last, **{key: value for key, value in row.items() if value is not None}}


@dataclass(frozen=True)
class _Position:
    """How far a metrics.jsonl was read: its complete lines up to `offset`."""

    inode: int
    offset: int
    before: bytes
    """The bytes just before `offset`: the file is taken as the same when they still are (an
    inode number can be reused by a file renamed into place later)."""


def _appended(metrics: Path, known: _Position | None) -> tuple[_Position, bool, list[bytes], bytes]:
    """The new position, whether it continues `known`, the complete lines written after it (or
    all of them, when the file is not the one read then: the trainer appends, and a rewrite
    renames a new file into place), and the line being written (incomplete)."""
    inode = metrics.stat().st_ino
    with metrics.open("rb") as lines:
        if known is not None and known.inode == inode:
            lines.seek(max(0, known.offset - len(known.before)))
            if lines.read(len(known.before)) != known.before:
                known = None
        if known is not None and known.inode != inode:
            known = None
        start = 0 if known is None else known.offset
        lines.seek(start)
        data = lines.read()
    complete, newline, tail = data.rpartition(b"\n")
    before = b"" if known is None else known.before
    position = _Position(
        inode,
        start + len(complete) + len(newline),
        (before + complete + newline)[-64:],
    )
    return position, known is not None, complete.split(b"\n") if newline else [], tail


@dataclass(frozen=True)
class _Summary:
    """What `summary` read of a metrics.jsonl: its complete lines up to `position`."""

    position: _Position
    steps: int
    last: dict[str, Any]


@dataclass(frozen=True)
class _Parsed:
    """What `read_metrics` read of a metrics.jsonl: its complete lines up to `position`."""

    position: _Position
    metrics: Metrics


MAX_CACHED_RUNS = 8
"""Metrics files whose parsed lines `read_metrics` keeps (those of the run pages open)."""

_summaries: dict[Path, _Summary] = {}
_summaries_lock = threading.Lock()
_parsed: dict[Path, _Parsed] = {}
_parsed_lock = threading.Lock()


def summary(metrics: Path) -> tuple[int, dict[str, Any]]:
    """The training steps of a metrics.jsonl (`is_training_step`) and the latest value of each
    key, reading only the lines appended since the last call: the runs list reads every run's
    file on each load, megabytes for long runs."""
    with _summaries_lock:
        known = _summaries.get(metrics)
    position, continued, lines, tail = _appended(metrics, known.position if known else None)
    steps = known.steps if continued and known else 0
    last: dict[str, Any] = known.last if continued and known else {}
    for line in lines:
        row = _row(line)
        if row is not None:
            flat = flatten(row)
            steps += is_training_step(flat)
            last = latest_values(last, flat)
    with _summaries_lock:
        _summaries[metrics] = _Summary(position, steps, last)
    row = _row(tail)  # a line being written: counted while it reads as one, not kept
    if row is None:
        return steps, last
    flat = flatten(row)
    return steps + is_training_step(flat), latest_values(last, flat)


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
    dated = []
    for folder in _folders(runs_dir):
        if not is_text(folder.name):  # no run of the rollouts table can name the others
            continue
        try:
            found = (folder / METRICS_FILE).stat()
        except OSError:  # none, or a folder it may not look into: no run it can show
            continue
        if stat.S_ISREG(found.st_mode):
            dated.append((found.st_mtime, folder.name))
    return [name for _, name in sorted(dated, reverse=True)]


def _folders(runs_dir: Path) -> list[Path]:
    """What `runs_dir` holds; nothing when it is missing, not a folder or not readable (the
    runs page says which)."""
    try:
        return list(runs_dir.iterdir())
    except OSError:
        return []


def runs_dir_problem(runs_dir: Path) -> str | None:
    """Why `runs_dir` shows no run, said on the runs page, or None when it can be listed."""
    try:
        with os.scandir(runs_dir):
            return None
    except FileNotFoundError:
        return "does not exist (yet)"
    except NotADirectoryError:
        return "is not a folder: point REINS_RUNS_DIR at the trainer's runs_dir"
    except OSError as error:
        return f"cannot be read: {error.strerror or error}"


def _shown(name: str) -> str:
    """A folder's name as a page can show it (U+FFFD for bytes that are not UTF-8)."""
    return os.fsencode(name).decode("utf-8", errors="replace")


def is_text(name: str) -> bool:
    """Whether a file name read from the disk is text: a name whose bytes are not UTF-8 is
    read with surrogates in their place, which no page, link or UTF-8 encoder takes."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


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
