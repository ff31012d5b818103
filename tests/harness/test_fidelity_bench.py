"""The pure pieces of benchmarks/fidelity.py: pairing what a harness received with the recorded
tokens, and which cells make the headline. (The benchmark itself is not run here.)"""

from __future__ import annotations

from typing import Any

from benchmarks import fidelity
from reins.doctor.received import Answer
from reins.doctor.report import Detokenizer, DoctorReport


class CharTokenizer:
    """One token per character (its code point); 0 is a special token, dropped when asked."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(
            "<s>" if i == 0 else chr(i) for i in ids if not (skip_special_tokens and i == 0)
        )


def call(text: str, *, status: int = 200, **extra: Any) -> dict[str, Any]:
    return {"status": status, "response_token_ids": [ord(c) for c in text] + [0], **extra}


DETOK = Detokenizer(CharTokenizer())


def test_harness_mismatches_pairs_answered_calls_in_order() -> None:
    calls = [
        call("Hi."),
        call("lost", status=500),
        call("late", abandoned=True),
        call('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'),
    ]
    same = [Answer("Hi."), Answer("", (("f", {"a": 1}),))]
    assert fidelity.harness_mismatches(calls, same, DETOK) == 0
    other = [Answer("Hi!"), Answer("", (("f", {"a": 2}),))]
    assert fidelity.harness_mismatches(calls, other, DETOK) == 2
    assert fidelity.harness_mismatches(calls, same[:1], DETOK) is None


def cell(name: str, *, reuse: bool, append_only: bool, one: int, of: int, cli: str = "") -> Any:
    harness = fidelity.Harness(name, lambda r, w: [], append_only, cli=cli)
    report = DoctorReport(runs=of, calls=3 * of, rollouts_with_calls=of, one_sequence_rollouts=one)
    return fidelity.Cell(harness, reuse, report=report)


def test_headline_is_the_lowest_reuse_on_ratio_of_append_only_harnesses() -> None:
    cells = [
        cell("a", reuse=True, append_only=True, one=3, of=4),
        cell("b", reuse=True, append_only=True, one=2, of=2),
        cell("a", reuse=False, append_only=True, one=0, of=4),
        cell("mini", reuse=True, append_only=False, one=0, of=4),
    ]
    assert fidelity.headline(cells) == 0.75
    single = cell("cli", reuse=True, append_only=True, one=1, of=2, cli="claude")
    single.report.calls = 2  # one call per rollout: nothing to merge, not in the headline
    assert fidelity.headline([*cells, single]) == 0.75
    single.report.calls = 5
    assert fidelity.headline([*cells, single]) == 0.5
    assert fidelity.headline(cells[2:3]) is None
