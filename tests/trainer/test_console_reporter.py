"""The console's progress bar (`runtime.ConsoleReporter`, which `reins train` enters on every
rank of a sharded run)."""

from __future__ import annotations

import io

from rich.console import Console

from reins.trainer.runtime import ConsoleReporter


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=120), out


def test_a_reporter_told_nothing_draws_no_progress() -> None:
    # A rank other than 0 only follows rank 0's updates: it reports no phase and no step, and
    # drew a `step 0/4` bar as if it led the run.
    console, out = _console()
    with ConsoleReporter(console, 4, 0):
        pass
    assert out.getvalue() == ""


def test_the_leader_draws_its_steps() -> None:
    console, out = _console()
    with ConsoleReporter(console, 4, 0) as reporter:
        reporter.phase(0, "rollouts")
        reporter.step_done({"step": 0, "reward/mean": 0.5, "time/step": 2.0})
        reporter.step_done({"step": 1, "reward/mean": 0.75, "time/step": 2.0})
    text = out.getvalue()
    assert "step 2/4" in text
    assert "reward 0.750" in text
    assert "step 0/4" not in text.splitlines()[-1]


def test_a_resumed_run_shows_the_steps_its_checkpoint_made() -> None:
    # `reins train --resume` from step 2 of 4 read `step 0/4` until its first step ended.
    console, out = _console()
    with ConsoleReporter(console, 4, 0) as reporter:
        reporter.phase(2, "rollouts")
    assert out.getvalue().startswith("step 2/4 ")
