"""`reins report`: PNG plots of a run's curves, for papers and issues (matplotlib, no display).

One PNG per chart of the run page (same panels, `reins.monitor.panels`), named after the chart,
and `overview.png` with them on one grid (`overview-2.png`, ... past `OVERVIEW_CHARTS`).
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


def plain(text: str) -> str:
    """`text` as matplotlib shows it as written: a pair of `$` is mathtext to it, so a metric's
    key such as `agent/cost $_$` stopped `reins report` with a parse error traceback, and
    `a $x$ b` came out in italics."""
    return text.replace("$", r"\$")


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
            ax.fill_between(xs, below, top, color=color, alpha=0.55, label=plain(series.name))
            below = top
    else:
        for i, series in enumerate(chart.series):
            marker = "o" if len(series.points) <= 60 else None
            ax.plot(
                [x for x, _ in series.points], [y for _, y in series.points],
                color=COLORS[i % len(COLORS)], marker=marker, markersize=3,
                label=plain(series.name),
            )  # fmt: skip
    if chart.total:
        ax.plot(
            [x for x, _ in chart.total.points], [y for _, y in chart.total.points],
            color="#111827", linestyle="--", linewidth=1.2, label=plain(chart.total.key),
        )  # fmt: skip
    ax.set_title(plain(panel.title + (f" ({panel.unit})" if panel.unit else "")), fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _skipped(lines: int) -> str:
    if not lines:
        return ""
    return f"; {lines} line{'s' if lines > 1 else ''} skipped, not JSON objects"


OVERVIEW_CHARTS = 24
"""Charts on one overview image (8 rows of 3): a run with 600 metric keys made one grid of
1650 x 74,800 pixels, which image viewers refuse or shrink to nothing; more charts go on
`overview-2.png`, `overview-3.png`, ..."""


def _overview(plt: ModuleType, title: str, shown: list[Chart], path: Path) -> Path:
    """One overview image: the charts `shown` on a grid of 3 columns."""
    columns = min(3, len(shown))
    rows = math.ceil(len(shown) / columns)
    # Constrained, not `tight_layout`: that one leaves the title out and drew it over the
    # first row's chart titles.
    figure, axes = plt.subplots(
        rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False, layout="constrained"
    )
    for ax, chart in zip(axes.flat, shown, strict=False):
        draw(ax, chart)
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    figure.suptitle(plain(title), fontsize=12)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


_OVERVIEW_PAGE = re.compile(r"overview-([1-9][0-9]*)\.png")
"""The name of an overview page past the first (`overview-2.png`, ...)."""


def _remove_stale_pages(out_dir: Path, pages: int) -> None:
    """Removes the overview pages past `pages` that an earlier report left in `out_dir` (a run
    with fewer charts now, or another run's report there): left, the folder showed pages of two
    reports. Only files of the report's own page names; links and folders are left alone."""
    for path in out_dir.iterdir():
        page = _OVERVIEW_PAGE.fullmatch(path.name)
        if page is None or int(page.group(1)) <= pages:
            continue
        if path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)


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
    pages = math.ceil(len(found) / OVERVIEW_CHARTS)
    # Before this report's own files: a chart of a metric named `overview-3` may be one of them.
    _remove_stale_pages(out_dir, pages)
    written: list[Path] = []
    for page in range(1, pages + 1):
        name = "overview.png" if page == 1 else f"overview-{page}.png"
        shown = found[(page - 1) * OVERVIEW_CHARTS : page * OVERVIEW_CHARTS]
        steps = run.training_steps
        title = f"run {run.name}: {steps} step{'' if steps == 1 else 's'}"
        title += f" ({page} of {pages})" if pages > 1 else ""
        written.append(_overview(plt, title, shown, out_dir / name))
    names = {path.stem for path in written}  # a metric named `overview` must not overwrite it
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
