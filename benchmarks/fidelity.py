"""Capture fidelity across real harnesses: how many rollouts are one training sequence, token
reuse off and on, and whether any record differs from what its harness received.

One embedded engine (the default model) and two gateways in front of it, `token_reuse` off and
on. Each harness holds the same kind of multi-turn task with tool calls in `train` mode (the
proxy samples at temperature 1): the weather tool offered after few-shot tool turns, a tool's
result or a follow-up question after each answer, 4-8 model calls (tests/harness/drivers.py).
Each rollout's recorded calls go through `reins doctor`'s report (`reins.doctor.report`: dedup
and merge exactly as the trainer does, split reasons with one decoded example each, and records
whose tokens do not say what the gateway answered); what each harness itself received (its own
objects: the SDK's messages, LangGraph's state, the Agents SDK's items, mini-swe-agent's
trajectory) is compared with the decoded tokens too (`reins.doctor.received.matches`).

    .venv/bin/python benchmarks/fidelity.py              # 5 append-only harnesses, 1 rollout a cell
    .venv/bin/python benchmarks/fidelity.py --long       # 5 a cell, mini-swe-agent, the 3 CLIs
    .venv/bin/python benchmarks/fidelity.py --harnesses litellm,langgraph --rollouts 4

Harnesses, and whether their history is append-only (each call's messages are the previous
call's, its answer as received, and new messages): the only histories whose rollouts can be one
sequence, so the only ones in the headline.

- `sdk-streamed`, `sdk-plain` (the `openai` SDK, chat completions): append-only.
- `litellm` (`litellm.completion`, its `Message` objects sent back): append-only.
- `langgraph` (the prebuilt ReAct agent on `langchain-openai`): append-only (the graph's state
  is the message list; each run adds to it).
- `openai-agents` (the Agents SDK's `Runner`, chat-completions model, `to_input_list`):
  append-only.
- `mini-swe-agent` (default agent, `mini.yaml`, litellm tool-calling model): NOT append-only. An
  answer without exactly one valid `bash` call is rejected: the agent keeps it out of its
  history and sends a format-error message instead, so the next prompt drops that answer (split
  `dropped`, on purpose). `--long` only; shown, excluded from the headline.
- `claude`, `codex`, `opencode` (`--long` only; the Messages, Responses and chat APIs): two CLI
  runs of `List the files.` in one session resumed from a few-shot session
  (tests/harness/cli_support.py, tests/harness/cli_drivers.py): each call sends the session's
  transcript as the CLI keeps it, append-only. In the headline when their rollouts made more than
  one call in all (a rollout of one call has nothing to merge).

The engine runs on one torch thread by default (`--threads`): the benchmark measures fidelity,
not speed, and on a shared 2-core machine two OpenMP threads waiting for each other made a decode
step 15x slower (25 s instead of 1.6 s for 6 sequences at load 10).

The last line is the headline: `fidelity_one_sequence_ratio_min: VALUE ratio`, the lowest
one-sequence ratio, reuse on, over the append-only harnesses that ran (the paper's coding run:
0.36). A harness that cannot run here is printed as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reins.doctor.received import Answer, matches  # noqa: E402
from reins.doctor.report import (  # noqa: E402
    Detokenizer,
    DoctorReport,
    HarnessRun,
    build_report,
    format_boundary,
)
from reins.gateway import GatewaySettings  # noqa: E402
from reins.gateway.capture import SamplingPolicy  # noqa: E402
from tests.conftest import ADMIN_KEY  # noqa: E402
from tests.embedded_support import ServedEngine, served_engine  # noqa: E402
from tests.harness import drivers  # noqa: E402
from tests.harness.conftest import Rollout, gateway_for, open_rollout  # noqa: E402

Task = Callable[[Rollout, Path], list[Answer] | None]
"""Runs one task on a rollout; returns what the harness received call by call (None: its output
does not say that call by call, and only the record-side check applies)."""
CLI_MAX_TOKENS = 48
"""The CLIs' gateways cap answers at this (a CLI's own cap wins): `train` mode sets no cap, and a
CLI that sends none would otherwise sample up to the context's end."""


