"""The doctor's report: a harness's recorded calls in, what training would make of them out.

Pure: no I/O, no processes. Each run of the harness is one rollout; its `model_request` events'
data (in event order) and how its process ended are all the report reads. What it checks:

- **Token fidelity** (an error): every successful call's response token IDs, decoded as the
  harness is shown text, say exactly what the harness received (`received.matches`). A call that
  fails this trains the policy on tokens the harness never acted on.
- **Tokens and logprobs** (errors): every successful call has prompt and response token IDs and
  one finite logprob <= 0 per response token; without them it cannot be trained on at all.
- **Failed calls** (a warning; an error when no call of any run succeeded), **abandoned calls**
  (the client hung up; recorded with `abandoned: true` or status 499; a warning), **runs that
  made no call** or exited non-zero (warnings; no call in any run, or no run that exited 0, is
  an error), and no trainable call at all, whatever the reasons (an error).
- **Requests the gateway does not serve** (a warning): those it answered 404 or 405 during the
  runs (an embeddings call, a wrong base path); they leave no event (`HarnessRun.unserved`).
- **Merging**, exactly as the trainer does it (`reins.samples`: dedup, then merge): samples per
  rollout, the one-sequence rollout ratio, each split reason with one example (the decoded tokens
  on both sides of the first token that differs), tool-call round trips (a call answered with
  tool calls whose next call merged), calls that ended at a stop string and whether the next call
  merged. Splits are warnings (training stays correct; the shared prompt is trained again) except
  `dropped`, `compacted` and `branch`, which a harness does on purpose (info). A `template` split
  (an earlier turn reads differently in the next prompt) is told apart by the harness's own
  requests: when the next request does not start with the previous one's conversation, message
  for message (as the engine was asked: `cache_control` markers, text split into parts, or one
  API's spelling of a message do not count), the harness rewrote its history (`edited`); else the
  chat template rendered the same history differently (`template`).

Without a tokenizer (`Detokenizer`) fidelity is not checked and split reasons come from token
evidence only (`branch`, `dropped` or `unknown`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from reins.cliout import counted
from reins.doctor.fixes import FIXES
from reins.doctor.received import UnreadableAnswer, matches, received_answer
from reins.samples import SPLIT_REASONS, Call, dedup_calls, merge_calls, shared_prefix_len
from reins.samples.records import TokenArray, choice_of

Severity = Literal["error", "warning", "info"]
TOOL_CALL_STOP = "</tool_call>"
"""The `stop_reason` of a turn the engine ended after its tool calls (not a harness stop)."""
EXAMPLE_TOKENS = 6
"""Tokens shown on each side of a split's boundary."""
INTENDED_SPLITS = frozenset({"dropped", "compacted", "branch"})
"""Split reasons a harness causes on purpose: reported, not warned about."""
EDITED = "edited"
"""The doctor's own split reason: a `template` split whose next request changed, removed or
reordered a message of the previous request's conversation (the harness rewrote its history)."""
REPORTED_SPLITS = tuple(
    reason
    for split in SPLIT_REASONS
    for reason in ((split, EDITED) if split == "template" else (split,))
)
"""The split reasons the report names, in the order it lists them."""


@dataclass(frozen=True)
class Detokenizer:
    """Token IDs to text, two ways: as the harness is shown them, and with chat markers."""

    tokenizer: Any
    """A Hugging Face tokenizer (its `decode(ids, skip_special_tokens=...)`)."""

    def shown(self, ids: Sequence[int]) -> str:
        """Special tokens dropped: the text a harness is given."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def text(self, ids: Sequence[int]) -> str:
        """Special tokens kept (`<|im_end|>`): what split diagnosis reads."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.text([int(i)]) for i in ids]

    def for_merge(self) -> Callable[[TokenArray], str]:
        return lambda ids: self.text(ids.tolist())


@dataclass(frozen=True)
class HarnessRun:
    """One run of the harness command, as one rollout attempt."""

    rollout_id: str
    calls: list[dict[str, Any]]
    """The `model_request` events' data, in event order (a prompt's token IDs may be an int32
    array: `reins.packed.unpack(token_arrays=True)`)."""
    returncode: int | None
    """The process's exit status; None when it was stopped at the time limit."""
    seconds: float = 0.0
    output_tail: str = ""
    """The last lines the process wrote (stderr, else stdout)."""
    unserved: dict[str, int] = field(default_factory=dict)
    """Requests the gateway answered 404 or 405 during the run (no event records them), as
    `METHOD PATH (STATUS)`: count."""


