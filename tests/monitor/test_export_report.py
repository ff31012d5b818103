"""`reins export` (JSONL from a real gateway) and `reins report` (PNG curves)."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reins.cli import app
from reins.client import GatewayClient
from reins.monitor.export import export_rollouts, rollout_line
from reins.monitor.report import MAX_SLUG, OVERVIEW_CHARTS, ReportError, plain, write_report
from tests import required
from tests.conftest import Gateway
from tests.monitor.factory import chat_call, coding_rollout, declare, many_rollouts, post, write_run


async def test_export_writes_one_rollout_per_line_with_calls_rewards_and_logs(
    gateway: Gateway,
) -> None:
    coding_rollout(gateway, "fix-bug-1", run="demo")
    many_rollouts(gateway, 3, run="other")
    out = io.StringIO()
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        count = await export_rollouts(client, out, run="demo")
    assert count == 1
    (line,) = [json.loads(text) for text in out.getvalue().splitlines()]
    assert line["rollout_id"] == "fix-bug-1" and line["reward"] == 1.0
    assert line["input"]["repo"] == "acme/shop"
    (attempt,) = line["attempts"]
    calls = attempt["calls"]
    assert len(calls) == 6
    assert calls[0]["request"]["messages"][1]["content"].startswith("The pager")
    assert calls[0]["response"]["choices"][0]["message"]["content"].startswith("Let me look")
    assert calls[0]["prompt_tokens"] > 0 and "prompt_token_ids" not in calls[0]
    assert [c["sample"]["decision"] if c["sample"] else None for c in calls] == [
        "first", "merge", "retry", "split", None, "split",
    ]  # fmt: skip
    assert calls[1]["low_p_tokens"] == 13
    assert attempt["split_reasons"] == {"unknown": 1, "branch": 1}
    assert attempt["rewards"][0]["reason"] == "3 passed"
    assert "3 passed in 0.12s" in attempt["logs"][0]["tail"]
    assert attempt["events"][0]["type"] == "tool_result"


@pytest.mark.parametrize("tokens", [False, True])
async def test_export_reads_calls_as_stored_and_writes_what_the_whole_events_say(
    gateway: Gateway, tokens: bool
) -> None:
    """Export reads each rollout as stored (packed) with prompts restored as arrays; its line
    must be the one the whole JSON events give, token IDs included when asked."""
    coding_rollout(gateway, "fix-bug-1", run="demo")
    out = io.StringIO()
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        await export_rollouts(client, out, run="demo", tokens=tokens)
        detail = await client.get_rollout("fix-bug-1")
        whole = await client.get_events("fix-bug-1", all_attempts=True)
    expected = json.loads(json.dumps(rollout_line(detail, whole, tokens=tokens), default=str))
    (line,) = [json.loads(text) for text in out.getvalue().splitlines()]
    assert line == expected
    calls = line["attempts"][0]["calls"]
    prompts = [e.data["prompt_token_ids"] for e in whole if e.type == "model_request"]
    assert [c["prompt_tokens"] for c in calls] == [len(p) for p in prompts]
    if tokens:
        assert [c["prompt_token_ids"] for c in calls] == prompts


async def test_export_names_calls_by_their_place_in_the_calls_it_lists(gateway: Gateway) -> None:
    # "call N" in a sample's text counted only the calls trained on: after a failed call it
    # named the call after the one meant.
    user = [{"role": "user", "content": "hi"}]
    declare(gateway, [{"rollout_id": "numbered", "input": {}}])
    assert gateway.http.post("/api/rollouts/numbered/attempts").status_code == 200
    failed = chat_call(user, "", status=502, error="engine unreachable")
    post(gateway, "numbered", [failed, chat_call(user, "a"), chat_call(user, "b")])
    out = io.StringIO()
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        assert await export_rollouts(client, out) == 1
    calls = json.loads(out.getvalue())["attempts"][0]["calls"]
    assert [c["sample"]["decision"] if c["sample"] else None for c in calls] == [
        None, "retry", "first",
    ]  # fmt: skip
    assert calls[1]["sample"]["text"].startswith("dropped as a retry: call 3 has the same prompt")


async def test_export_can_include_token_ids_and_filter_by_status(gateway: Gateway) -> None:
    many_rollouts(gateway, 14, run="r")
    out = io.StringIO()
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        count = await export_rollouts(client, out, states=["failed"], tokens=True)
    lines = [json.loads(text) for text in out.getvalue().splitlines()]
    assert count == 2 and {line["status"] for line in lines} == {"failed"}
    call = lines[0]["attempts"][0]["calls"][0]
    assert len(call["response_token_ids"]) == len(call["response_logprobs"]) > 0


async def test_a_logprob_above_zero_counts_as_p_1(gateway: Gateway) -> None:
    # The gateway stores logprobs as recorded; exp() of one past ~709 overflowed: the export
    # stopped with OverflowError and the rollout's page was a 500.
    event = chat_call([{"role": "user", "content": "hi"}], "ok", logprobs=[800.0, -3.0])
    declare(gateway, [{"rollout_id": "odd", "input": {}}])
    assert gateway.http.post("/api/rollouts/odd/attempts").status_code == 200
    post(gateway, "odd", [event])
    out = io.StringIO()
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        assert await export_rollouts(client, out) == 1
    (call,) = json.loads(out.getvalue())["attempts"][0]["calls"]
    assert (call["min_logprob"], call["mean_logprob"], call["low_p_tokens"]) == (-3.0, 398.5, 1)
    page = gateway.http.get("/ui/rollouts/odd")
    assert page.status_code == 200
    assert "1 token with p &lt; 0.1" in page.text
    assert 'title="id 111 · logprob 800 · p 1"' in page.text


async def test_export_reads_every_page_of_a_gateway_with_small_pages(gateway: Gateway) -> None:
    # A page shorter than the export asked for was taken for the last: a gateway whose
    # REINS_MAX_PAGE_SIZE is below it had only its first page exported.
    gateway.settings.max_page_size = 2  # the running gateway reads its settings per request
    ids = many_rollouts(gateway, 5, run="paged")
    out = io.StringIO()
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        assert await export_rollouts(client, out) == 5
    assert sorted(json.loads(text)["rollout_id"] for text in out.getvalue().splitlines()) == ids


def test_export_command_writes_a_file(gateway: Gateway, tmp_path: Path) -> None:
    many_rollouts(gateway, 3, run="cli")
    (tmp_path / "exports").mkdir()
    out = tmp_path / "exports" / "rollouts.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "reins.cli", "export", "--run", "cli", "-o", str(out),
         "--gateway", gateway.url, "--api-key", gateway.api_key],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "exported 3 rollouts" in result.stderr
    assert len(out.read_text().splitlines()) == 3
    # A failed export (a wrong key) leaves the earlier file as it was: it was emptied.
    failed = subprocess.run(
        [sys.executable, "-m", "reins.cli", "export", "--run", "cli", "-o", str(out),
         "--gateway", gateway.url, "--api-key", "wrong"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert failed.returncode == 1, failed.stderr
    assert len(out.read_text().splitlines()) == 3
    assert sorted(p.name for p in out.parent.iterdir()) == ["rollouts.jsonl"]  # no part left


def test_export_to_a_file_named_with_brackets_says_where_it_wrote(
    gateway: Gateway, tmp_path: Path
) -> None:
    """The closing line read `[/y]` in the file's name as rich markup: a MarkupError traceback
    and exit 1 after a whole export was written."""
    many_rollouts(gateway, 2, run="cli")
    (tmp_path / "a[").mkdir()
    out = tmp_path / "a[" / "y]"
    result = subprocess.run(
        [sys.executable, "-m", "reins.cli", "export", "--run", "cli", "-o", str(out),
         "--gateway", gateway.url, "--api-key", gateway.api_key],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"exported 2 rollouts to {out}" in " ".join(result.stderr.split())
    assert len(out.read_text().splitlines()) == 2


def test_export_to_a_reader_that_went_away_ends_quietly_as_sigpipe_does(gateway: Gateway) -> None:
    """`reins export | head`: the export exited 1, as if it had failed."""
    many_rollouts(gateway, 3, run="cli")
    exporting = subprocess.Popen(
        [sys.executable, "-m", "reins.cli", "export", "--gateway", gateway.url,
         "--api-key", gateway.api_key],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert exporting.stdout is not None and exporting.stderr is not None
    exporting.stdout.close()  # no reader left: its first write fails
    errors = exporting.stderr.read()
    assert exporting.wait(timeout=120) == 128 + signal.SIGPIPE
    assert errors == ""


def test_export_command_says_when_the_key_is_wrong(gateway: Gateway, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "reins.cli", "export", "--gateway", gateway.url,
         "--api-key", "wrong", "-o", str(tmp_path / "x.jsonl")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "401" in result.stderr and "admin key" in result.stderr


def test_export_command_says_when_it_cannot_write_the_file(tmp_path: Path) -> None:
    # Opening the file raised out of the command: a traceback instead of a line saying why.
    for target in (tmp_path / "missing" / "x.jsonl", tmp_path):
        result = CliRunner().invoke(app, ["export", "--api-key", "k", "-o", str(target)])
        assert result.exit_code == 2, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
        assert f"cannot write {target}" in result.output


def test_report_writes_a_png_per_chart_and_an_overview(runs_dir: Path, tmp_path: Path) -> None:
    image = required.module("matplotlib.image", "the monitor extra: pip install -e '.[dev]'")
    written = write_report(write_run(runs_dir, "demo"), tmp_path / "plots")
    names = [path.name for path in written]
    assert names[0] == "overview.png"
    assert {"reward.png", "step-time-split.png", "split-reasons-count-per-step.png"} <= set(names)
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert image.imread(path).std() > 0.01  # something is drawn


def test_report_command_defaults_to_the_run_folder(runs_dir: Path) -> None:
    folder = write_run(runs_dir, "demo", steps=5)
    result = subprocess.run(
        [sys.executable, "-m", "reins.cli", "report", "--run", str(folder)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (folder / "report" / "overview.png").exists()


def test_report_says_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no metrics"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "note": "warming up"}\n')
    with pytest.raises(ReportError, match=r"no numeric metrics yet \(1 steps read\)"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5\n[1, 2]\n')
    with pytest.raises(ReportError, match=r"\(0 steps read; 2 lines skipped, not JSON objects\)"):
        write_report(tmp_path)


def test_report_of_a_metric_named_overview_keeps_the_overview(tmp_path: Path) -> None:
    # A chart of its own for a key `overview` was written to overview.png, over the grid.
    required.module("matplotlib", "the monitor extra: pip install -e '.[dev]'")
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 1, "reward/mean": 0.5, "overview": 3}, {"step": 2, "reward/mean": 0.7}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    written = write_report(run, tmp_path / "plots")
    assert [path.name for path in written] == ["overview.png", "reward.png", "overview-.png"]


async def test_an_exported_call_is_json_and_keeps_the_events_seq(gateway: Gateway) -> None:
    """Two finite logprobs of -1.7e308 made a mean of -inf, written as `-Infinity` (no JSON
    reader takes it); a `seq` in a call's data replaced the event's."""
    event = chat_call([{"role": "user", "content": "hi"}], "ok", logprobs=[-1.7e308, -1.7e308])
    event["data"]["seq"] = 999
    declare(gateway, [{"rollout_id": "edge", "input": {}}])
    assert gateway.http.post("/api/rollouts/edge/attempts").status_code == 200
    post(gateway, "edge", [event])
    (stored,) = gateway.http.get("/api/rollouts/edge/events").json()
    out = io.StringIO()
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        assert await export_rollouts(client, out) == 1
    (call,) = json.loads(out.getvalue(), parse_constant=pytest.fail)["attempts"][0]["calls"]
    assert (call["seq"], call["mean_logprob"]) == (stored["seq"], -1.7e308)
    assert gateway.http.get("/ui/rollouts/edge").status_code == 200


async def test_a_rewards_seq_is_the_events_whatever_its_data_says(gateway: Gateway) -> None:
    """A harness writes a reward's data, extra keys allowed: its `seq` replaced the event's in
    the export (and in the rollout's view)."""
    declare(gateway, [{"rollout_id": "r", "input": {}}])
    assert gateway.http.post("/api/rollouts/r/attempts").status_code == 200
    post(gateway, "r", [{"type": "reward", "data": {"value": 1.0, "seq": 12345}}])
    (event,) = gateway.http.get("/api/rollouts/r/events").json()
    out = io.StringIO()
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        assert await export_rollouts(client, out) == 1
    (reward,) = json.loads(out.getvalue())["attempts"][0]["rewards"]
    assert reward == {"seq": event["seq"], "value": 1.0}


def test_report_of_metrics_with_long_names_writes_every_chart(tmp_path: Path) -> None:
    """A ~250-character key made a file name past 255 bytes: "File name too long", and the
    charts after it were never written."""
    required.module("matplotlib", "the monitor extra: pip install -e '.[dev]'")
    run = tmp_path / "run"
    run.mkdir()
    long = "agent/" + "tool_calls_of_" * 18
    rows = [{"step": s, long + "a": s, long + "b": -s, "loss": s} for s in range(3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    written = write_report(run, tmp_path / "plots")
    names = [path.name for path in written]
    assert len(names) == len(set(names)) == 4  # the overview, loss, and both long ones
    assert max(len(name) for name in names) <= MAX_SLUG + len("-12345678.png")
    assert all(path.is_file() for path in written)


def test_report_of_many_metrics_keeps_each_overview_a_usable_size(tmp_path: Path) -> None:
    """600 metric keys made one overview of 1650 x 74,800 pixels; now the charts go on pages of
    `OVERVIEW_CHARTS`, each at most 8 rows high, and a metric named `overview-2` keeps its own."""
    image = required.module("matplotlib.image", "the monitor extra: pip install -e '.[dev]'")
    run = tmp_path / "run"
    run.mkdir()
    keys = [f"agent/metric_{i:02d}" for i in range(OVERVIEW_CHARTS + 5)] + ["overview-2"]
    rows = [{"step": s, **{key: s * i for i, key in enumerate(keys)}} for s in range(3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    written = write_report(run, tmp_path / "plots")
    names = [path.name for path in written]
    assert names[:2] == ["overview.png", "overview-2.png"]
    assert "overview-2-.png" in names  # the metric's own chart
    assert len(names) == len(set(names)) == 2 + len(keys)
    for overview in written[:2]:
        height, width = image.imread(overview).shape[:2]
        assert height <= 8 * 3.4 * 110 + 1 and width <= 3 * 5 * 110 + 1, (overview, height)


def test_report_of_a_metric_with_dollar_signs_draws_them_as_written(tmp_path: Path) -> None:
    """matplotlib reads a pair of `$` as mathtext: a key `agent/cost $_$` stopped `reins report`
    with a parse error traceback."""
    required.module("matplotlib", "the monitor extra: pip install -e '.[dev]'")
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "agent/cost $_$": s, "loss": s} for s in range(2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    written = write_report(run, tmp_path / "plots")
    assert [path.name for path in written] == ["overview.png", "loss.png", "agent-cost.png"]
    assert plain("cost $_$ (s)") == r"cost \$_\$ (s)"
