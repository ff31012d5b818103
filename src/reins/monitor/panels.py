"""Which metrics go in which chart: one list shared by the dashboard's run page and `reins report`.

Keys follow the trainer's `metrics.jsonl` contract. A key ending in `/` takes every key under it
(`samples/split_reasons/` takes each reason). A panel whose keys a run never measured is left out;
numeric keys that no panel names get a chart of their own, so nothing the trainer logs is hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from reins.monitor.runs import Run, number, step_of

Points = list[tuple[float, float]]


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]
    """Metric keys drawn; a key ending in `/` is a prefix."""
    kind: Literal["line", "stacked"] = "line"
    """`stacked`: the series are parts of a whole (the step time split)."""
    band: tuple[str, str] | None = None
    """(mean, std) keys: a shaded mean ± std band."""
    total: str | None = None
    """A key drawn as a dashed line over a stacked panel (the whole the parts add up to)."""
    unit: str = ""


PANELS: tuple[Panel, ...] = (
    Panel("Reward", ("reward/mean", "val/reward_mean"), band=("reward/mean", "reward/std")),
    Panel("Policy entropy", ("policy/entropy",)),
    Panel("One-sample-rollout ratio", ("samples/one_sample_rollout_ratio",)),
    Panel("Samples per rollout", ("samples/per_rollout",)),
    Panel("Split reasons (count per step)", ("samples/split_reasons/",)),
    Panel(
        "Step time split",
        ("time/rollout", "time/wait", "time/update", "time/publish"),
        kind="stacked",
        total="time/step",
        unit="s",
    ),
    Panel("Loss", ("loss",)),
    Panel("Clip fraction", ("policy/clip_fraction",)),
    Panel("KL to the initial policy", ("policy/kl_initial",)),
    Panel("Logprob gap (trainer vs engine)", ("policy/logprob_gap",)),
    Panel("Failed rollouts", ("rollouts/failed",)),
    Panel("Throughput", ("throughput/tokens_per_s",), unit="tokens/s"),
)

AGENT_PREFIXES = ("agent/", "val/agent/")
"""The agents' own numbers (`reins.agent.report_reward(metrics=...)`), train and val."""

_AUX_KEYS = ("step", "time", "weight_version", "reward/std")
"""Keys shown elsewhere (axes, the band), never as a chart of their own."""


@dataclass(frozen=True)
class Series:
    key: str
    points: Points
    label: str = ""
    """What the legend says (the key without its panel's prefix); the key when empty."""

    @property
    def name(self) -> str:
        return self.label or self.key


@dataclass(frozen=True)
class Chart:
    """A panel resolved against one run: only the series that have points."""

    panel: Panel
    series: list[Series]
    band: tuple[Points, Points] | None = None
    """(low, high) of the mean ± std band, aligned step by step."""
    total: Series | None = None


def _matches(pattern: str, key: str) -> bool:
    return key.startswith(pattern) if pattern.endswith("/") else key == pattern


def _band(run: Run, mean_key: str, std_key: str) -> tuple[Points, Points] | None:
    low: Points = []
    high: Points = []
    for index, row in enumerate(run.steps):
        mean, std = number(row.get(mean_key)), number(row.get(std_key))
        if mean is not None and std is not None:
            x = step_of(row, index)
            low.append((x, mean - std))
            high.append((x, mean + std))
    return (low, high) if low else None


def charts(run: Run) -> list[Chart]:
    """The run's charts: every panel it has data for, then one per key no panel names."""
    keys = run.keys()
    used: set[str] = set(_AUX_KEYS)
    out: list[Chart] = []
    for panel in PANELS:
        labels = {
            k: k.removeprefix(pattern) if pattern.endswith("/") else k
            for pattern in panel.keys
            for k in keys
            if _matches(pattern, k)
        }
        used.update(labels)
        if panel.total:
            used.add(panel.total)
        series = [Series(k, run.series(k), label) for k, label in labels.items()]
        series = [s for s in series if s.points]
        if not series:
            continue
        band = _band(run, *panel.band) if panel.band else None
        total = None
        if panel.total and run.series(panel.total):
            total = Series(panel.total, run.series(panel.total))
        out.append(Chart(panel, series, band, total))
    out += _agent_charts(run, keys, used)
    for key in keys:
        if key not in used:
            out.append(Chart(Panel(key, (key,)), [Series(key, run.series(key))]))
    return out


def _agent_charts(run: Run, keys: list[str], used: set[str]) -> list[Chart]:
    """One chart per metric the agents report (`agent/<name>`, `val/agent/<name>`: searches
    per rollout, answer rate, tool calls...), training and validation on the same axes."""
    names = sorted(
        {k.removeprefix(prefix) for k in keys for prefix in AGENT_PREFIXES if k.startswith(prefix)}
    )
    out: list[Chart] = []
    for name in names:
        pairs = [(AGENT_PREFIXES[0] + name, "train"), (AGENT_PREFIXES[1] + name, "val")]
        series = [Series(key, run.series(key), label) for key, label in pairs if key in keys]
        used.update(key for key, _ in pairs)
        out.append(Chart(Panel(f"Agent: {name}", tuple(k for k, _ in pairs)), series))
    return out


def stacked(series: list[Series]) -> tuple[list[float], list[list[float]]]:
    """Steps where any part was measured, and the cumulative top of each part there (a part
    missing at a step counts 0)."""
    xs = sorted({x for s in series for x, _ in s.points})
    tops: list[list[float]] = []
    running = [0.0] * len(xs)
    for s in series:
        values = dict(s.points)
        running = [r + values.get(x, 0.0) for r, x in zip(running, xs, strict=True)]
        tops.append(list(running))
    return xs, tops