@dataclass(frozen=True)
class SplitExample:
    """Where one rollout's next prompt stopped continuing the previous call's prompt + response."""

    rollout_id: str
    call: int
    """1-based number, in its run, of the call whose prompt did not continue."""
    before: list[str]
    """The last tokens both share (decoded one by one)."""
    recorded: list[str]
    """The previous prompt + response from there on: what was sampled."""
    next_prompt: list[str]
    """The next prompt from there on: what the harness sent back."""


@dataclass(frozen=True)
class Finding:
    """One thing the report found, and what addresses it."""

    check: str
    severity: Severity
    count: int
    message: str
    fix: str


@dataclass(frozen=True)
class RolloutSummary:
    rollout_id: str
    returncode: int | None
    seconds: float
    calls: int
    failed: int
    sequences: int
    splits: list[str]


@dataclass
class DoctorReport:
    """Figures over all runs, and the findings; `ok` is False when any finding is an error."""

    runs: int
    calls: int = 0
    trainable_calls: int = 0
    failed_calls: int = 0
    abandoned_calls: int = 0
    empty_answers: int = 0
    retried_calls: int = 0
    """Dropped as the trainer drops a retry: the same prompt again, the harness went on with
    another answer."""
    unused_choices: int = 0
    """The choices of an `n > 1` call the harness did not go on with (dropped likewise)."""
    sequences: int = 0
    one_sequence_rollouts: int = 0
    rollouts_with_calls: int = 0
    splits: dict[str, int] = field(default_factory=dict)
    split_examples: dict[str, SplitExample] = field(default_factory=dict)
    fidelity_checked: int = 0
    fidelity_mismatched: int = 0
    missing_token_ids: int = 0
    bad_logprobs: int = 0
    tool_call_turns: int = 0
    """Calls answered with tool calls that another call followed."""
    tool_call_merged: int = 0
    stop_truncated: int = 0
    """Calls that ended at a harness stop string."""
    stop_followed_by_split: int = 0
    unserved_requests: dict[str, int] = field(default_factory=dict)
    """Requests of the harness the gateway does not serve (404, 405), over all runs."""
    findings: list[Finding] = field(default_factory=list)
    rollouts: list[RolloutSummary] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    @property
    def samples_per_rollout(self) -> float | None:
        if not self.rollouts_with_calls:
            return None
        return self.sequences / self.rollouts_with_calls

    @property
    def one_sequence_ratio(self) -> float | None:
        if not self.rollouts_with_calls:
            return None
        return self.one_sequence_rollouts / self.rollouts_with_calls

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["samples_per_rollout"] = self.samples_per_rollout
        data["one_sequence_ratio"] = self.one_sequence_ratio
        return data


def _abandoned(call: dict[str, Any]) -> bool:
    return bool(call.get("abandoned")) or call.get("status") == 499


def _choices(call: dict[str, Any]) -> int:
    """The `n` a call's request asked for (1 when not given)."""
    request = call.get("request")
    n = request.get("n") if isinstance(request, dict) else None
    return n if type(n) is int else 1


def _logprobs_ok(call: dict[str, Any]) -> bool:
    values = call.get("response_logprobs")
    if not isinstance(values, list) or len(values) != len(call["response_token_ids"]):
        return False
    return all(isinstance(v, int | float) and math.isfinite(v) and v <= 0 for v in values)


@dataclass
class _Tally:
    """Counts and first examples gathered over the runs; `findings` turns them into text."""

    mismatch_example: str = ""
    missing_example: str = ""
    logprob_example: str = ""
    failed_example: str = ""
    abandoned_example: str = ""
    stop_example: str = ""
    silent_runs: int = 0
    crashed_runs: list[HarnessRun] = field(default_factory=list)
    asked_models: Counter[str] = field(default_factory=Counter)
    """The model names the harness's requests asked for (each served by the policy)."""


