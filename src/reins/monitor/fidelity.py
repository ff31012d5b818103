"""A training run's capture fidelity: `reins doctor`'s report, computed from the run's recorded
rollouts, for the page `/ui/runs/{name}/fidelity`.

What it keeps:
- **One implementation.** The figures, split examples and findings are
  `reins.doctor.report.build_report`'s, fed one `HarnessRun` per rollout (the calls of its latest
  attempt, the one the trainer reads), and the rows are `reins.doctor.render.rows`: the page and
  `reins doctor` cannot disagree. A rollout's "exit" is its agent log's exit code when it has one,
  else 0 for `succeeded` and 1 for `failed`.
- **Bounded.** Only finished rollouts are read, the latest `MAX_ROLLOUTS` of the run (by
  creation), and at most `MAX_CALLS` calls of each; the page says when it read fewer than there
  are. Unfinished rollouts are left out (their calls are still coming).
- **Text checks need the tokenizer.** Without `REINS_MONITOR_TOKENIZER` token fidelity is not
  checked and split reasons are token-only, as `reins doctor --engine` without `--tokenizer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from reins.doctor.render import rows
from reins.doctor.report import Detokenizer, DoctorReport, HarnessRun, build_report
from reins.gateway.store import RolloutQuery, Store
from reins.monitor.tokens import TokenText
from reins.packed import unpack_events
from reins.schemas import AGENT_LOG, MODEL_REQUEST, PackedEvent, Rollout

MAX_ROLLOUTS = 200
"""Finished rollouts of a run read for the page (the latest ones)."""
MAX_CALLS = 1000
"""Calls of one rollout read for the page."""
MAX_LOGS = 100
"""Agent logs of one rollout read for the page (the controller writes one per attempt: its exit
status and output tail)."""


@dataclass
class FidelityView:
    run: str
    report: DoctorReport
    rows: list[tuple[str, str]]
    finished: int
    """Finished rollouts the run has."""
    read: int
    """Of those, the rollouts read (at most MAX_ROLLOUTS)."""
    truncated_rollouts: list[str] = field(default_factory=list)
    """Rollouts with more than MAX_CALLS calls (only the first MAX_CALLS read)."""


def _exit_code(rollout: Rollout, logs: list[dict[str, Any]]) -> int:
    for log in reversed(logs):
        code = log.get("exit_code")
        if isinstance(code, int) and not isinstance(code, bool):
            return code
    return 0 if rollout.status.state == "succeeded" else 1


@dataclass
class StoredRun:
    """A finished rollout of the run and its latest attempt's calls and agent logs, as stored
    (`Store.get_packed_events`): restored off the event loop, prompts as arrays."""

    rollout: Rollout
    events: list[PackedEvent]


async def stored_runs(
    store: Store, run: str, limit: int | None = None
) -> tuple[list[StoredRun], int, list[str]]:
    """The run's latest `limit` (MAX_ROLLOUTS) finished rollouts, oldest first (as the runs of
    `reins doctor`); the finished count; the rollouts whose events were cut at MAX_CALLS."""
    query = RolloutQuery(states=("succeeded", "failed"), run=run, limit=limit or MAX_ROLLOUTS)
    rollouts, finished = await store.query_rollouts(query)
    out: list[StoredRun] = []
    cut: list[str] = []
    for rollout in reversed(rollouts):
        attempt = rollout.attempt_count
        if not attempt:
            out.append(StoredRun(rollout, []))
            continue
        # Read apart: the cap is on calls (a rollout's agent logs counted against it cut its
        # calls short, and called it cut when its calls were all read).
        calls = await store.get_packed_events(
            rollout.rollout_id, attempt_id=attempt, types=(MODEL_REQUEST,), limit=MAX_CALLS + 1
        )
        if len(calls) > MAX_CALLS:
            calls = calls[:MAX_CALLS]
            cut.append(rollout.rollout_id)
        logs = await store.get_packed_events(
            rollout.rollout_id, attempt_id=attempt, types=(AGENT_LOG,), limit=MAX_LOGS
        )
        out.append(StoredRun(rollout, sorted([*calls, *logs], key=lambda e: e.seq)))
    return out, finished, cut


def harness_runs(stored: Sequence[StoredRun]) -> list[HarnessRun]:
    """The rollouts as doctor runs (pure; CPU work). Their prompts are restored as arrays:
    as lists, a run of 200 rollouts of 50 calls growing to 32k tokens is ~160 M Python ints."""
    out: list[HarnessRun] = []
    for run in stored:
        calls: list[dict[str, Any]] = []
        logs: list[dict[str, Any]] = []
        for event in unpack_events(run.events, token_arrays=True):
            (calls if event.type == MODEL_REQUEST else logs).append(event.data)
        tail = str(logs[-1].get("tail") or "") if logs else ""
        code = _exit_code(run.rollout, logs)
        out.append(HarnessRun(run.rollout.rollout_id, calls, code, 0.0, tail))
    return out


def fidelity_view(
    run: str,
    stored: list[StoredRun],
    finished: int,
    cut: list[str],
    text: TokenText | None,
) -> FidelityView:
    """The page's data (pure; CPU work: call it off the event loop)."""
    detok = Detokenizer(text.tokenizer) if text is not None else None
    runs = harness_runs(stored)
    report = build_report(runs, detok)
    return FidelityView(run, report, rows(report), finished, len(runs), cut)