@dataclass(frozen=True)
class Harness:
    name: str
    task: Task
    append_only: bool
    why: str = ""
    """Why its history is not append-only (printed with its figures)."""
    needs: tuple[str, ...] = ()
    """Python modules it imports: missing ones make it a skip."""
    cli: str = ""
    """The coding-agent CLI it runs (`--long` only): a missing one makes it a skip."""
    slow: bool = False
    """Run with `--long` only (besides the CLIs): it takes longer and is not in the headline."""

    @property
    def long_only(self) -> bool:
        return bool(self.cli) or self.slow


def _cli_task(name: str) -> Task:
    def task(rollout: Rollout, workdir: Path) -> list[Answer] | None:
        from tests.harness import cli_drivers

        return cli_drivers.TASKS[name](rollout, workdir)

    return task


HARNESSES = [
    Harness("sdk-streamed", drivers.sdk_streamed_task, True, needs=("openai",)),
    Harness("sdk-plain", drivers.sdk_plain_task, True, needs=("openai",)),
    Harness("litellm", drivers.litellm_task, True, needs=("litellm",)),
    Harness("langgraph", drivers.langgraph_task, True, needs=("langgraph", "langchain_openai")),
    Harness("openai-agents", drivers.openai_agents_task, True, needs=("agents",)),
    Harness(
        "mini-swe-agent",
        drivers.mini_swe_agent_task,
        False,
        why="drops a rejected answer (no valid bash call) from its history",
        needs=("minisweagent",),
        slow=True,
    ),
    Harness("claude", _cli_task("claude"), True, cli="claude"),
    Harness("codex", _cli_task("codex"), True, cli="codex"),
    Harness("opencode", _cli_task("opencode"), True, cli="opencode"),
]


@dataclass
class RolloutResult:
    harness: str
    reuse: bool
    rollout_id: str
    calls: list[dict[str, Any]]
    received: list[Answer] | None
    seconds: float
    error: str = ""


@dataclass
class Cell:
    """One harness with one reuse setting: its rollouts and their report."""

    harness: Harness
    reuse: bool
    results: list[RolloutResult] = field(default_factory=list)
    report: DoctorReport | None = None
    tool_answers: int = 0
    harness_mismatched: int = 0
    harness_unaligned: int = 0
    """Rollouts whose recorded answers cannot be paired one to one with what the harness got
    (a retried or failed call)."""
    harness_unchecked: int = 0
    """Rollouts whose harness does not say what it received call by call."""


def harness_mismatches(
    calls: list[dict[str, Any]], received: list[Answer], detok: Detokenizer
) -> int | None:
    """How many answered calls' tokens do not say what the harness itself received (paired in
    call order); None when the answered calls and the received answers differ in number."""
    answered = [c for c in calls if c.get("status") == 200 and not c.get("abandoned")]
    if len(answered) != len(received):
        return None
    return sum(
        1
        for call, got in zip(answered, received, strict=True)
        if not matches(detok.shown(call["response_token_ids"]), got)
    )


def cell_report(cell: Cell, detok: Detokenizer) -> None:
    """Fills `cell`'s report and harness-side counts from its rollouts."""
    runs = [
        HarnessRun(r.rollout_id, r.calls, 1 if r.error else 0, r.seconds, r.error)
        for r in cell.results
    ]
    cell.report = build_report(runs, detok)
    for result in cell.results:
        if result.received is None:
            cell.harness_unchecked += 1
            continue
        cell.tool_answers += sum(1 for answer in result.received if answer.tool_calls)
        differ = harness_mismatches(result.calls, result.received, detok)
        if differ is None:
            cell.harness_unaligned += 1
        else:
            cell.harness_mismatched += differ