def build_report(runs: Sequence[HarnessRun], detok: Detokenizer | None = None) -> DoctorReport:
    """The report of `runs`; `detok` (the policy's tokenizer) enables the text checks."""
    report = DoctorReport(runs=len(runs))
    tally = _Tally()
    reasons: Counter[str] = Counter()
    unserved: Counter[str] = Counter()
    for run in runs:
        unserved.update(run.unserved)
        if run.returncode != 0:
            tally.crashed_runs.append(run)
        if not run.calls:
            tally.silent_runs += 1
        trainable = _check_calls(run, report, tally, detok)
        if not run.calls:
            report.rollouts.append(
                RolloutSummary(run.rollout_id, run.returncode, run.seconds, 0, 0, 0, [])
            )
            continue
        kept = dedup_calls(trainable)
        kept_seqs = {call.seq for call in kept}
        for call in trainable:
            if call.seq not in kept_seqs:
                if _choices(run.calls[call.seq]) > 1:
                    report.unused_choices += 1
                else:
                    report.retried_calls += 1
        decode = detok.for_merge() if detok is not None else None
        sequences, splits = merge_calls(kept, rollout_id=run.rollout_id, decode=decode)
        report.rollouts_with_calls += 1
        report.sequences += len(sequences)
        report.one_sequence_rollouts += len(sequences) == 1
        split_after = {s.before_seq: s for s in splits}
        split_reasons: dict[int, str] = {s.before_seq: s.reason for s in splits}
        for position, call in enumerate(kept[:-1]):
            data = run.calls[call.seq]
            split = split_after.get(call.seq)
            if _answered_with_tools(data):
                report.tool_call_turns += 1
                report.tool_call_merged += split is None
            if _stopped_at_string(data):
                report.stop_followed_by_split += split is not None
            if split is not None:
                reason = _reported_reason(split.reason, data, run.calls[split.after_seq])
                split_reasons[split.before_seq] = reason
                reasons[reason] += 1
                if reason not in report.split_examples:
                    report.split_examples[reason] = _example(
                        run.rollout_id, call, kept[position + 1], detok
                    )
        failed = sum(1 for c in run.calls if not _abandoned(c) and c.get("status", 200) != 200)
        report.rollouts.append(
            RolloutSummary(
                run.rollout_id,
                run.returncode,
                run.seconds,
                len(run.calls),
                failed,
                len(sequences),
                [split_reasons[s.before_seq] for s in splits],
            )
        )
    report.splits = {reason: reasons[reason] for reason in REPORTED_SPLITS if reasons[reason]}
    report.unserved_requests = dict(unserved.most_common())
    report.findings = _findings(report, tally, detok)
    return report


def _check_calls(
    run: HarnessRun, report: DoctorReport, tally: _Tally, detok: Detokenizer | None
) -> list[Call]:
    """Counts one run's calls into `report`; returns the trainable ones (seq: index in the run)."""
    trainable: list[Call] = []
    for index, data in enumerate(run.calls):
        report.calls += 1
        where = f"{run.rollout_id} call {index + 1}"
        request = data.get("request")
        if isinstance(request, dict) and isinstance(request.get("model"), str):
            tally.asked_models[request["model"]] += 1
        if _abandoned(data):
            report.abandoned_calls += 1
            tally.abandoned_example = tally.abandoned_example or where
            continue
        if data.get("status", 200) != 200:  # a status not given is 200, as the trainer reads it
            report.failed_calls += 1
            if not tally.failed_example:
                error = str(data.get("error") or "")[:300]
                tally.failed_example = f"{where}: status {data.get('status')}: {error}"
            continue
        prompt: Any = data.get("prompt_token_ids")
        response = data.get("response_token_ids")
        has_prompt = prompt.size > 0 if isinstance(prompt, np.ndarray) else bool(prompt)
        if has_prompt and not response and data.get("finish_reason") == "stop":
            report.empty_answers += 1  # ended at once, at a stop: nothing to train on
            continue
        if not has_prompt or not response:
            report.missing_token_ids += 1
            tally.missing_example = tally.missing_example or where
            continue
        if not _logprobs_ok(data):
            report.bad_logprobs += 1
            tally.logprob_example = tally.logprob_example or where
            continue
        report.trainable_calls += 1
        if _stopped_at_string(data):
            report.stop_truncated += 1
            tally.stop_example = tally.stop_example or repr(data.get("stop_reason"))
        if detok is not None:
            report.fidelity_checked += 1
            shown = detok.shown(response)
            try:
                received = received_answer(str(data.get("kind") or "chat"), data["response"])
                same = matches(shown, received)
            except UnreadableAnswer as error:
                same, received = False, None
                shown = f"{shown!r} (the recorded answer is unreadable: {error})"
            if not same:
                report.fidelity_mismatched += 1
                if not tally.mismatch_example:
                    got = "?" if received is None else repr(received.text)
                    calls = (
                        ""
                        if received is None or not received.tool_calls
                        else (f" and tool calls {list(received.tool_calls)!r}")
                    )
                    tally.mismatch_example = (
                        f"{where}: the tokens say {shown!r}, the harness received {got}{calls}"
                    )
        trainable.append(
            Call(
                prompt,
                response,
                np.asarray(data["response_logprobs"], dtype=np.float32),
                seq=index,
                model_version=data.get("model_version"),
                choice=choice_of(data),
            )
        )
    return trainable


