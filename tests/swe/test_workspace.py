"""`reins.swe.workspace` on the shipped tasks, in real sandboxes: the checkout hides the history,
the reward is the tests' verdict on the agent's diff applied where the tests are, and edits to
the tests do not count."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from reins.swe.instances import Instance, RepoSource, static_filter
from reins.swe.workspace import Workspace, parse_test_log
from tests.swe.conftest import by_id, needs_sandbox


def gold_fix(instance: Instance, work: Path) -> None:
    """The reverse of the diff that brought the bug, applied in the work tree."""
    subprocess.run(
        ["git", "apply", "-R", "-"], input=instance.fields["patch"], text=True, cwd=work,
        env={"GIT_DIR": "/nonexistent"}, check=True, capture_output=True,
    )  # fmt: skip


def test_every_task_scores_zero_unfixed_and_one_with_its_gold_fix(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path
) -> None:
    needs_sandbox()
    instances, repos = shipped
    kept = static_filter(instances, repos).kept
    assert len(kept) == 19
    for number, instance in enumerate(kept):
        workspace = Workspace(tmp_path / str(number), repos[instance.repo], instance.instance_id)
        work = workspace.checkout()
        unfixed = workspace.evaluate(instance)
        assert (unfixed.reward, unfixed.failed_to_pass, unfixed.broke) == (
            0.0, list(instance.fail_to_pass), []
        ), instance.instance_id  # fmt: skip
        gold_fix(instance, work)
        fixed = workspace.evaluate(instance)
        assert (fixed.reward, fixed.reason) == (1.0, "all FAIL_TO_PASS and PASS_TO_PASS tests pass")


def test_the_checkout_has_no_history_and_no_failing_tests(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path
) -> None:
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")  # slugify's double dashes
    workspace = Workspace(tmp_path, repos[instance.repo], instance.instance_id)
    work = workspace.checkout()
    assert sorted(p.name for p in work.iterdir()) == [
        "README.md",
        "minilib",
        "run_tests.py",
        "tests",
    ]
    assert not (work / ".git").exists() and (tmp_path / "git" / "HEAD").is_file()
    (test_id,) = instance.fail_to_pass
    assert test_id.split("::")[1] not in (work / "tests" / "test_text.py").read_text()
    assert "elif out:" in (work / "minilib" / "text.py").read_text()  # the bug is there


def test_edits_to_the_tests_do_not_count_and_a_broken_test_scores_zero(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path
) -> None:
    needs_sandbox()
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    workspace = Workspace(tmp_path, repos[instance.repo], instance.instance_id)
    work = workspace.checkout()
    # Emptying the test files and making the runner report success changes nothing.
    for test_file in (work / "tests").glob("test_*.py"):
        test_file.write_text("")
    (work / "run_tests.py").write_text("print('PASSED tests/test_text.py::anything')\n")
    assert workspace.evaluate(instance).reward == 0.0
    gold_fix(instance, work)
    assert workspace.evaluate(instance).reward == 1.0  # the real fix, tests restored
    # A fix that breaks another function: PASS_TO_PASS tests fail.
    lists = work / "minilib" / "lists.py"
    lists.write_text(lists.read_text().replace("seen.add(item)", "pass"))
    broken = workspace.evaluate(instance)
    assert broken.reward == 0.0
    assert broken.broke == ["tests/test_lists.py::test_dedupe_keeps_first_order"]
    assert broken.reason == "1 PASS_TO_PASS broken"


def test_a_root_module_shadowing_the_runners_import_does_not_count(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path
) -> None:
    """A new `traceback.py` beside `run_tests.py` (which imports traceback) rewrote every FAILED
    line to PASSED: reward 1 without a fix."""
    needs_sandbox()
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    workspace = Workspace(tmp_path, repos[instance.repo], instance.instance_id)
    work = workspace.checkout()
    (work / "traceback.py").write_text(
        "import builtins, importlib, os, sys\n"
        "print_ = builtins.print\n"
        "builtins.print = lambda *a, **k: print_(*(str(x).replace('FAILED', 'PASSED') "
        "for x in a), **k)\n"
        "sys.path = [p for p in sys.path if p not in ('', os.path.dirname(__file__))]\n"
        "del sys.modules['traceback']\n"
        "globals().update(vars(importlib.import_module('traceback')))\n"
    )
    assert workspace.evaluate(instance).reward == 0.0


def test_the_diff_holds_new_files_and_no_tests_or_bytecode(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path
) -> None:
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    workspace = Workspace(tmp_path, repos[instance.repo], instance.instance_id)
    work = workspace.checkout()
    (work / "minilib" / "extra.py").write_text("VALUE = 1\n")
    (work / "tests" / "test_mine.py").write_text("def test_x():\n    pass\n")
    (work / "minilib" / "__pycache__").mkdir()
    (work / "minilib" / "__pycache__" / "text.cpython-311.pyc").write_bytes(b"\0bytecode")
    # What configures the test run, and root modules named as the standard library's: left
    # out (a conftest hook reported every test passed; a root `traceback.py` rewrote the
    # runner's lines). A module of the package named so is the package's own: kept.
    configuring = [
        *("conftest.py", "minilib/conftest.py", "pytest.ini", "setup.cfg", "tox.ini"),
        *("pyproject.toml", "traceback.py", "json/__init__.py", "sitecustomize.py"),
    ]
    for name in configuring:
        (work / name).parent.mkdir(exist_ok=True)
        (work / name).write_text("HACK = 1\n")
    (work / "minilib" / "types.py").write_text("KIND = 2\n")
    diff = workspace.diff()
    assert "b/minilib/extra.py" in diff and "+VALUE = 1" in diff
    assert "b/minilib/types.py" in diff
    assert "test_mine" not in diff and "pycache" not in diff and "HACK" not in diff
    assert "b/tests/test_mine.py" in workspace.diff(with_tests=True)
    assert all(f"b/{name}" in workspace.diff(with_tests=True) for name in configuring)


def test_a_patch_that_does_not_apply_leaves_the_tested_tree_unpatched(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path
) -> None:
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    workspace = Workspace(tmp_path, repos[instance.repo], instance.instance_id)
    workspace.checkout()
    bogus = "--- a/minilib/text.py\n+++ b/minilib/text.py\n@@ -1,1 +1,1 @@\n-not there\n+x\n"
    assert workspace.tested_tree(tmp_path / "t", bogus) is False
    assert "elif out:" in (tmp_path / "t" / "minilib" / "text.py").read_text()
    # the parent commit: the removed test is back
    assert "test_slugify_joins_words" in (tmp_path / "t" / "tests" / "test_text.py").read_text()


A1, A2 = "tests/a.py::t1", "tests/a.py::t2"


@pytest.mark.parametrize(
    ("log", "outcomes"),
    [
        (f"PASSED {A1}\nFAILED {A2} - assert 1 == 2\n", {A1: "PASSED", A2: "FAILED"}),
        (f"{A1} PASSED [ 50%]\n{A2} ERROR [100%]\n", {A1: "PASSED", A2: "ERROR"}),
        # Passed only if every report says so: the code under test can print a line too.
        (f"{A1} FAILED\n  PASSED {A1}\n", {A1: "FAILED"}),
        (f"PASSED {A1}\nPASSED {A1}\n", {A1: "PASSED"}),
        # A parametrized id may hold spaces, in either form.
        (
            f"PASSED {A1}[a b]\nFAILED {A2}[x y] - boom [1]\n",
            {f"{A1}[a b]": "PASSED", f"{A2}[x y]": "FAILED"},
        ),
        (f"{A1}[a b] PASSED [ 50%]\n", {f"{A1}[a b]": "PASSED"}),
        ("collected 2 items\nPASSED without an id\n== 2 passed ==\n", {}),
    ],
)
def test_test_logs_in_either_pytest_form_are_read(log: str, outcomes: dict[str, str]) -> None:
    assert parse_test_log(log) == outcomes
