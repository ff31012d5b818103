"""Runs on disk, the chart panels, and their SVG drawing."""

from __future__ import annotations

import json
import math
import os
import re
import threading
from pathlib import Path

import pytest

from reins.monitor import runs
from reins.monitor.panels import Chart, Panel, Series, charts, stacked
from reins.monitor.runs import list_runs, load_run, run_path
from reins.monitor.svg import MAX_POINTS, nice_ticks, render, thinned
from tests.monitor.factory import write_run


def test_metrics_are_flattened_and_a_half_written_line_is_skipped(runs_dir: Path) -> None:
    run = load_run(write_run(runs_dir, "demo", steps=5))
    assert len(run.steps) == 5
    assert run.skipped_lines == 1
    assert run.steps[0]["samples/split_reasons/template"] == 2
    assert run.series("reward/mean")[0][0] == 1.0
    assert run.config_text and "group_size" in run.config_text


def test_the_runs_list_reads_only_what_was_appended_since_its_last_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every load of /ui/runs parsed every run's whole metrics.jsonl (megabytes for long runs)."""
    folder = tmp_path / "long"
    folder.mkdir()
    metrics = folder / "metrics.jsonl"

    def lines(steps: range) -> str:
        return "".join(json.dumps({"step": i, "reward": {"mean": i / 10}}) + "\n" for i in steps)

    def listed() -> tuple[int, dict[str, object]]:
        (info,) = list_runs(tmp_path)
        return info.steps, info.last

    def read_whole() -> tuple[int, dict[str, object]]:
        steps = load_run(folder).steps
        return len(steps), steps[-1] if steps else {}

    metrics.write_text(lines(range(500)) + "[1]\n" + '{"step": 500')  # a half-written line
    parsed: list[bytes] = []
    row = runs._row
    monkeypatch.setattr(runs, "_row", lambda line: parsed.append(line) or row(line))
    assert listed() == read_whole() == (500, {"step": 499, "reward/mean": 49.9})
    parsed.clear()
    with metrics.open("a") as log:
        log.write(', "reward": {"mean": 0.5}}\n' + lines(range(501, 503)))
    assert listed() == (503, {"step": 502, "reward/mean": 50.2})
    assert len(parsed) == 4  # the line completed, two more, and the empty tail
    assert read_whole() == (503, {"step": 502, "reward/mean": 50.2})
    # A resume rewrites the file (a new one renamed into place): read again from its start.
    staging = folder / "metrics.staging"
    staging.write_text(lines(range(3)))
    staging.replace(metrics)
    assert listed() == read_whole() == (3, {"step": 2, "reward/mean": 0.2})
    # Written over in place (same inode), longer than what was read: read again too.
    metrics.write_text(lines(range(100, 110)))
    assert listed() == read_whole() == (10, {"step": 109, "reward/mean": 10.9})


def test_the_run_page_parses_only_what_was_appended_since_its_last_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its charts poll every 10 s: a 5,000-step run's whole file was parsed each time (2.6 s)."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "loss": i}) + "\n" for i in range(100)))
    assert len(load_run(tmp_path).steps) == 100
    parsed: list[bytes] = []
    row = runs._row
    monkeypatch.setattr(runs, "_row", lambda line: parsed.append(line) or row(line))
    with metrics.open("a") as log:
        log.write('{"step": 100, "loss": 100}\nnot json\n{"step": 101')
    run = load_run(tmp_path)
    assert parsed == [b'{"step": 100, "loss": 100}', b"not json", b'{"step": 101']
    assert [row["step"] for row in run.steps] == list(range(101))
    assert run.skipped_lines == 2  # the line that is not JSON, and the one being written
    assert load_run(tmp_path).steps == run.steps


