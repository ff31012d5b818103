"""Charts as inline SVG, drawn on the server: no chart library, no JavaScript, no network.

Each chart is a plain SVG string with axes, ticks, a legend and a `<title>` on every point drawn
(the browser shows it on hover). Lines are polylines; a stacked panel draws filled areas. A long
run's series are thinned to about `MAX_POINTS` for drawing (`thinned`): a 5,000-step run's page
was 3.8 MB of SVG, drawn again on each 10 s poll.
"""

from __future__ import annotations

import math
from html import escape

from reins.monitor.panels import Chart, Points, stacked

COLORS = (
    "#2563eb",
    "#dc2626",
    "#16a34a",
    "#d97706",
    "#7c3aed",
    "#0891b2",
    "#db2777",
    "#65a30d",
    "#475569",
    "#ea580c",
)
WIDTH, HEIGHT = 480, 250
LEFT, RIGHT, BOTTOM = 56, 12, 30
LEGEND_ROW = 15
MAX_MARKERS = 300
"""Series with more points drawn than this get no visible markers, only hover targets."""
MAX_POINTS = 500
"""Points drawn per series, about: past it, each stretch's lowest and highest are kept (a chart
is 480 px wide; each point carries its hover title)."""


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return [0.0]
    if high - low < 1e-12:
        pad = abs(high) * 0.1 or 1.0
        low, high = low - pad, high + pad
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    # Each tick is its index times the step, not the previous tick plus the step: a step below
    # the values' float spacing (two values one ulp apart, above 1e4) added nothing, forever.
    ticks = []
    index = math.floor(low / step)
    while index * step <= high + step * 0.5:
        ticks.append(round(index * step, 12))
        index += 1
    return ticks


def fmt(value: float) -> str:
    """A short label: 0.25, 1.5k, 2e-05."""
    if value == 0:
        return "0"
    size = abs(value)
    if size >= 1e6:
        return f"{value / 1e6:.3g}M"
    if size >= 1e4:
        return f"{value / 1e3:.3g}k"
    if size < 1e-3:
        return f"{value:.1e}"
    return f"{value:.4g}"


def thinned(points: Points, limit: int = MAX_POINTS) -> Points:
    """At most about `limit` of `points` (in order) that draw the same line: the first, the
    last, and the lowest and highest of each stretch (a spike still shows)."""
    return [points[i] for i in _kept([y for _, y in points], limit)]


