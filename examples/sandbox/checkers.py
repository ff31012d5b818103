"""Programmatic checkers: a task's input, the agent's final answer and its sandbox folder in, a
reward in [0, 1] with its reason out. Pure functions but for reading the one file a `file` check
names (inside the folder, never through a link out of it).

Check specs (see make_tasks.py): `file` (path, content), `number` (value, tolerance), `text`
(value). Rewards are 0 or 1: a task is solved or it is not.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_FILE_CHARS = 200_000
"""A file longer than this is not the answer (and is not read whole)."""
NUMBER = re.compile(
    r"(?:(?<![\w.])[-\u2212])?"  # a minus sign, not a hyphen after a word (1990-01-01)
    r"(?:\d{1,3}(?:([,_ \u00a0\u2009\u202f])\d{3}(?!\d))(?:\1\d{3}(?!\d))*(?:\.\d+)?"
    r"|\d+(?:\.\d+)?|\.\d+)"
    r"(?:[eE][-+]?\d+)?"
)
"""A number as people write it: 1234, -3.5, .5, 3.38e5, with a minus sign (ASCII or U+2212)
unless it follows a word or number, its thousands grouped or not: 12,345.67, 1_234, 42 000
(a space, no-break space or thin space; the same separator throughout, groups of three)."""
DATE = re.compile(r"\b(?:\d{4}([-/.])\d{1,2}\1\d{1,2}|\d{1,2}([-/.])\d{1,2}\2\d{4})\b")
"""2024-03-01, 2024/3/1, 01.03.2024, 3/1/2024: its parts are a date, not the answer."""


@dataclass(frozen=True)
class Verdict:
    reward: float
    reason: str


def check(task: Mapping[str, Any], answer: str | None, folder: Path) -> Verdict:
    """Grades one episode: `task` is the rollout's input, `answer` the text given to `finish` (or
    the last reply; None without one), `folder` the sandbox's folder on the host (its /work)."""
    spec = task["check"]
    kind = spec.get("kind")
    if kind == "file":
        return check_file(spec, folder)
    if kind == "number":
        return check_number(spec, answer, str(task.get("instruction", "")))
    if kind == "text":
        return check_text(spec, answer)
    raise ValueError(f"unknown check kind {kind!r}: use file, number or text")


def normalize_lines(text: str) -> str:
    """Line ends, trailing spaces and blank lines at either end do not count."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return "\n".join(lines).strip("\n")


def check_file(spec: Mapping[str, Any], folder: Path) -> Verdict:
    path = str(spec["path"])
    content = read_inside(folder, path)
    if content is None:
        return Verdict(0.0, f"{path} is missing (or not a regular file inside the sandbox)")
    if normalize_lines(content) == normalize_lines(str(spec["content"])):
        return Verdict(1.0, f"{path} has the expected content")
    return Verdict(0.0, f"{path} differs from the expected content")


def read_inside(folder: Path, relative: str) -> str | None:
    """The text of `folder/relative`, or None when it is missing, not a regular file, too large,
    or resolves (through `..` or a link) outside `folder`: the agent controls that folder, and the
    checker runs on the host."""
    root = folder.resolve()
    try:
        target = (root / relative).resolve()
    except (OSError, RuntimeError):  # a link loop
        return None
    if not target.is_relative_to(root) or not target.is_file():
        return None
    try:
        with target.open(encoding="utf-8", errors="replace") as file:
            text = file.read(MAX_FILE_CHARS + 1)
    except OSError:
        return None
    return None if len(text) > MAX_FILE_CHARS else text


def _value(number: str) -> float:
    for separator in ",_ \u00a0\u2009\u202f":
        number = number.replace(separator, "")
    return float(number.replace("\u2212", "-"))


def answer_number(answer: str, instruction: str = "") -> float | None:
    """The one number an answer gives, so that listing many numbers earns nothing: the last of
    the answer's numbers after setting aside, in turn, the parts of dates, the numbers the
    instruction holds (the answer restating the question: "25 primes below 100") and those in
    parentheses ("42 (3 primes)"); a step that would set aside every number left is skipped
    (the answer "1" to the question "days from 2024-01-01 to 2024-01-02"). None without one."""
    dates = [match.span() for match in DATE.finditer(answer)]
    given = {_value(match.group()) for match in NUMBER.finditer(instruction)}
    numbers: list[tuple[float, tuple[bool, bool, bool]]] = []
    for match in NUMBER.finditer(answer):
        value, before = _value(match.group()), answer[: match.start()]
        if math.isfinite(value):
            aside = (
                any(first <= match.start() < end for first, end in dates),
                value in given,
                before.count("(") > before.count(")"),
            )
            numbers.append((value, aside))
    for step in range(3):
        numbers = [number for number in numbers if not number[1][step]] or numbers
    return numbers[-1][0] if numbers else None


def check_number(spec: Mapping[str, Any], answer: str | None, instruction: str = "") -> Verdict:
    expected = float(spec["value"])
    if answer is None:
        return Verdict(0.0, f"no answer (expected {spec['value']})")
    got = answer_number(answer, instruction)
    if got is None:
        return Verdict(0.0, f"no number in the answer (expected {spec['value']})")
    if abs(got - expected) <= float(spec.get("tolerance", 0)) + 1e-9:  # exact below 2**53
        return Verdict(1.0, f"answered {got:g}, expected {spec['value']}")
    return Verdict(0.0, f"answered {got:g}, expected {spec['value']}")


def normalize_text(text: str) -> str:
    """Case, punctuation (`_` too) and spacing do not count, nor Unicode's compatibility forms
    (full-width letters)."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.sub(r"[^\w\s]|_", " ", text).split())


def check_text(spec: Mapping[str, Any], answer: str | None) -> Verdict:
    expected = str(spec["value"])
    if not normalize_text(expected):
        # An empty answer would match it.
        raise ValueError(f"the text check's value {expected!r} is nothing but punctuation")
    if answer is None:
        return Verdict(0.0, f"no answer (expected {expected!r})")
    if normalize_text(answer) == normalize_text(expected):
        return Verdict(1.0, f"answered {expected!r}")
    return Verdict(0.0, f"answered {answer[:80]!r}, expected {expected!r}")