def test_the_runs_list_shows_each_keys_latest_value_and_counts_training_steps(
    tmp_path: Path,
) -> None:
    """The trainer's final validation is a line of its own: it showed as the run's last line,
    with no training reward, and counted as a step."""
    folder = tmp_path / "done"
    folder.mkdir()
    rows = [
        {"step": 1, "time": 1.0, "reward": {"mean": 0.1}, "loss": 0.5, "weight_version": 1},
        {"step": 2, "time": 2.0, "reward": {"mean": 0.4}, "val/reward_mean": 0.2},
        {"step": 2, "time": 3.0, "val/reward_mean": 0.3, "weight_version": 2, "loss": None},
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (info,) = list_runs(tmp_path)
    assert info.steps == 2
    assert info.last == {
        "step": 2,
        "time": 3.0,
        "reward/mean": 0.4,
        "loss": 0.5,
        "val/reward_mean": 0.3,
        "weight_version": 2,
    }


def test_missing_keys_are_skipped_and_unknown_keys_get_their_own_chart(tmp_path: Path) -> None:
    rows = [
        {"step": 1, "reward/mean": 0.1, "weird": "text", "flag": True, "x/new": 3},
        {"step": 2, "reward/mean": None, "x/new": float("nan")},
        {"step": 3, "reward/mean": 0.3, "x/new": 5},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n[1]\n")
    run = load_run(tmp_path)
    assert run.skipped_lines == 1  # a JSON line that is not an object
    found = {chart.panel.title: chart for chart in charts(run)}
    assert set(found) == {"Reward", "x/new"}
    assert found["Reward"].series[0].points == [(1.0, 0.1), (3.0, 0.3)]
    assert found["x/new"].series[0].points == [(1.0, 3.0), (3.0, 5.0)]


def test_each_agent_metric_gets_one_chart_with_training_and_validation(tmp_path: Path) -> None:
    rows = [
        {"step": 0, "val/reward_mean": 0.1, "val/agent/searches": 0.5, "val/agent/answered": 0.2},
        {"step": 1, "reward/mean": 0.2, "agent/searches": 1.0, "agent/answered": 0.5},
        {"step": 2, "reward/mean": 0.3, "agent/searches": 1.5, "agent/tool_calls": 4},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    found = {chart.panel.title: chart for chart in charts(load_run(tmp_path))}
    assert set(found) == {"Reward", "Agent: answered", "Agent: searches", "Agent: tool_calls"}
    searches = found["Agent: searches"].series
    assert [(s.name, s.points) for s in searches] == [
        ("train", [(1.0, 1.0), (2.0, 1.5)]),
        ("val", [(0.0, 0.5)]),
    ]
    assert [s.name for s in found["Agent: tool_calls"].series] == ["train"]


def test_split_reasons_become_one_series_per_reason_labelled_by_reason(runs_dir: Path) -> None:
    run = load_run(write_run(runs_dir, "demo", steps=3))
    chart = next(c for c in charts(run) if c.panel.title.startswith("Split reasons"))
    assert [s.name for s in chart.series] == ["retokenized", "template", "branch", "unknown"]


def test_reward_chart_carries_a_std_band_and_sparse_validation(runs_dir: Path) -> None:
    run = load_run(write_run(runs_dir, "demo", steps=20))
    reward = charts(run)[0]
    assert reward.band is not None and len(reward.band[0]) == 20
    val = next(s for s in reward.series if s.key == "val/reward_mean")
    assert [x for x, _ in val.points] == [10.0, 20.0]


def test_stacked_parts_add_up_and_a_missing_part_counts_zero() -> None:
    xs, tops = stacked([Series("a", [(1, 1.0), (2, 2.0)]), Series("b", [(2, 3.0)])])
    assert xs == [1, 2]
    assert tops == [[1.0, 2.0], [1.0, 5.0]]


def test_svg_draws_every_chart_with_escaped_labels(runs_dir: Path) -> None:
    run = load_run(write_run(runs_dir, "demo", steps=12))
    for chart in charts(run):
        drawing = render(chart)
        assert drawing.startswith("<svg") and drawing.endswith("</svg>")
        assert "<polyline" in drawing or "<polygon" in drawing
    (tmp := runs_dir / "odd").mkdir()
    (tmp / "metrics.jsonl").write_text(json.dumps({"step": 1, "<b>": 1}) + "\n")
    assert "&lt;b&gt;" in render(charts(load_run(tmp))[0])


def test_values_near_a_doubles_limit_are_not_drawn(tmp_path: Path) -> None:
    # Their span overflowed to infinity: the run page was a 500 and `reins report` a traceback.
    rows = [
        {"step": 1, "reward/mean": 1e308, "reward/std": 0.1, "loss": 2.0},
        {"step": 2, "reward/mean": -1e308, "reward/std": 0.1, "loss": 3.0},
        {"step": 3, "reward/mean": 0.5, "reward/std": 1e308, "loss": 1.0},
        {"step": 1e308, "loss": 4.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = load_run(tmp_path)
    assert run.series("reward/mean") == [(3.0, 0.5)]
    assert run.series("loss") == [(1.0, 2.0), (2.0, 3.0), (3.0, 1.0), (3.0, 4.0)]
    assert all(render(chart).startswith("<svg") for chart in charts(run))


def test_steps_past_two_to_the_53_are_drawn(tmp_path: Path) -> None:
    """One minus 2**60 is 2**60 in floats: the x range of a single step was empty (a 500)."""
    rows = [{"step": 2**60, "reward/mean": 0.5}, {"step": 2**60, "loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    drawings = [render(chart) for chart in charts(load_run(tmp_path))]
    assert len(drawings) == 2
    assert all(f"at step {2**60:.10g}: " in drawing for drawing in drawings)


def long_series(count: int) -> list[tuple[float, float]]:
    return [(float(step), 100.0 if step == 3333 else step % 7 / 10) for step in range(count)]


def test_a_long_series_is_thinned_keeping_its_ends_and_spikes() -> None:
    points = long_series(5000)
    drawn = thinned(points)
    assert len(drawn) <= MAX_POINTS + 2
    assert drawn[0] == points[0] and drawn[-1] == points[-1]
    assert (3333.0, 100.0) in drawn
    assert drawn == sorted(drawn)
    assert thinned(points[:MAX_POINTS]) == points[:MAX_POINTS]


def test_every_point_drawn_has_its_hover_title_however_long_the_run() -> None:
    """Past 300 points no point had a title: "Hover a point for its value" showed nothing."""
    points = long_series(5000)
    drawing = render(Chart(Panel("Loss", ("loss",)), [Series("loss", points)]))
    titles = re.findall(r"<title>loss at step ([0-9.e+]+): ([0-9.e+-]+)</title>", drawing)
    assert [(float(x), float(y)) for x, y in titles] == thinned(points)
    assert len(drawing) < 150_000  # was ~60 kB of polyline per 5,000 points, and no titles


def test_nice_ticks_of_values_one_float_apart_end() -> None:
    # The ticks were summed step by step: a step below the float spacing never reached the top,
    # and the run page (and `reins report`) spun forever.
    low = 12345.6
    high = math.nextafter(low, math.inf)
    found: list[list[float]] = []
    worker = threading.Thread(target=lambda: found.append(nice_ticks(low, high)), daemon=True)
    worker.start()
    worker.join(60)
    assert found, "nice_ticks did not return"
    (ticks,) = found
    assert 2 <= len(ticks) <= 7 and ticks[0] <= low and ticks[-1] >= high


def test_nice_ticks_cover_the_range_with_round_steps() -> None:
    assert nice_ticks(0.03, 0.97) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(5.0, 5.0)[0] < 5.0 < nice_ticks(5.0, 5.0)[-1]


def test_runs_are_listed_latest_first_and_names_cannot_escape(runs_dir: Path) -> None:
    write_run(runs_dir, "old", steps=2)
    write_run(runs_dir, "new", steps=3)
    (runs_dir / "not-a-run").mkdir()
    old = runs_dir / "old" / "metrics.jsonl"
    os.utime(old, (1, 1))
    infos = list_runs(runs_dir)
    assert [i.name for i in infos] == ["new", "old"]
    assert infos[0].steps == 3
    assert list_runs(runs_dir / "missing") == []
    for bad in ("..", "a/b", ""):
        with pytest.raises(ValueError):
            run_path(runs_dir, bad)
    with pytest.raises(FileNotFoundError, match=r"no metrics\.jsonl"):
        load_run(runs_dir / "not-a-run")


def test_a_run_pages_charts_are_drawn_again_only_when_its_metrics_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each open run page polls its charts every 10 s, and every poll drew every chart again: a
    run of 600 metric keys took ~5 s of the gateway's CPU per poll with nothing new to show."""
    from reins.monitor import dashboard

    folder = tmp_path / "wide"
    folder.mkdir()
    metrics = folder / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "a": s, "b": -s}) + "\n" for s in range(3)))
    drawn: list[str] = []

    def counted(chart: Chart) -> str:
        drawn.append(chart.panel.title)
        return render(chart)

    monkeypatch.setattr(dashboard.svg, "render", counted)
    first, first_tag = dashboard._drawn(load_run(folder))
    again, again_tag = dashboard._drawn(load_run(folder))
    assert (again, again_tag) == (first, first_tag)
    assert sorted(drawn) == ["a", "b"]  # drawn once, not on the second read
    with metrics.open("a") as appending:
        appending.write(json.dumps({"step": 3, "a": 99}) + "\n")
    after, after_tag = dashboard._drawn(load_run(folder))
    assert sorted(drawn) == ["a", "a", "b", "b"]
    assert "99" in after[0] and "99" not in first[0]
    assert after_tag != first_tag