def _reported_reason(reason: str, previous: dict[str, Any], following: dict[str, Any]) -> str:
    """`edited` for a `template` split whose harness changed the previous request's
    conversation in the next request; else the merge's reason."""
    if reason != "template":
        return reason
    before, after = _conversation(previous), _conversation(following)
    if before is None or after is None:
        return reason  # a request the doctor cannot read: the tokens' reason stands
    return reason if after[: len(before)] == before else EDITED


def _conversation(call: dict[str, Any]) -> list[Any] | None:
    """The chat messages a call's request asked the engine for (a Messages or Responses request
    as the proxy translates it, so that markers such as `cache_control` and one API's spellings
    of the same message compare equal); None when it cannot be read."""
    # Imported here: `reins.gateway` imports the dashboard, which imports this module.
    from reins.gateway.wire import messages as messages_api
    from reins.gateway.wire import responses as responses_api

    request = call.get("request")
    if not isinstance(request, dict):
        return None
    kind = call.get("kind") or "chat"
    try:
        if kind == messages_api.KIND:
            chat = messages_api.count_tokens_request(request)
        elif kind == responses_api.KIND:
            chat = responses_api.translate(request).chat_request()
        elif kind == "chat":
            chat = request
        else:
            return None
    except Exception:  # a request the translation refuses (it was answered 400: no split)
        return None
    messages = chat.get("messages")
    return [_plain(message) for message in messages] if isinstance(messages, list) else None


