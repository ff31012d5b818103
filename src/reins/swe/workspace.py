"""A rollout's checkout of its problem branch, and the reward: do the task's tests pass?

The agent works in `work/`, which holds the problem branch's files and no `.git`: the git
directory is cloned beside it (`git/`), outside anything a sandbox shows, so the history (and
the commit before the bug) is out of the agent's reach, and sandboxes made with `GIT_DISABLED`
have no git to run (paper section 4.3.2, safeguard one).

The reward step, as SWE-smith evaluates: the agent's change is the diff of `work/` against the
branch (new files included, the repository's test paths excluded); it is applied to a fresh tree
of the branch's parent commit, where the FAIL_TO_PASS tests still are, and the repository's test
command runs there in a new sandbox. Reward 1 when every FAIL_TO_PASS and PASS_TO_PASS test
passes and the runner's own summary line (`3 passed, 1 failed`) counts the passed and failed
tests that its per-test lines report, else 0.
"""

from __future__ import annotations

import importlib.machinery
import io
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from reins.sandbox import Sandbox, SandboxLimits
from reins.swe.instances import Instance, RepoSource

GIT_DISABLED: dict[str, Any] = {
    "disabled_commands": ("git",),
    "hidden_paths": ("/usr/lib/git-core",),
}
"""Sandbox settings for the agent's commands: `git` answers that it is disabled, and git's own
programs (`/usr/lib/git-core/git`, reachable without the PATH) are gone."""
TEST_LIMITS = SandboxLimits(
    wall_s=600, cpu_s=600, memory_mb=2048, processes=256, output_chars=4_000_000
)
"""The test run's sandbox: a whole suite's time and a log long enough for every test's line."""
_ID = r"\S+::[^\s\[]+(?:\[[^\]]*\])?"
"""A pytest test id: a parametrized one's brackets may hold spaces (`test_shout[a b]`)."""
_OUTCOME = r"PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_RESULT = re.compile(rf"^({_OUTCOME})\s+({_ID})(?:\s|$)")
_RESULT_AFTER = re.compile(rf"^({_ID})\s+({_OUTCOME})\b")
_SUMMARY_COUNT = re.compile(
    r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|warnings?|deselected|rerun)"
)
_SUMMARY_TIME = re.compile(r"\s+in\s+[\d.]+\s*(?:s|seconds)(?:\s+\(\S+\))?$")
RUN_CONFIGURATION = (
    "conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", ".pytest.ini",
    "pytest.toml", ".pytest.toml", "sitecustomize.py", "usercustomize.py", "*.pth",
    "*.dist-info", "*.egg-info",
)  # fmt: skip
"""Files and folders (at any depth) that configure how the tests run rather than what they
test: the agent's changes to them are left out of the tested tree (a root `conftest.py` hook
can report every test passed; `pytest.ini`, or pytest 9's `pytest.toml`, can load a plugin of
the agent's; so can a `*.dist-info` folder's `pytest11` entry point, which pytest loads from
the root under `python -m pytest`)."""


class WorkspaceError(RuntimeError):
    """The task's repository could not be checked out (a setup problem, not the agent's)."""


GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
"""git without the user's and the system's settings: a `diff.noprefix`, `color.diff = always` or
`diff.external` there changed the diff's form, so that no agent's change applied to the tested
tree (the gold fix scored 0)."""


