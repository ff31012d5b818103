"""Skips for a missing dependency fail under CI (`tests/required.py`): each test file that needs an
optional package is run with `CI` set and that package made unimportable, and must fail."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = """
import importlib.abc
import os
import sys

BLOCKED = tuple(os.environ["REINS_TEST_BLOCKED"].split(","))


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith(BLOCKED):
            raise ModuleNotFoundError(f"{name} is blocked by the test", name=name)
        return None


sys.meta_path.insert(0, _Blocker())
"""

# (test file, a test in it that needs the package, the package)
NEEDS = [
    ("tests/samples/test_samples_tokenizer.py", "", "transformers"),
    ("tests/monitor/test_tokens.py", "test_token_texts_join_back_into_the_text", "transformers"),
    ("tests/monitor/test_browser.py", "test_dashboard_in_chromium", "playwright"),
    ("tests/monitor/test_export_report.py", "test_report_writes_a_png", "matplotlib"),
]


def _run(path: str, test: str, blocked: str, tmp_path: Path, ci: bool) -> str:
    (tmp_path / "reins_block_imports.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(
        REINS_TEST_BLOCKED=blocked,
        PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")])),
    )
    if ci:
        env["CI"] = "true"
    selection = ["-k", test] if test else []
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "reins_block_imports", "-p", "no:cacheprovider",
         "-m", "", "-x", path, *selection],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    return summary + "\n" + result.stdout[-3000:] + result.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "test", "blocked"), NEEDS, ids=[n[0] for n in NEEDS])
def test_a_missing_package_fails_under_ci(
    path: str, test: str, blocked: str, tmp_path: Path
) -> None:
    """(Locally the same run skips; `required.missing` is one `if` on `CI`.)"""
    under_ci = _run(path, test, blocked, tmp_path, ci=True)
    assert re.search(r"\d+ (failed|error)", under_ci.splitlines()[0]), under_ci
    assert "CI is set" in under_ci, under_ci