def _plain(message: Any) -> Any:
    """A chat message with its content's text parts joined, as the engine joins them."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" for part in content
    ):
        return {**message, "content": "\n".join(str(part.get("text")) for part in content)}
    return message


def _answered_with_tools(data: dict[str, Any]) -> bool:
    if data.get("finish_reason") == "tool_calls" or data.get("stop_reason") == TOOL_CALL_STOP:
        return True
    try:
        return bool(received_answer(str(data.get("kind") or "chat"), data["response"]).tool_calls)
    except (UnreadableAnswer, KeyError):
        return False


def _stopped_at_string(data: dict[str, Any]) -> bool:
    reason = data.get("stop_reason")
    return isinstance(reason, str) and reason != TOOL_CALL_STOP


def _example(rollout_id: str, prev: Call, nxt: Call, detok: Detokenizer | None) -> SplitExample:
    history = np.concatenate([prev.prompt, prev.response])
    at = shared_prefix_len(history, nxt.prompt)

    def show(ids: TokenArray) -> list[str]:
        if detok is None:
            return [str(int(i)) for i in ids]
        return detok.pieces(ids.tolist())

    return SplitExample(
        rollout_id=rollout_id,
        call=nxt.seq + 1,
        before=show(history[max(0, at - EXAMPLE_TOKENS) : at]),
        recorded=show(history[at : at + EXAMPLE_TOKENS]),
        next_prompt=show(nxt.prompt[at : at + EXAMPLE_TOKENS]),
    )


def _findings(report: DoctorReport, tally: _Tally, detok: Detokenizer | None) -> list[Finding]:
    out: list[Finding] = []

    def add(check: str, severity: Severity, count: int, message: str) -> None:
        out.append(Finding(check, severity, count, message, FIXES[check]))

    if report.calls == 0:
        add("no_calls", "error", report.runs, "no run made a call through the proxy")
    elif tally.silent_runs:
        silent = counted(tally.silent_runs, "run")
        add("no_calls", "warning", tally.silent_runs, f"{silent} made no call")
    if report.unserved_requests:
        count = sum(report.unserved_requests.values())
        named = ", ".join(f"{what} x{n}" for what, n in report.unserved_requests.items())
        add(
            "unserved",
            "warning",
            count,
            f"the gateway does not serve {count} requests the harness sent: {named}",
        )
    if report.fidelity_mismatched:
        add(
            "mismatch",
            "error",
            report.fidelity_mismatched,
            f"{report.fidelity_mismatched} recorded responses differ from what the harness "
            f"received, e.g. {tally.mismatch_example}",
        )
    if report.missing_token_ids:
        add(
            "no_token_ids",
            "error",
            report.missing_token_ids,
            f"{report.missing_token_ids} calls were recorded without token IDs, e.g. "
            f"{tally.missing_example}",
        )
    if report.bad_logprobs:
        add(
            "no_logprobs",
            "error",
            report.bad_logprobs,
            f"{report.bad_logprobs} calls have no logprobs, or not one finite value <= 0 per "
            f"response token, e.g. {tally.logprob_example}",
        )
    if report.failed_calls:
        every = report.trainable_calls == 0 and report.empty_answers == 0
        add(
            "failed",
            "error" if every else "warning",
            report.failed_calls,
            f"{report.failed_calls} of {report.calls} calls failed"
            + (" (every call)" if every else "")
            + f", e.g. {tally.failed_example}",
        )
    if report.abandoned_calls:
        add(
            "abandoned",
            "warning",
            report.abandoned_calls,
            f"the harness hung up on {report.abandoned_calls} calls before their answer, e.g. "
            f"{tally.abandoned_example}",
        )
    if report.empty_answers:
        add(
            "empty",
            "info",
            report.empty_answers,
            f"{report.empty_answers} answers ended at once (a stop at the first token)",
        )
    if tally.crashed_runs:
        last = tally.crashed_runs[-1]
        status = (
            "stopped at the time limit" if last.returncode is None else (f"exit {last.returncode}")
        )
        tail = last.output_tail.strip().splitlines()[-3:]
        every = len(tally.crashed_runs) == report.runs  # no run the controller would reward
        add(
            "harness_exit",
            "error" if every else "warning",
            len(tally.crashed_runs),
            f"{len(tally.crashed_runs)} of {report.runs} runs did not exit 0 ({last.rollout_id}: "
            f"{status}" + (f"; it said: {' / '.join(tail)}" if tail else "") + ")",
        )
    explained = any(  # an error about the calls already says why
        f.severity == "error" and f.check in ("failed", "no_token_ids", "no_logprobs") for f in out
    )
    if report.calls and not report.trainable_calls and not explained:
        why = {
            "abandoned": report.abandoned_calls,
            "failed": report.failed_calls,
            "empty answers": report.empty_answers,
            "without token IDs": report.missing_token_ids,
            "without logprobs": report.bad_logprobs,
        }
        add(
            "no_trainable",
            "error",
            report.calls,
            f"none of the {report.calls} calls can be trained on ("
            + ", ".join(f"{count} {what}" for what, count in why.items() if count)
            + ")",
        )
    if len(tally.asked_models) > 1:
        named = ", ".join(f"{name} ({count})" for name, count in tally.asked_models.most_common())
        add(
            "models",
            "warning",
            len(tally.asked_models),
            f"the harness asked for {len(tally.asked_models)} models: {named}",
        )
    for reason, count in report.splits.items():
        example = report.split_examples[reason]
        add(
            f"split:{reason}",
            "info" if reason in INTENDED_SPLITS else "warning",
            count,
            f"{count} calls did not continue the previous call's tokens (`{reason}`), first at "
            f"{example.rollout_id} call {example.call} (split examples)",
        )
    if report.stop_followed_by_split:
        add(
            "stop",
            "warning",
            report.stop_followed_by_split,
            f"{report.stop_followed_by_split} of {report.stop_truncated} calls that ended at a "
            f"stop string (e.g. {tally.stop_example}) were followed by a split",
        )
    if report.tool_call_turns > report.tool_call_merged:
        add(
            "tool_round_trip",
            "warning",
            report.tool_call_turns - report.tool_call_merged,
            f"{report.tool_call_turns - report.tool_call_merged} of {report.tool_call_turns} "
            "tool-call answers did not come back token for token in the next prompt",
        )
    if detok is None and report.trainable_calls:
        add(
            "no_tokenizer",
            "warning",
            report.trainable_calls,
            "no tokenizer: token fidelity was not checked and split reasons are token-only",
        )
    return out


def _escape(piece: str) -> str:
    return piece.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


def format_boundary(before: Sequence[str], after: Sequence[str]) -> str:
    """`'…a|b ‖ c|d…'`: tokens separated by `|`, the first differing token after `‖`."""
    return "'…" + "|".join(map(_escape, before)) + " ‖ " + "|".join(map(_escape, after)) + "…'"
