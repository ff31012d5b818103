"""`reins report`: PNG plots of a run's curves, for papers and issues (matplotlib, no display).

One PNG per chart of the run page (same panels, `reins.monitor.panels`), named after the chart,
and `overview.png` with all of them on one grid.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from reins.monitor.panels import Chart, charts, stacked
from reins.monitor.runs import load_run
from reins.monitor.svg import COLORS

if TYPE_CHECKING:
    from matplotlib.axes import Axes


class ReportError(Exception):
    """The report cannot be made; the message says why and what to do."""


def _pyplot() -> ModuleType:
    try:
        import matplotlib
    except ImportError as error:
        raise ReportError(
            "`reins report` needs matplotlib: pip install 'reins[monitor]'"
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


MAX_SLUG = 100
"""Characters of a chart's file name taken from its title: a file name has at most 255 bytes,
and a metric's key can be longer (`reins report` stopped with "File name too long")."""


def slug(title: str) -> str:
    """A file name for a chart title: `Step time split` -> `step-time-split`; a long title is
    cut, with a hash of the whole title after it so that two cut alike stay apart."""
    name = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "chart"
    if len(name) <= MAX_SLUG:
        return name
    digest = hashlib.sha256(title.encode()).hexdigest()[:8]
    return f"{name[:MAX_SLUG].rstrip('-')}-{digest}"


def draw(ax: Axes, chart: Chart) -> None:
    """One chart on a matplotlib Axes, as the dashboard draws it."""
    panel = chart.panel
    if chart.band:
        low, high = chart.band
        ax.fill_between(
            [x for x, _ in low], [y for _, y in low], [y for _, y in high],
            color=COLORS[0], alpha=0.15, linewidth=0, label="± std",
        )  # fmt: skip
    if panel.kind == "stacked":
        xs, tops = stacked(chart.series)
        below = [0.0] * len(xs)
        for i, (series, top) in enumerate(zip(chart.series, tops, strict=True)):
            color = COLORS[i % len(COLORS)]
            ax.fill_between(xs, below, top, color=color, alpha=0.55, label=series.name)
            below = top
    else:
        for i, series in enumerate(chart.series):
            marker = "o" if len(series.points) <= 60 else None
            ax.plot(
                [x for x, _ in series.points], [y for _, y in series.points],
                color=COLORS[i % len(COLORS)], marker=marker, markersize=3, label=series.name,
            )  # fmt: skip
    if chart.total:
        ax.plot(
            [x for x, _ in chart.total.points], [y for _, y in chart.total.points],
            color="#111827", linestyle="--", linewidth=1.2, label=chart.total.key,
        )  # fmt: skip
    ax.set_title(panel.title + (f" ({panel.unit})" if panel.unit else ""), fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _skipped(lines: int) -> str:
    if not lines:
        return ""
    return f"; {lines} line{'s' if lines > 1 else ''} skipped, not JSON objects"


def write_report(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Writes the PNGs of the run in `run_dir` into `out_dir` (default `<run_dir>/report`);
    returns their paths, overview first."""
    plt = _pyplot()
    run = load_run(run_dir)
    found = charts(run)
    if not found:
        raise ReportError(
            f"{run_dir / 'metrics.jsonl'} has no numeric metrics yet "
            f"({len(run.steps)} steps read{_skipped(run.skipped_lines)}): nothing to plot"
        )
    out_dir = out_dir or run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    columns = min(3, len(found))
    rows = math.ceil(len(found) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    for ax, chart in zip(axes.flat, found, strict=False):
        draw(ax, chart)
    for ax in list(axes.flat)[len(found) :]:
        ax.set_visible(False)
    figure.suptitle(f"run {run.name}: {run.training_steps} steps", fontsize=12)
    figure.tight_layout()
    overview = out_dir / "overview.png"
    figure.savefig(overview, dpi=110)
    plt.close(figure)
    written.append(overview)
    names = {overview.stem}  # a metric named `overview` must not overwrite the grid
    for chart in found:
        name = slug(chart.panel.title)
        while name in names:
            name += "-"
        names.add(name)
        figure, ax = plt.subplots(figsize=(6, 3.6))
        draw(ax, chart)
        figure.tight_layout()
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=130)
        plt.close(figure)
        written.append(path)
    return written
