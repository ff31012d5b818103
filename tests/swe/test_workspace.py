"""`reins.swe.workspace` on the shipped tasks, in real sandboxes: the checkout hides the history,
the reward is the tests' verdict on the agent's diff applied where the tests are, and edits to
the tests do not count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from reins.swe.instances import Instance, RepoSource, static_filter
from reins.swe.workspace import Workspace, parse_summary, parse_test_log, summary_disagreement
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


FORGER = (
    "import builtins, importlib, re, sys\n"
    "print_ = builtins.print\n"
    "def forge(line):\n"
    "    count = re.fullmatch(r'(\\d+) passed, (\\d+) failed', line)\n"
    "    if count:\n"
    "        return f'{int(count[1]) + int(count[2])} passed, 0 failed'\n"
    "    return line.replace('FAILED', 'PASSED')\n"
    "builtins.print = lambda *a, **k: print_(*(forge(str(x)) for x in a), **k)\n"
    "sys.path = [p for p in sys.path if p not in ('', '/work')]\n"
    "del sys.modules['traceback']\n"
    "globals().update(vars(importlib.import_module('traceback')))\n"
)
"""A `traceback` for the shipped runner that rewrites its FAILED lines and its count."""


@pytest.mark.parametrize("disguise", ["link", "rename"])
def test_a_root_link_or_a_renamed_file_shadowing_the_runners_import_does_not_count(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path, disguise: str
) -> None:
    """Past the check on new root modules, both scored 1 without a fix: a link `traceback` to a
    package of the agent's (git records a link, not `traceback/__init__.py`), and README.md
    renamed to `traceback.py` (git's diff names a rename, not a new file)."""
    needs_sandbox()
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    workspace = Workspace(tmp_path, repos[instance.repo], instance.instance_id)
    work = workspace.checkout()
    if disguise == "link":
        (work / "minilib" / "support").mkdir()
        (work / "minilib" / "support" / "__init__.py").write_text(FORGER)
        (work / "traceback").symlink_to("minilib/support")
    else:
        (work / "minilib" / "support.py").write_text(FORGER)
        readme = (work / "README.md").read_text()
        (work / "README.md").unlink()  # mostly the same lines: a rename to git
        (work / "traceback.py").write_text(
            f'"""\n{readme}"""\nexec(open("/work/minilib/support.py").read())\n'
        )
    report = workspace.evaluate(instance)
    assert (report.reward, report.failed_to_pass) == (0.0, list(instance.fail_to_pass))
    assert " b/traceback" not in workspace.diff()
    assert " b/traceback" in workspace.diff(with_tests=True)


def test_every_new_root_module_is_left_out_as_it_shadows_installed_ones(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path
) -> None:
    """Not only the standard library's: a root `yaml.py` is what the tests' `import yaml` loads
    (pytest puts the root first on `sys.path` for a `tests/` package), and a root `pytest.py`
    is what `python -m pytest` runs. Either forged what the tests compare or report."""
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    workspace = Workspace(tmp_path, repos[instance.repo], instance.instance_id)
    work = workspace.checkout()
    shadows = ["pytest.py", "_pytest/__init__.py", "pluggy/__init__.py", "yaml.py"]
    shadows += ["numpy/__init__.py", "helpers.cpython-311-x86_64-linux-gnu.so"]
    kept = ["minilib/pytest.py", "minilib/yaml.py", "pytest", "notes.txt", "my-tool.py"]
    for name in shadows + kept:
        (work / name).parent.mkdir(exist_ok=True)
        (work / name).write_text("FORGED = 1\n")
    (work / "yaml").symlink_to("minilib")  # a package of the agent's under that name
    diff = workspace.diff()
    assert sorted(name for name in shadows + kept if f" b/{name}\n" in diff) == sorted(kept)
    assert " b/yaml\n" not in diff and " b/yaml\n" in workspace.diff(with_tests=True)


def test_modules_of_a_new_root_folder_are_left_out_as_namespace_package_portions(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path
) -> None:
    """A new root `google/protobuf/__init__.py` was kept: Python joins a root `google/` to an
    installed namespace package `google`, the root's portion first, so the tests' `import
    google.protobuf` loaded the agent's module."""
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    workspace = Workspace(tmp_path, repos[instance.repo], instance.instance_id)
    work = workspace.checkout()
    shadows = ["google/protobuf/__init__.py", "google/protobuf/message.py", "zope/interface.py"]
    kept = ["minilib/extra/helpers.py", "notes/readme.txt", "my-tool/run.py"]
    for name in shadows + kept:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("FORGED = 1\n")
    (work / "zope" / "schema").symlink_to("../minilib")  # a package of the agent's
    shadows.append("zope/schema")
    diff = workspace.diff()
    assert sorted(name for name in shadows + kept if f" b/{name}\n" in diff) == sorted(kept)
    assert all(f" b/{name}\n" in workspace.diff(with_tests=True) for name in shadows)


def src_layout_repo(folder: Path, branch: str) -> RepoSource:
    """A repository of a src layout (`src/pkg/`, which pytest's `pythonpath = ["src"]` or the
    package's install puts `src/` on `sys.path` for) with one task branch."""
    files = {
        "src/pkg/__init__.py": "",
        "src/pkg/core.py": "VALUE = 1\n",
        "pyproject.toml": '[tool.pytest.ini_options]\npythonpath = ["src"]\n',
        "tests/test_core.py": "from pkg.core import VALUE\n",
    }
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(content)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run([*git, *command], cwd=folder, check=True, capture_output=True)
    subprocess.run([*git, "branch", branch], cwd=folder, check=True, capture_output=True)
    return RepoSource(repo="src-layout", source=folder, test_command="true")


def test_modules_outside_the_packages_of_another_sys_path_folder_are_left_out(
    tmp_path: Path,
) -> None:
    """The namespace portion's guard looked at root folders only: a new
    `src/google/protobuf/__init__.py` was kept, where a src layout's `src/` is on `sys.path`
    (pytest's `pythonpath`, the package's install), so `import google.protobuf` loaded the
    agent's. So was a new `src/yaml.py`. New modules inside the package (`src/pkg/`) stay."""
    source = tmp_path / "source"
    source.mkdir()
    workspace = Workspace(tmp_path / "rollout", src_layout_repo(source, "task"), "task")
    work = workspace.checkout()
    shadows = ["src/google/protobuf/__init__.py", "src/zope/interface.py", "src/yaml.py"]
    shadows += ["src/six.cpython-311-x86_64-linux-gnu.so"]
    kept = ["src/pkg/extra/helpers.py", "src/pkg/new.py", "src/notes/readme.txt"]
    kept += ["src/my-tool/run.py", "src/pkg/core.py"]
    for name in shadows + kept:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("FORGED = 1\n")
    (work / "src" / "sphinxcontrib").symlink_to("pkg")  # a package of the agent's
    shadows.append("src/sphinxcontrib")
    diff = workspace.diff()
    shown = sorted(name for name in shadows + kept if f" b/{name}\n" in diff)
    assert shown == sorted(kept)
    assert all(f" b/{name}\n" in workspace.diff(with_tests=True) for name in shadows)


FLIP_PLUGIN = (
    "import pytest\n"
    "@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_makereport(item, call):\n"
    "    report = (yield).get_result()\n"
    "    report.outcome, report.longrepr = 'passed', None\n"
)
"""A pytest plugin that reports every test passed: its PASSED lines and count agree."""


@pytest.mark.parametrize(
    "loader",
    [
        {"pytest.toml": '[pytest]\naddopts = ["-p", "minilib.flip"]\npythonpath = ["."]\n'},
        {".pytest.toml": '[pytest]\naddopts = ["-p", "minilib.flip"]\npythonpath = ["."]\n'},
        {
            "flip-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: flip\nVersion: 1.0\n",
            "flip-1.0.dist-info/entry_points.txt": "[pytest11]\nflip = minilib.flip\n",
        },
        {
            "flip.egg-info/PKG-INFO": "Metadata-Version: 2.1\nName: flip\nVersion: 1.0\n",
            "flip.egg-info/entry_points.txt": "[pytest11]\nflip = minilib.flip\n",
        },
    ],
    ids=["pytest.toml", ".pytest.toml", "dist-info", "egg-info"],
)
def test_pytest_configuration_that_loads_a_plugin_of_the_agents_is_left_out(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path, loader: dict[str, str]
) -> None:
    """pytest 9 reads `pytest.toml` before every other file, and under `python -m pytest` it
    loads the `pytest11` entry points of a `*.dist-info` at the root: either made pytest load
    the agent's `minilib/flip.py`, which reported every test passed, count included."""
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    workspace = Workspace(tmp_path / "rollout", repos[instance.repo], instance.instance_id)
    work = workspace.checkout()
    (work / "minilib" / "flip.py").write_text(FLIP_PLUGIN)
    for name, content in loader.items():
        (work / name).parent.mkdir(exist_ok=True)
        (work / name).write_text(content)
    tested = tmp_path / "tested"
    assert workspace.tested_tree(tested, workspace.diff())
    assert (tested / "minilib" / "flip.py").is_file()  # a new module of the package: kept
    assert sorted(p.name for p in tested.iterdir()) == [
        "README.md", "minilib", "run_tests.py", "tests"
    ]  # fmt: skip
    # What the agent's files did, on the same tree: pytest read every test as passed.
    (tmp_path / "forged").mkdir()
    workspace.tested_tree(tmp_path / "forged", workspace.diff(with_tests=True))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path / "forged", capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert "FAILED" not in run.stdout and parse_summary(run.stdout) == {"passed": 39}


def test_the_users_git_settings_do_not_change_the_reward(
    shipped: tuple[list[Instance], dict[str, RepoSource]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `diff.noprefix = true` in ~/.gitconfig the agent's diff had no `a/` `b/` prefixes,
    so it did not apply to the tested tree: the gold fix scored 0."""
    needs_sandbox()
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[diff]\n\tnoprefix = true\n[color]\n\tui = always\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    workspace = Workspace(tmp_path / "rollout", repos[instance.repo], instance.instance_id)
    gold_fix(instance, workspace.checkout())
    report = workspace.evaluate(instance)
    assert (report.reward, report.reason) == (1.0, "all FAIL_TO_PASS and PASS_TO_PASS tests pass")


def test_compiled_root_modules_named_as_the_standard_library_are_left_out(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path
) -> None:
    """A root `traceback.so` (a compiled extension rewriting the runner's FAILED lines) was
    imported before the standard library's and scored 1 with two tests failing."""
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    workspace = Workspace(tmp_path, repos[instance.repo], instance.instance_id)
    work = workspace.checkout()
    shadows = [
        *("traceback.so", "traceback.abi3.so", "traceback.cpython-311-x86_64-linux-gnu.so"),
        *("pathlib.cpython-312-x86_64-linux-gnu.so", "json/__init__.abi3.so", "traceback.pyw"),
    ]
    kept = ["minilib/traceback.so", "helpers.txt"]
    for name in shadows + kept:
        (work / name).parent.mkdir(exist_ok=True)
        (work / name).write_bytes(b"\x7fELF compiled")
    diff = workspace.diff()
    assert sorted(name for name in shadows + kept if f" b/{name}\n" in diff) == sorted(kept)
    assert all(f" b/{name}\n" in workspace.diff(with_tests=True) for name in shadows)


def test_a_run_that_ends_before_its_runners_summary_scores_zero(
    shipped: tuple[list[Instance], dict[str, RepoSource]], tmp_path: Path
) -> None:
    """The package printed `PASSED <id>` for every test when the runner imported it, then
    `os._exit(0)`: every test read as passed, reward 1 without a fix."""
    needs_sandbox()
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    workspace = Workspace(tmp_path, repos[instance.repo], instance.instance_id)
    work = workspace.checkout()
    package = work / "minilib" / "__init__.py"
    package.write_text(
        package.read_text() + "import os, pathlib, re\n"
        "root = pathlib.Path(__file__).resolve().parent.parent\n"
        "for file in sorted((root / 'tests').glob('test_*.py')):\n"
        "    for name in re.findall(r'^def (test_\\w+)', file.read_text(), re.M):\n"
        "        print('PASSED', f'tests/{file.name}::{name}', flush=True)\n"
        "os._exit(0)\n"
    )
    report = workspace.evaluate(instance)
    assert (report.reward, report.failed_to_pass, report.broke) == (0.0, [], [])
    assert report.reason == "the test run printed no summary line (its runner did not finish)"


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
    # What configures the test run, and new root modules: left
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


RUNNER_LOG = (
    f"--- {A2}\nTraceback...\n==== short test summary info ====\nPASSED {A1}\nFAILED {A2}\n"
)


@pytest.mark.parametrize(
    ("log", "summary"),
    [
        (RUNNER_LOG + "1 passed, 1 failed\n", {"passed": 1, "failed": 1}),
        (
            "== 1 failed, 18 passed, 2 warnings in 0.12s ==",
            {"failed": 1, "passed": 18, "warnings": 2},
        ),
        ("3 passed, 1 deselected in 61.02s (0:01:01)", {"passed": 3, "deselected": 1}),
        ("== 2 errors in 1.5 seconds ==", {"errors": 2}),
        ("collected 3 items\n== no tests ran in 0.01s ==\n", None),
        ("we passed 3 checks\n", None),
    ],
)
def test_the_runners_summary_line_is_read(log: str, summary: dict[str, int] | None) -> None:
    assert parse_summary(log) == summary


@pytest.mark.parametrize(
    ("log", "disagreement"),
    [
        (RUNNER_LOG + "1 passed, 1 failed\n", ""),
        # pytest -v -rA names each test twice; a teardown error adds an ERROR line, not a count.
        (
            f"{A1} PASSED [ 50%]\n{A2} FAILED [100%]\nPASSED {A1}\nERROR {A1} - teardown\n"
            f"FAILED {A2} - assert\n=== 1 failed, 1 passed, 1 error in 0.1s ===\n",
            "",
        ),
        (
            f"PASSED {A1}\nPASSED {A2}\n",
            "the test run printed no summary line (its runner did not finish)",
        ),
        # The runner's FAILED line rewritten to PASSED; its count still says failed.
        (
            RUNNER_LOG.replace(f"FAILED {A2}", f"PASSED {A2}") + "1 passed, 1 failed\n",
            "the test run's summary counts 1 passed but 2 tests are reported PASSED",
        ),
        (
            f"PASSED {A1}\nFAILED {A2}\n2 passed, 0 failed\n",
            "the test run's summary counts 2 passed but 1 tests are reported PASSED",
        ),
    ],
)
def test_a_summary_that_contradicts_the_per_test_lines_is_named(
    log: str, disagreement: str
) -> None:
    assert summary_disagreement(log) == disagreement
