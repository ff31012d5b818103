"""The doctor's report as a plain-text table (what `reins doctor` prints without `--json`)."""

from __future__ import annotations

from reins.cliout import counted
from reins.doctor.report import DoctorReport, format_boundary

_MARK = {"error": "ERROR", "warning": "warn", "info": "info"}


def _ratio(part: int, whole: int) -> str:
    return f"{part}/{whole}" if whole else "-"


def rows(report: DoctorReport) -> list[tuple[str, str]]:
    """The figures as (row, value): this table's rows, and the dashboard's (monitor/fidelity)."""
    per_rollout = report.samples_per_rollout
    one = report.one_sequence_ratio
    exits = sum(1 for r in report.rollouts if r.returncode == 0)
    splits = ", ".join(f"{reason} {n}" for reason, n in report.splits.items()) or "none"
    fidelity = (
        f"{report.fidelity_checked - report.fidelity_mismatched}/{report.fidelity_checked} calls "
        "decode to what the harness received"
        if report.fidelity_checked
        else "not checked"
    )
    compacted = report.splits.get("compacted", 0)
    dropped = report.splits.get("dropped", 0)
    return [
        ("runs (exit 0)", _ratio(exits, report.runs)),
        (
            "calls",
            f"{report.calls} ({report.trainable_calls} trainable, {report.failed_calls} failed, "
            f"{report.abandoned_calls} abandoned, {report.retried_calls} retried"
            + (f", {report.unused_choices} unused choices" if report.unused_choices else "")
            + ")",
        ),
        ("samples per rollout", "-" if per_rollout is None else f"{per_rollout:.2f}"),
        (
            "one-sequence rollouts",
            _ratio(report.one_sequence_rollouts, report.rollouts_with_calls)
            + ("" if one is None else f" ({one:.2f})"),
        ),
        ("split reasons", splits),
        ("token fidelity", fidelity),
        ("token IDs / logprobs missing", f"{report.missing_token_ids} / {report.bad_logprobs}"),
        (
            "tool-call round trip",
            f"{_ratio(report.tool_call_merged, report.tool_call_turns)} merged"
            if report.tool_call_turns
            else "no tool call followed by another call",
        ),
        (
            "stop truncation",
            f"{report.stop_truncated} calls ended at a stop string, "
            f"{report.stop_followed_by_split} followed by a split",
        ),
        ("compacted / dropped", f"{compacted} / {dropped}"),
    ]


def render_text(report: DoctorReport, command: str = "") -> str:
    """The table, the per-rollout lines, each finding with its fix, and the verdict."""
    ran = counted(report.runs, "run")
    lines = [f"reins doctor: {ran}" + (f" of `{command}`" if command else ""), ""]
    table = rows(report)
    width = max(len(name) for name, _ in table)
    lines += [f"  {name.ljust(width)}  {value}" for name, value in table]
    lines.append("")
    for r in report.rollouts:
        status = "timed out" if r.returncode is None else f"exit {r.returncode}"
        why = f" (splits: {', '.join(r.splits)})" if r.splits else ""
        lines.append(
            f"  {r.rollout_id}: {status}, {r.seconds:.1f} s, {counted(r.calls, 'call')} "
            f"({r.failed} failed) -> {counted(r.sequences, 'sequence')}{why}"
        )
    if report.split_examples:
        lines += ["", "split examples (tokens separated by |, the first difference after ‖):"]
        for reason, ex in report.split_examples.items():
            lines.append(f"  {reason}: {ex.rollout_id} call {ex.call}")
            lines.append(f"    sampled:   {format_boundary(ex.before, ex.recorded)}")
            lines.append(f"    sent back: {format_boundary(ex.before, ex.next_prompt)}")
    if report.findings:
        lines += ["", "findings:"]
        for finding in report.findings:
            lines.append(f"  [{_MARK[finding.severity]}] {finding.check}: {finding.message}")
            lines.append(f"      fix: {finding.fix}")
    lines.append("")
    if report.ok:
        lines.append("verdict: OK, this harness can be trained (exit 0)")
    else:
        errors = [f.check for f in report.findings if f.severity == "error"]
        lines.append(f"verdict: NOT TRAINABLE as it is ({', '.join(errors)}; exit 1)")
    return "\n".join(lines)
