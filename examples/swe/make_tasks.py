"""Builds the shipped SWE task set: task instances in SWE-smith's format, and the repositories
they run in, with one problem branch per task.

python examples/swe/make_tasks.py [OUT]    # writes examples/swe/data/ (or OUT)

SWE-smith injects bugs into real Python repositories; this does the same to the two tiny ones
in `repos/` (plain files in this folder, so a bug is a readable replacement below; each gets
`repos/run_tests.py`, a test runner that needs nothing but python3). For each bug:

- a branch named after the instance id, from the clean `main`: one commit that brings the bug
  (the tests still there), then one that removes the tests the fix must make pass, as
  SWE-smith's branches do, so the agent cannot read them; the reward step restores them from
  the branch's parent commit (`reins.swe.workspace`);
- FAIL_TO_PASS and PASS_TO_PASS: the tests that fail and pass with the bug, found by running
  the repository's test command on it;
- `patch`: the diff that brings the bug (its reverse is the fix).

Some instances are built to be dropped by `reins swe prepare`'s filters, as the paper's data
needed: four have an empty problem statement, three name a branch the repository does not
have, and tablelib's two have 258 tests (more than 200). The repositories are written as git
bundles (`data/<name>.bundle`, one file holding every branch) with fixed dates, and
`data/repos.json` says where each repository is and how its tests run.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
TEST_COMMAND = "python3 run_tests.py"
DATE = "2026-01-01T00:00:00+00:00"


@dataclass(frozen=True)
class Bug:
    file: str
    old: str
    new: str
    statement: str
    kind: str
    branch: bool = True
    """False: the instance names a branch the bundle does not carry (the filter drops it)."""


MINILIB = [
    Bug("minilib/text.py", 'elif out and out[-1] != "-":', "elif out:",
        "`slugify('Hello, World!')` returns `'hello--world'`: runs of punctuation and spaces "
        "should become a single dash, giving `'hello-world'`.", "func_pm_remove_cond"),
    Bug("minilib/text.py", "if char.isalnum():", "if char.isalpha():",
        "`slugify` drops digits: `slugify('Top 10 tips')` gives `'top-tips'` instead of "
        "`'top-10-tips'`.", "func_pm_op_change"),
    Bug("minilib/text.py", "if index > 0 and word.lower() in SMALL_WORDS:",
        "if word.lower() in SMALL_WORDS:",
        "`title_case('the lord of the rings')` returns `'the Lord of the Rings'`; the first "
        "word should always be capitalised: `'The Lord of the Rings'`.", "func_pm_remove_cond"),
    Bug("minilib/text.py", "word[:1].upper() + word[1:].lower()", "word[:1].upper() + word[1:]",
        "`title_case('hELLO wORLD')` returns `'HELLO WORLD'` instead of `'Hello World'`: the "
        "rest of each word should be lower-cased.", "func_pm_remove_op"),
    Bug("minilib/text.py", "if len(text) <= width:", "if len(text) < width:",
        "`truncate('abcde', 5)` returns `'ab...'`, but a text exactly `width` long fits and "
        "should come back unchanged.", "func_pm_op_change"),
    Bug("minilib/text.py", "text[: width - len(suffix)] + suffix", "text[:width] + suffix",
        "", "func_pm_op_change"),
    Bug("minilib/text.py", "return len(text.split())", 'return len(text.split(" "))',
        "`count_words` miscounts: `count_words('one two\\tthree\\nfour')` gives 2 and "
        "`count_words('   ')` gives 4; words are separated by any whitespace.",
        "func_pm_arg_change"),
    Bug("minilib/text.py", "letters = [char.lower() for char in text if char.isalnum()]",
        'letters = [char.lower() for char in text if char != " "]',
        "`is_palindrome('A man, a plan, a canal: Panama')` is False: punctuation should be "
        "ignored.", "func_pm_op_change", branch=False),
    Bug("minilib/numbers.py", "return max(low, min(value, high))",
        "return min(low, max(value, high))",
        "`clamp(5, 0, 10)` returns 0 instead of 5, and `clamp(42, 0, 10)` returns 0 instead of "
        "10.", "func_pm_ctrl_shuffle"),
    Bug("minilib/numbers.py", "return sum(values) / len(values)",
        "return sum(values) // len(values)",
        "`mean([1, 2, 3, 4])` returns 2 instead of 2.5.", "func_pm_op_change"),
    Bug("minilib/numbers.py", "return (ordered[middle - 1] + ordered[middle]) / 2",
        "return (ordered[middle] + ordered[middle + 1]) / 2",
        "`median([4, 1, 3, 2])` raises IndexError or gives the wrong value; the median of an "
        "even count is the mean of the two middle values (2.5 here).", "func_pm_op_change"),
    Bug("minilib/numbers.py", "ordered = sorted(values)", "ordered = list(values)",
        "", "func_pm_remove_wrapper"),
    Bug("minilib/numbers.py", "a, b = b, a % b", "a, b = b, b % a",
        "`gcd(7, 13)` returns 6 instead of 1.", "func_pm_op_swap"),
    Bug("minilib/numbers.py", "while divisor * divisor <= n:", "while divisor * divisor < n:",
        "`is_prime(49)` and `is_prime(121)` return True; squares of primes are not prime.",
        "func_pm_op_change"),
    Bug("minilib/numbers.py", "if n < 2:\n        return False", "if n < 1:\n        return False",
        "`is_prime(1)` returns True.", "func_pm_op_change", branch=False),
    Bug("minilib/numbers.py", "for _ in range(n):", "for _ in range(n - 1):",
        "`fibonacci(1)` returns 0 and every later value is one place behind: "
        "`fibonacci(7)` should be 13.", "func_pm_op_change"),
    Bug("minilib/lists.py", "range(0, len(items), size)]", "range(0, len(items) - size + 1, size)]",
        "`chunk([1, 2, 3, 4, 5], 2)` loses the last, shorter piece: it should return "
        "`[[1, 2], [3, 4], [5]]`.", "func_pm_op_change"),
    Bug("minilib/lists.py", "return [item for inner in nested for item in inner]",
        "return [inner[0] for inner in nested if inner]", "", "lm_rewrite"),
    Bug("minilib/lists.py", "            seen.add(item)\n", "",
        "`dedupe([3, 1, 3, 2, 1])` keeps the repeats; it should return `[3, 1, 2]`.",
        "func_pm_remove_assign"),
    Bug("minilib/lists.py", "    steps %= len(items)\n", "",
        "`rotate([1, 2, 3], 4)` returns `[1, 2, 3]`; rotating by more than the length should "
        "wrap around: `[2, 3, 1]`.", "func_pm_remove_assign"),
    Bug("minilib/lists.py", "return items[steps:] + items[:steps]",
        "return items[-steps:] + items[:-steps]",
        "`rotate([1, 2, 3, 4], 1)` rotates to the right (`[4, 1, 2, 3]`); positive steps "
        "should move items to the left: `[2, 3, 4, 1]`.", "func_pm_op_change"),
    Bug("minilib/lists.py", "range(len(items) - size + 1)]", "range(len(items) - size)]",
        "", "func_pm_op_change"),
    Bug("minilib/dates.py", "(year % 100 != 0 or year % 400 == 0)", "year % 100 != 0",
        "`is_leap(2000)` returns False; years divisible by 400 are leap years.",
        "func_pm_remove_cond"),
    Bug("minilib/dates.py", "if month == 2 and is_leap(year):",
        "if month == 2 and not is_leap(year):",
        "February has 29 days in 2023 and 28 in 2024 according to `days_in_month`.",
        "func_pm_op_change", branch=False),
    Bug("minilib/dates.py", "for m in range(1, month)", "for m in range(1, month + 1)",
        "`day_of_year(2023, 1, 1)` returns 32 instead of 1.", "func_pm_op_change"),
    Bug("minilib/dates.py", "return DAYS[month - 1]", "return DAYS[month % 12]",
        "`days_in_month(2023, 1)` returns 28 instead of 31.", "func_pm_op_change"),
]  # fmt: skip

TABLELIB = [
    Bug("tablelib/units.py", "value * METRES[unit] / METRES[to]",
        "value * METRES[to] / METRES[unit]",
        "`convert(1.0, 'km', 'm')` returns 0.001 instead of 1000.", "func_pm_op_swap"),
    Bug("tablelib/units.py", '"ft": 0.3048,', '"ft": 0.348,',
        "`convert(1.0, 'mi', 'ft')` is not 5280.", "func_pm_op_change"),
]  # fmt: skip


def git(folder: Path, *args: str) -> str:
    # Without the user's and the system's git settings: `diff.noprefix` changed every patch,
    # `commit.gpgsign` every commit, so the files were not the same bytes on every machine.
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_AUTHOR_DATE": DATE, "GIT_COMMITTER_DATE": DATE,
           "GIT_AUTHOR_NAME": "reins", "GIT_AUTHOR_EMAIL": "reins@example.invalid",
           "GIT_COMMITTER_NAME": "reins",
           "GIT_COMMITTER_EMAIL": "reins@example.invalid"}  # fmt: skip
    done = subprocess.run(["git", *args], cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr}")
    return done.stdout


def test_outcomes(folder: Path) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "run_tests.py"], cwd=folder, capture_output=True, text=True, timeout=120
    )
    outcomes = {}
    for line in done.stdout.splitlines():
        outcome, _, test_id = line.partition(" ")
        if outcome in ("PASSED", "FAILED") and "::" in test_id:
            outcomes[test_id] = outcome
    return outcomes


def remove_tests(folder: Path, test_ids: list[str]) -> None:
    """Removes each test's function; a file whose tests are made at import (no `def` of that
    name) is removed whole."""
    by_file: dict[str, set[str]] = {}
    for test_id in test_ids:
        path, _, name = test_id.partition("::")
        by_file.setdefault(path, set()).add(name)
    for path, names in by_file.items():
        file = folder / path
        lines = file.read_text().splitlines(keepends=True)
        spans = [
            (node.lineno, node.end_lineno or node.lineno)
            for node in ast.parse("".join(lines)).body
            if isinstance(node, ast.FunctionDef) and node.name in names
        ]
        if len(spans) < len(names):
            file.unlink()
            continue
        for start, end in sorted(spans, reverse=True):
            del lines[start - 1 : end]
            while start - 2 >= 0 and start - 2 < len(lines) and not lines[start - 2].strip():
                del lines[start - 2]  # the blank lines before the function
                start -= 1
        file.write_text("".join(lines).rstrip("\n") + "\n")


def build(name: str, bugs: list[Bug], work: Path, out: Path) -> list[dict[str, object]]:
    repo = work / name
    shutil.copytree(HERE / "repos" / name, repo, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HERE / "repos" / "run_tests.py", repo / "run_tests.py")  # each repository's own
    git(repo, "init", "--quiet", "--initial-branch=main")
    git(repo, "add", "-A")
    git(repo, "commit", "--quiet", "-m", "Initial commit")
    base = git(repo, "rev-parse", "HEAD").strip()
    clean = test_outcomes(repo)
    assert clean and set(clean.values()) == {"PASSED"}, f"{name}: the clean tests do not pass"
    instances = []
    for bug in bugs:
        source = (repo / bug.file).read_text()
        assert source.count(bug.old) == 1, f"{bug.file}: {bug.old!r} is not there once"
        digest = hashlib.sha256(f"{bug.file}\0{bug.old}\0{bug.new}".encode()).hexdigest()[:8]
        instance_id = f"reins__{name}.{base[:8]}.{bug.kind}__{digest}"
        git(repo, "checkout", "--quiet", "-b", instance_id, "main")
        (repo / bug.file).write_text(source.replace(bug.old, bug.new))
        outcomes = test_outcomes(repo)
        fail = sorted(t for t, outcome in outcomes.items() if outcome == "FAILED")
        passing = sorted(t for t, outcome in outcomes.items() if outcome == "PASSED")
        assert fail, f"{instance_id}: the bug breaks no test"
        git(repo, "commit", "--quiet", "-am", f"Bug: {instance_id}")
        patch = git(repo, "diff", "main", "HEAD")
        remove_tests(repo, fail)
        git(repo, "add", "-A")
        git(repo, "commit", "--quiet", "-m", "Remove the tests the fix must pass")
        git(repo, "checkout", "--quiet", "main")
        if not bug.branch:
            git(repo, "branch", "--quiet", "-D", instance_id)
        instances.append({
            "instance_id": instance_id,
            "repo": f"reins-swe/reins__{name}.{base[:8]}",
            "base_commit": base,
            "patch": patch,
            "problem_statement": bug.statement,
            "FAIL_TO_PASS": fail,
            "PASS_TO_PASS": passing,
            "created_at": DATE,
            "image_name": f"reins-swe/{name}:{base[:8]}",
        })  # fmt: skip
    git(repo, "-c", "pack.threads=1", "bundle", "create", "--quiet",
        str(out / f"{name}.bundle"), "--all")  # fmt: skip
    return instances


def main(out: Path = DATA) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="reins-swe-tasks-") as work:
        instances = build("minilib", MINILIB, Path(work), out)
        instances += build("tablelib", TABLELIB, Path(work), out)
    with (out / "instances.jsonl").open("w") as lines:
        for instance in instances:
            lines.write(json.dumps(instance) + "\n")
    repos = {
        str(instances[0]["repo"]): {"source": "minilib.bundle", "test_command": TEST_COMMAND,
                                    "test_paths": ["tests", "run_tests.py"]},
        str(instances[-1]["repo"]): {"source": "tablelib.bundle", "test_command": TEST_COMMAND,
                                     "test_paths": ["tests", "run_tests.py"]},
    }  # fmt: skip
    (out / "repos.json").write_text(json.dumps(repos, indent=2) + "\n")
    print(f"{len(instances)} instances in {out / 'instances.jsonl'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DATA)
