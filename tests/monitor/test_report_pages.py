"""`reins report` into a folder an earlier report wrote: its overview pages are those of the new
report only, and nothing it did not write is touched (real matplotlib, real files)."""

from __future__ import annotations

import json
from pathlib import Path

from reins.monitor.report import OVERVIEW_CHARTS, write_report
from tests import required


def run_with(folder: Path, keys: list[str]) -> Path:
    folder.mkdir()
    rows = [{"step": s, **{key: s * (i + 1) for i, key in enumerate(keys)}} for s in range(3)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_a_shorter_report_leaves_no_overview_page_of_an_earlier_one(tmp_path: Path) -> None:
    """A report of 2 overview pages, then one of 1 into the same folder: `overview-2.png` of the
    first stayed, so the folder showed pages of two reports. Files of other names (the user's),
    links, and the new report's own chart of a metric named `overview-3` stay."""
    required.module("matplotlib", "the monitor extra: pip install -e '.[dev]'")
    plots = tmp_path / "plots"
    wide = [f"agent/metric_{i:02d}" for i in range(OVERVIEW_CHARTS + 1)]
    first = write_report(run_with(tmp_path / "wide", wide), plots)
    assert [path.name for path in first[:2]] == ["overview.png", "overview-2.png"]
    (plots / "overview-3.png").write_bytes(b"a stale page of an older report still")
    theirs = ["overview-02.png", "overview-2.png.bak", "overview-x.png", "notes.png"]
    for name in theirs:
        (plots / name).write_bytes(b"the user's")
    (tmp_path / "elsewhere.png").write_bytes(b"linked")
    (plots / "overview-9.png").symlink_to(tmp_path / "elsewhere.png")
    (plots / "overview-4.png").mkdir()

    second = write_report(run_with(tmp_path / "narrow", ["loss", "overview-3"]), plots)

    assert [path.name for path in second] == ["overview.png", "loss.png", "overview-3.png"]
    assert not (plots / "overview-2.png").exists()
    assert (plots / "overview-3.png").read_bytes().startswith(b"\x89PNG")  # the new chart
    for name in theirs:
        assert (plots / name).read_bytes() == b"the user's"
    assert (plots / "overview-9.png").is_symlink()
    assert (tmp_path / "elsewhere.png").read_bytes() == b"linked"
    assert (plots / "overview-4.png").is_dir()
