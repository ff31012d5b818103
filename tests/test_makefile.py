"""`make test` and its tiers end with pytest's closing line (`N passed, M skipped in ...`), so a
user and CI's log see how many tests ran. pyproject's `addopts` already has `-q`; one more `-q` on
the command line (`-qq`) drops that line."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pytest_commands() -> list[list[str]]:
    """The pytest arguments of every Makefile recipe that runs pytest, with the Makefile's own
    `NAME ?= value` variables put in."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    variables = dict(re.findall(r"^(\w+) \?= (.*)$", "\n".join(lines), flags=re.MULTILINE))
    commands = []
    for line in lines:
        match = re.search(r"-m pytest(.*)$", line)
        if match and line.startswith("\t"):
            arguments = re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], match.group(1))
            commands.append(shlex.split(arguments))
    return commands


def test_the_makefile_runs_pytest() -> None:
    assert len(_pytest_commands()) >= 3


@pytest.mark.parametrize("args", _pytest_commands(), ids=" ".join)
def test_each_tier_ends_with_the_count_of_tests(args: list[str], tmp_path: Path) -> None:
    # The tier's own selection and paths are replaced by two tests, one passing, one skipped.
    flags = [a for i, a in enumerate(args) if a.startswith("-") and not a.startswith("tests")]
    kept = [a for a in flags if a != "-m"]
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import pytest\n\ndef test_ok():\n    assert 1 + 1 == 2\n\n"
        "def test_skipped():\n    pytest.skip('on purpose')\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),
            *kept,
            "-m",
            "",
            "-p",
            "no:cacheprovider",
            str(sample),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\b1 passed, 1 skipped\b", result.stdout), result.stdout