def missing(harness: Harness) -> str:
    """Why `harness` cannot run here; empty when it can."""
    import importlib.util

    absent = [name for name in harness.needs if importlib.util.find_spec(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed"
    if harness.cli:
        from tests.harness.cli_support import CLI_BIN

        if not (CLI_BIN / harness.cli).exists():
            return f"{CLI_BIN / harness.cli} is missing (`make cli-harnesses` installs it)"
    return ""


def run_one(
    harness: Harness, reuse: bool, url: str, engine: ServedEngine, scratch: Path
) -> RolloutResult:
    rollout = open_rollout(url, engine)
    workdir = scratch / rollout.rollout_id
    workdir.mkdir()
    started = time.monotonic()
    received: list[Answer] | None = []
    error = ""
    try:
        received = harness.task(rollout, workdir)
    except BaseException as caught:  # a harness's own failure (or a pytest skip) is a finding
        if isinstance(caught, KeyboardInterrupt):
            raise
        error = f"{type(caught).__name__}: {caught}"[:500]
        traceback.print_exc(limit=3, file=sys.stderr)
    wait_idle(engine)
    return RolloutResult(
        harness.name,
        reuse,
        rollout.rollout_id,
        rollout.calls(),
        received,
        time.monotonic() - started,
        error,
    )


def wait_idle(engine: ServedEngine, timeout_s: float = 60.0) -> None:
    """Best effort: a call the harness gave up on is recorded once the engine finished it."""
    deadline = time.monotonic() + timeout_s
    while not engine.idle() and time.monotonic() < deadline:
        time.sleep(0.05)


@contextlib.contextmanager
def gateway(engine: ServedEngine, folder: Path, *, reuse: bool, cli: bool) -> Iterator[str]:
    """A gateway (SQLite in `folder`) with `token_reuse` as given, the engine registered;
    `cli`: `train` answers capped at `CLI_MAX_TOKENS` unless the harness asks for fewer."""
    extra: dict[str, Any] = {}
    if cli:
        train = GatewaySettings.model_fields["train_sampling"].get_default(
            call_default_factory=True
        )
        extra["train_sampling"] = SamplingPolicy(
            set={**train.set, "max_tokens": CLI_MAX_TOKENS}, keep_harness=["max_tokens"]
        )
    name = f"gateway-{'cli-' if cli else ''}{'on' if reuse else 'off'}.db"
    settings = GatewaySettings(
        database_url=str(folder / name), api_key=ADMIN_KEY, token_reuse=reuse, **extra
    )
    with gateway_for(settings, engine) as (url, _):
        yield url


def print_table(cells: list[Cell]) -> None:
    header = (
        f"{'reuse':<5} {'harness':<15} {'rollouts':>8} {'calls':>5} {'tools':>5} {'1-seq':>5} "
        f"{'samples/rollout':>15} {'differ rec/harness':>18} {'errors':>6}  splits"
    )
    print(header)
    for cell in cells:
        report = cell.report
        assert report is not None
        ratio = report.one_sequence_ratio
        per = report.samples_per_rollout
        errors = sum(1 for r in cell.results if r.error)
        harness_differ = str(cell.harness_mismatched) + (
            f" ({cell.harness_unaligned} unpaired)" if cell.harness_unaligned else ""
        )
        if cell.harness_unchecked == len(cell.results):
            harness_differ = "-"  # the harness does not say what it received call by call
        splits = ", ".join(f"{k} {v}" for k, v in report.splits.items()) or "-"
        # Tool-call answers as the harness received them: unknown when it does not say.
        tools = "-" if cell.harness_unchecked == len(cell.results) else str(cell.tool_answers)
        print(
            f"{'on' if cell.reuse else 'off':<5} {cell.harness.name:<15} "
            f"{report.rollouts_with_calls:>8} {report.calls:>5} {tools:>5} "
            f"{'-' if ratio is None else f'{ratio:.2f}':>5} "
            f"{'-' if per is None else f'{per:.2f}':>15} "
            f"{f'{report.fidelity_mismatched}/{harness_differ}':>18} {errors:>6}  {splits}"
        )


def print_details(cells: list[Cell]) -> None:
    for cell in cells:
        report = cell.report
        assert report is not None
        label = f"{cell.harness.name}, reuse {'on' if cell.reuse else 'off'}"
        for reason, ex in report.split_examples.items():
            print(f"split example ({label}) {reason}: {ex.rollout_id} call {ex.call}")
            print(f"    sampled:   {format_boundary(ex.before, ex.recorded)}")
            print(f"    sent back: {format_boundary(ex.before, ex.next_prompt)}")
        for finding in report.findings:
            if finding.check == "mismatch":
                print(f"records differ ({label}): {finding.message}")
        for result in cell.results:
            if result.error:
                print(f"harness error ({label}) {result.rollout_id}: {result.error}")
                break


def headline(cells: list[Cell]) -> float | None:
    ratios = [
        cell.report.one_sequence_ratio
        for cell in cells
        if cell.reuse
        and cell.harness.append_only
        and cell.report is not None
        and cell.report.one_sequence_ratio is not None
        and (not cell.harness.long_only or cell.report.calls > cell.report.rollouts_with_calls)
    ]
    return min(ratios) if ratios else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="more rollouts, and the CLIs")
    parser.add_argument("--rollouts", type=int, help="per harness and setting (1; --long 5)")
    parser.add_argument("--cli-rollouts", type=int, default=2, help="per CLI and setting (--long)")
    parser.add_argument("--harnesses", help="comma-separated names (default: all that apply)")
    parser.add_argument("--workers", type=int, default=10, help="rollouts at once (default 10)")
    parser.add_argument(
        "--threads", type=int, default=1, help="the engine's torch threads (default 1, see above)"
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rollouts = args.rollouts or (5 if args.long else 1)
    wanted = set(args.harnesses.split(",")) if args.harnesses else None
    chosen: list[Harness] = []
    for harness in HARNESSES:
        if wanted is not None and harness.name not in wanted:
            continue
        if wanted is None and harness.long_only and not args.long:
            continue
        why = missing(harness)
        if why:
            print(f"skipped {harness.name}: {why}")
            continue
        chosen.append(harness)
    halves = [[Cell(h, reuse) for h in chosen] for reuse in (False, True)]
    cells = [*halves[0], *halves[1]]
    started = time.monotonic()
    lock = threading.Lock()
    finished = 0
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fidelity-")))
        engine = stack.enter_context(served_engine())
        detok = Detokenizer(engine.tokenizer)
        clis = any(h.cli for h in chosen)
        urls = {
            (reuse, cli): stack.enter_context(gateway(engine, scratch, reuse=reuse, cli=cli))
            for reuse in (False, True)
            for cli in ({False, clis})
        }
        # Rollouts interleaved over harnesses and settings, so the machine's noise falls on all.
        # The CLIs' long runs first, so that they overlap the rest.
        pairs = list(zip(*halves, strict=True))
        work = [c for _ in range(args.cli_rollouts) for p in pairs for c in p if c.harness.cli]
        work += [c for _ in range(rollouts) for p in pairs for c in p if not c.harness.cli]

        def job(cell: Cell) -> RolloutResult:
            nonlocal finished
            result = run_one(
                cell.harness, cell.reuse, urls[cell.reuse, bool(cell.harness.cli)], engine, scratch
            )
            with lock:
                cell.results.append(result)
                finished += 1
                failed = f", ERROR {result.error[:120]}" if result.error else ""
                print(
                    f"[{finished}/{len(work)} {time.monotonic() - started:.0f} s] "
                    f"{cell.harness.name} reuse {'on' if cell.reuse else 'off'}: "
                    f"{len(result.calls)} calls in {result.seconds:.1f} s{failed}",
                    file=sys.stderr,
                    flush=True,
                )
            return result

        with ThreadPoolExecutor(max(1, args.workers)) as pool:
            list(pool.map(job, work))
        for cell in cells:
            cell_report(cell, detok)
    print(
        f"{len(work)} rollouts in {time.monotonic() - started:.0f} s ({rollouts} per cell"
        + (f", {args.cli_rollouts} per CLI cell)" if any(h.cli for h in chosen) else ")")
    )
    print_table(cells)
    print_details(cells)
    for harness in chosen:
        if not harness.append_only:
            print(f"not in the headline: {harness.name} ({harness.why})")
    value = headline(cells)
    print(f"fidelity_one_sequence_ratio_min: {'nan' if value is None else f'{value:.2f}'} ratio")


if __name__ == "__main__":
    main()