def _git(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> bytes:
    done = subprocess.run(
        ["git", "-c", "core.hooksPath=/dev/null", *args], capture_output=True, cwd=cwd,
        env={**os.environ, **GIT_ENV, **(env or {})}, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise WorkspaceError(
            f"git {' '.join(args)}: {done.stderr.decode(errors='replace').strip()}"
        )
    return done.stdout


def _reports(log: str) -> Iterator[tuple[str, str]]:
    """(test id, outcome) for each line of a log in pytest's `-rA` (`PASSED id`) or `-v`
    (`id PASSED`) form, in order."""
    for line in log.splitlines():
        line = line.strip()
        if match := _RESULT.match(line):
            yield match.group(2), match.group(1)
        elif match := _RESULT_AFTER.match(line):
            yield match.group(1), match.group(2)


def parse_test_log(log: str) -> dict[str, str]:
    """Test id -> outcome from a log in pytest's `-rA` (`PASSED id`) or `-v` (`id PASSED`) form.
    A test reported more than once has passed only when every report says so: a line printed by
    the code under test ("PASSED tests/t.py::test_x") does not undo the runner's FAILED."""
    outcomes: dict[str, str] = {}
    for test, outcome in _reports(log):
        if outcomes.get(test, "PASSED") == "PASSED":
            outcomes[test] = outcome
    return outcomes


def parse_summary(log: str) -> dict[str, int] | None:
    """The counts of the log's last summary line: pytest's `=== 1 failed, 18 passed in 0.12s ===`
    (`-q`: without the `=`), the shipped runner's `18 passed, 1 failed`; None when there is none
    (pytest's `no tests ran` has no counts)."""
    summary = None
    for line in log.splitlines():
        line = _SUMMARY_TIME.sub("", line.strip().strip("=").strip())
        counts = [_SUMMARY_COUNT.fullmatch(part) for part in line.split(", ")]
        if line and all(counts):
            summary = {match.group(2): int(match.group(1)) for match in counts if match}
    return summary


def summary_disagreement(log: str) -> str:
    """Why the runner's own summary line contradicts the log's per-test lines, '' when it agrees:
    code under test that prints `PASSED <id>` lines and then ends the process (`os._exit(0)`)
    leaves no summary; code that rewrites the runner's FAILED lines leaves a summary still
    counting them as failed."""
    summary = parse_summary(log)
    if summary is None:
        return "the test run printed no summary line (its runner did not finish)"
    reported: dict[str, set[str]] = {"PASSED": set(), "FAILED": set()}
    for test, outcome in _reports(log):
        if outcome in reported:
            reported[outcome].add(test)
    for outcome, tests in reported.items():
        counted = summary.get(outcome.lower(), 0)
        if len(tests) != counted:
            return (
                f"the test run's summary counts {counted} {outcome.lower()} but "
                f"{len(tests)} tests are reported {outcome}"
            )
    return ""


_IMPORT_SUFFIXES = (*importlib.machinery.all_suffixes(), ".pyw", ".pyd", ".so")
"""What `import NAME` loads besides `NAME.py`: bytecode (`.pyc`) and compiled extensions
(`NAME.so`, `NAME.abi3.so`, `NAME.cpython-312-x86_64-linux-gnu.so`: any tag ends in `.so`,
whichever Python runs the tests), and Windows' `.pyw`/`.pyd`."""


def _new_root_module(path: str, *, link: bool = False) -> bool:
    """A module or package at the repository's root (`yaml.py`, `traceback.so`,
    `json/__init__.pyc`, or a `link` named `yaml`, which is a package when it leads to a folder
    with an `__init__.py`). The root comes first on `sys.path` for a runner script there, for
    `python -m pytest`, and, once pytest collects a `tests/` folder with an `__init__.py`, for
    the tests themselves: a new root module is what `import NAME` loads in place of the
    standard library's or the installed one (`traceback` rewriting the runner's FAILED lines, a
    `yaml.py` whose `safe_load` answers what the test compares with, `pytest.py`). A fix of the
    package never needs one. Deeper, `pkg/types.py` is `pkg.types`, no shadow."""
    parts = PurePosixPath(path).parts
    if len(parts) == 1:
        module, file = parts[0].split(".")[0], parts[0]
        if link and file == module:
            return module.isidentifier()
    elif len(parts) == 2 and parts[1].split(".")[0] == "__init__":
        module, file = parts
    else:
        return False
    return module.isidentifier() and file.endswith(_IMPORT_SUFFIXES)


@dataclass(frozen=True)
class _HeadFolders:
    """HEAD's folders, and those of them that are regular packages (an `__init__` module)."""

    folders: frozenset[str]
    packages: frozenset[str]

    @classmethod
    def read(cls, env: dict[str, str]) -> _HeadFolders:
        # `<mode> <type> <object>\t<path>` per entry; `-t` lists the folders too.
        raw = _git("ls-tree", "-r", "-t", "-z", "HEAD", env=env).decode(errors="surrogateescape")
        folders, packages = set(), set()
        for entry in filter(None, raw.split("\0")):
            info, _, path = entry.partition("\t")
            parts = PurePosixPath(path).parts
            if info.split()[1] == "tree":
                folders.add(path)
            elif len(parts) > 1 and _is_init_module(parts[-1]):
                packages.add(str(PurePosixPath(*parts[:-1])))
        return cls(frozenset(folders), frozenset(packages))


def _is_init_module(name: str) -> bool:
    """`__init__.py`, `__init__.pyc`, `__init__.cpython-312-x86_64-linux-gnu.so`..."""
    return name.split(".")[0] == "__init__" and name.endswith(_IMPORT_SUFFIXES)


def _outside_head_packages(path: str, head: _HeadFolders, *, link: bool = False) -> bool:
    """A new module file, or a `link` (`google/protobuf` to a folder of the agent's), outside
    the regular packages of HEAD: in a folder HEAD does not have, made at the root or in a
    folder of HEAD that is no package (`google/protobuf/__init__.py`, or
    `src/google/protobuf/__init__.py` in a src layout, when HEAD had no `google/` there), or
    itself in such a folder (`src/yaml.py`). A folder that is no package may be on `sys.path`
    (the root; `src/` by pytest's `pythonpath` or the package's install), where Python joins a
    new folder, with or without an `__init__.py`, to an installed namespace package of its name
    (`google`, `zope`, `sphinxcontrib`), the first portion on `sys.path` first, and a module
    shadows an installed one: `import google.protobuf` then loads the agent's. A new folder
    inside a package of HEAD (`minilib/extra/`) is that package's subpackage, no shadow. A fix
    of the package never needs a new module outside its packages."""
    parts = PurePosixPath(path).parts
    if not (link or parts[-1].endswith(_IMPORT_SUFFIXES)):
        return False
    # A link is a folder too when it leads to one (`zope/schema`, `src/google`).
    folders = parts if link else parts[:-1]
    depth = next(
        (
            d
            for d in range(len(folders))
            if str(PurePosixPath(*folders[: d + 1])) not in head.folders
        ),
        None,
    )
    if depth is None:  # a module file in a folder of HEAD
        name, parent = parts[-1].split(".")[0], folders
    else:
        name, parent = folders[depth], folders[:depth]
    return name.isidentifier() and str(PurePosixPath(*parent)) not in head.packages


def _added(env: dict[str, str]) -> Iterator[tuple[str, bool]]:
    """(path, is a symbolic link) for each file the index adds to HEAD. Renames are not looked
    for: a file renamed to `traceback.py` is a new `traceback.py`, not a change of the old one's
    (it went past the check on new files)."""
    raw = _git("diff", "--cached", "--raw", "-z", "--no-renames", "--diff-filter=A", "HEAD",
               env=env).decode(errors="surrogateescape").split("\0")  # fmt: skip
    for status, path in zip(raw[0::2], raw[1::2], strict=False):
        yield path, status.split()[1] == "120000"


@dataclass
class TestReport:
    reward: float
    failed_to_pass: list[str] = field(default_factory=list)
    """FAIL_TO_PASS tests that did not pass."""
    broke: list[str] = field(default_factory=list)
    """PASS_TO_PASS tests that did not pass."""
    patch_applied: bool = True
    seconds: float = 0.0
    log_tail: str = ""
    log_disagrees: str = ""
    """Why the test run's summary line contradicts its per-test lines (`summary_disagreement`):
    reward 0 whatever those lines say."""

    @property
    def reason(self) -> str:
        if not self.patch_applied:
            return "the agent's change does not apply to the tested tree"
        if self.reward == 1.0:
            return "all FAIL_TO_PASS and PASS_TO_PASS tests pass"
        parts = [self.log_disagrees] if self.log_disagrees else []
        if self.failed_to_pass:
            parts.append(f"{len(self.failed_to_pass)} FAIL_TO_PASS still failing")
        if self.broke:
            parts.append(f"{len(self.broke)} PASS_TO_PASS broken")
        return "; ".join(parts)


class Workspace:
    """`root/work` (the agent's checkout, no `.git`) and `root/git` (its history)."""

    def __init__(self, root: Path, repo: RepoSource, instance_id: str) -> None:
        self.root, self.repo, self.instance_id = Path(root), repo, instance_id
        self.work = self.root / "work"
        self.git_dir = self.root / "git"

    def checkout(self) -> Path:
        """Clones the problem branch; returns the work tree."""
        self.root.mkdir(parents=True, exist_ok=True)
        _git("clone", "--quiet", "--no-tags", "--single-branch", "--branch", self.instance_id,
             "--separate-git-dir", str(self.git_dir),
             str(self.repo.source), str(self.work))  # fmt: skip
        (self.work / ".git").unlink()  # the `gitdir:` pointer: the agent sees no repository
        exclude = self.git_dir / "info" / "exclude"
        exclude.parent.mkdir(exist_ok=True)
        exclude.write_text("__pycache__/\n*.pyc\n.pytest_cache/\n")
        return self.work

    def _tree_env(self) -> dict[str, str]:
        return {"GIT_DIR": str(self.git_dir), "GIT_WORK_TREE": str(self.work),
                "GIT_INDEX_FILE": str(self.root / "agent.index")}  # fmt: skip

    def diff(self, *, with_tests: bool = False) -> str:
        """The agent's change to the work tree as a binary git diff (new files included); left
        out unless `with_tests`: the repository's test paths, the files that configure the test
        run (`RUN_CONFIGURATION`), and new (or renamed) modules and packages at the root, which
        shadow what the runner and the tests import (`_new_root_module`), and every other new
        module outside the packages of HEAD (`_outside_head_packages`)."""
        env = self._tree_env()
        _git("read-tree", "HEAD", env=env)
        _git("add", "--all", env=env)
        excluded = []
        if not with_tests:
            excluded = [f":(exclude){path}" for path in self.repo.test_paths]
            excluded += [  # a name's files, and a folder's (`x.dist-info/entry_points.txt`)
                f":(exclude,glob)**/{name}{inside}"
                for name in RUN_CONFIGURATION
                for inside in ("", "/**")
            ]
            head = _HeadFolders.read(env)
            excluded += [
                f":(exclude,literal){path}"
                for path, link in _added(env)
                if _new_root_module(path, link=link)
                or _outside_head_packages(path, head, link=link)
            ]
        return _git("diff", "--cached", "--binary", "HEAD", "--", ".", *excluded, env=env).decode(
            errors="surrogateescape"
        )

    def tested_tree(self, dest: Path, patch: str) -> bool:
        """The branch's parent commit (the tests before their removal) in `dest`, the agent's
        `patch` applied; False when it does not apply (the tree is then the unpatched one)."""
        env = {"GIT_DIR": str(self.git_dir)}
        parent = "HEAD~1"
        try:
            _git("rev-parse", "--verify", "--quiet", parent, env=env)
        except WorkspaceError:
            parent = "HEAD"  # a branch of one commit: its tests were never removed
        archive = _git("archive", "--format=tar", parent, env=env)
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            if hasattr(tarfile, "data_filter"):  # Python 3.11.4+: refuse links out of `dest`
                tar.extractall(dest, filter="data")
            else:  # git's own archive of the repository's tree
                tar.extractall(dest)
        if not patch.strip():
            return True
        patch_file = self.root / "agent.patch"
        patch_file.write_bytes(patch.encode(errors="surrogateescape"))
        env = {"GIT_DIR": str(self.git_dir), "GIT_WORK_TREE": str(dest),
               "GIT_INDEX_FILE": str(self.root / "apply.index")}  # fmt: skip
        try:  # from the tree's root: `git apply` takes the patch's paths relative to the cwd
            _git("apply", "--binary", "--whitespace=nowarn", str(patch_file), env=env, cwd=dest)
        except WorkspaceError:
            return False
        return True

    def evaluate(
        self,
        instance: Instance,
        limits: SandboxLimits = TEST_LIMITS,
        sandbox_options: Mapping[str, Any] | None = None,
    ) -> TestReport:
        """The reward of the work tree as it is now (call it after the agent's sandbox closed).
        `sandbox_options`: more `Sandbox` keywords (the task image's environment: its mounts and
        PATH)."""
        dest = self.root / "tested"
        shutil.rmtree(dest, ignore_errors=True)
        applied = self.tested_tree(dest, self.diff())
        if not applied:
            return TestReport(0.0, list(instance.fail_to_pass), [], patch_applied=False)
        with Sandbox(dest, limits, **GIT_DISABLED, **(sandbox_options or {})) as sandbox:
            result = sandbox.run(self.repo.test_command)
        outcomes = parse_test_log(result.output)
        still = [t for t in instance.fail_to_pass if outcomes.get(t) != "PASSED"]
        broke = [t for t in instance.pass_to_pass if outcomes.get(t) != "PASSED"]
        disagrees = summary_disagreement(result.output)
        reward = 1.0 if not still and not broke and not disagrees else 0.0
        return TestReport(
            reward, still, broke, True, result.seconds, result.output[-2000:], disagrees
        )