def _kept(ys: list[float], limit: int = MAX_POINTS) -> list[int]:
    """The indices `thinned` keeps of values `ys`."""
    if len(ys) <= limit:
        return list(range(len(ys)))
    stretches = limit // 2
    kept = {0, len(ys) - 1}
    for n in range(stretches):
        start = n * len(ys) // stretches
        stretch = ys[start : (n + 1) * len(ys) // stretches]
        kept.add(start + stretch.index(min(stretch)))
        kept.add(start + stretch.index(max(stretch)))
    return sorted(kept)


def _widened(low: float, high: float) -> tuple[float, float]:
    """A range of width for a single value: 1 either side, or a millionth of it where 1 is
    below the float spacing (a step past 2**53 minus 1 was itself: a division by zero)."""
    if high > low:
        return low, high
    pad = max(1.0, abs(low) * 1e-6)
    return low - pad, high + pad


class _Frame:
    def __init__(self, xs: list[float], ys: list[float], top: float) -> None:
        self.top = top
        x_low, x_high = _widened(*((min(xs), max(xs)) if xs else (0.0, 1.0)))
        y_low, y_high = (min(ys), max(ys)) if ys else (0.0, 1.0)
        self.y_ticks = nice_ticks(y_low, y_high)
        self.x_ticks = [t for t in nice_ticks(x_low, x_high, 6) if x_low <= t <= x_high]
        self.x_low, self.x_high = x_low, x_high
        self.y_low, self.y_high = _widened(self.y_ticks[0], self.y_ticks[-1])

    def x(self, value: float) -> float:
        span = WIDTH - LEFT - RIGHT
        return LEFT + (value - self.x_low) / (self.x_high - self.x_low) * span

    def y(self, value: float) -> float:
        span = HEIGHT - self.top - BOTTOM
        return HEIGHT - BOTTOM - (value - self.y_low) / (self.y_high - self.y_low) * span

    def path(self, points: Points) -> str:
        return " ".join(f"{self.x(x):.1f},{self.y(y):.1f}" for x, y in points)


def render(chart: Chart) -> str:
    """The chart as an `<svg>` element."""
    panel = chart.panel
    drawn = [thinned(s.points) for s in chart.series]
    xs = [x for points in drawn for x, _ in points]
    ys = [y for points in drawn for _, y in points]
    parts: list[str] = []
    tops: list[list[float]] = []
    stack_xs: list[float] = []
    if panel.kind == "stacked":
        stack_xs, tops = stacked(chart.series)
        kept = _kept(tops[-1]) if tops else []
        stack_xs, tops = [stack_xs[i] for i in kept], [[top[i] for i in kept] for top in tops]
        ys = [0.0, *(v for top in tops for v in top)]
    band = tuple(thinned(side) for side in chart.band) if chart.band else None
    if band:
        ys += [y for side in band for _, y in side]
    total = thinned(chart.total.points) if chart.total else []
    xs += [x for x, _ in total]
    ys += [y for _, y in total]
    names = [s.name for s in chart.series] + ([chart.total.key] if chart.total else [])
    legend, rows = _legend(names, has_total=chart.total is not None)
    frame = _Frame(xs, ys, top=34 + rows * LEGEND_ROW)
    unit = f" ({escape(panel.unit)})" if panel.unit else ""
    parts.append(f'<text x="{LEFT}" y="16" class="chart-title">{escape(panel.title)}{unit}</text>')
    for tick in frame.y_ticks:
        y = frame.y(tick)
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" class="tick" '
            f'text-anchor="end">{fmt(tick)}</text>'
        )
    for tick in frame.x_ticks:
        x = frame.x(tick)
        parts.append(
            f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" class="tick" '
            f'text-anchor="middle">{fmt(tick)}</text>'
        )
    parts.append(
        f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{HEIGHT - BOTTOM}" '
        f'y2="{HEIGHT - BOTTOM}" class="axis"/>'
        f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 2}" class="tick" text-anchor="end">step</text>'
    )
    if band:
        low, high = band
        outline = frame.path(low + high[::-1])
        parts.append(f'<polygon points="{outline}" fill="{COLORS[0]}" opacity="0.15"/>')
    if panel.kind == "stacked":
        below = [0.0] * len(stack_xs)
        for i, top in enumerate(tops):
            color = COLORS[i % len(COLORS)]
            upper = list(zip(stack_xs, top, strict=True))
            lower = list(zip(stack_xs, below, strict=True))[::-1]
            parts.append(
                f'<polygon points="{frame.path(upper + lower)}" fill="{color}" '
                f'opacity="0.55" stroke="{color}" stroke-width="1"/>'
            )
            below = top
    else:
        for i, (series, points) in enumerate(zip(chart.series, drawn, strict=True)):
            parts.append(_line(frame, points, COLORS[i % len(COLORS)], series.name))
    if total:
        parts.append(
            f'<polyline points="{frame.path(total)}" fill="none" stroke="#111827" '
            'stroke-width="1.5" stroke-dasharray="4 3"/>'
        )
    parts.append(legend)
    body = "".join(parts)
    label = escape(panel.title)
    return (
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label="{label}" xmlns="http://www.w3.org/2000/svg">{body}</svg>'
    )


def _line(frame: _Frame, points: Points, color: str, key: str) -> str:
    out = []
    if len(points) > 1:
        out.append(
            f'<polyline points="{frame.path(points)}" fill="none" stroke="{color}" '
            'stroke-width="1.8"/>'
        )
    # Every point drawn has its hover title; a dense series' markers are hover targets only
    # (transparent: still under the pointer), not dots that would hide the line.
    radius = 3 if len(points) <= 60 else 2.2
    seen = "" if len(points) <= MAX_MARKERS else ' fill-opacity="0"'
    out.append(f'<g fill="{color}"{seen}>')
    label = escape(key)
    for x, y in points:
        out.append(
            f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="{radius}">'
            f"<title>{label} at step {x:.10g}: {y:.6g}</title></circle>"
        )
    out.append("</g>")
    return "".join(out)


def _legend(names: list[str], *, has_total: bool) -> tuple[str, int]:
    """The legend's SVG and its number of rows (entries wrap at the chart's width)."""
    out = []
    x = LEFT
    row = 0
    for i, name in enumerate(names):
        width = 26 + 6 * len(name)
        if x > LEFT and x + width > WIDTH - RIGHT:
            x, row = LEFT, row + 1
        y = 31 + row * LEGEND_ROW
        is_total = has_total and i == len(names) - 1
        color = "#111827" if is_total else COLORS[i % len(COLORS)]
        label = escape(name)
        dash = ' stroke-dasharray="4 3"' if is_total else ""
        out.append(
            f'<line x1="{x}" x2="{x + 14}" y1="{y}" y2="{y}" stroke="{color}" stroke-width="3"'
            f"{dash}/>"
            f'<text x="{x + 18}" y="{y + 4}" class="legend">{label}</text>'
        )
        x += width
    return "".join(out), row + 1
