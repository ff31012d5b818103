"""Task instances in SWE-smith's format, the repositories they run in, and the static filters.

An instance is one JSON object (SWE-smith's fields; others are kept as they are)::

    {"instance_id": "owner__repo.abc123.func_pm_op_change__x1",
     "repo": "swesmith/owner__repo.abc123", "problem_statement": "...",
     "patch": "<the diff that brought the bug>",
     "FAIL_TO_PASS": ["tests/test_a.py::test_b"], "PASS_TO_PASS": [...],
     "image_name": "...", "base_commit": "..."}

SWE-smith ships each repository as a Docker image whose git repository holds one branch per
instance (named by its id): the bug, then a commit removing the FAIL_TO_PASS tests. Here a
repository is a `RepoSource`, listed in a `repos.json` beside the instances: where its git
repository is (a folder or a bundle file), the command that runs its tests, and the paths the
reward step restores before running them::

    {"swesmith/owner__repo.abc123": {"source": "repo.bundle", "test_command": "pytest -rA",
                                     "test_paths": ["tests"]}}
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

REQUIRED = ("instance_id", "repo", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS")
MAX_TESTS = 200
"""The paper drops tasks with more than 200 tests (python-jsonschema runs over 7,000)."""


_INSTANCE_ID = re.compile(r"[A-Za-z0-9._:-]+")
"""What a task id and the gateway's rollout ids may hold (`reins.schemas.Identifier`)."""


class InstanceError(ValueError):
    """An instance file or repos file is not what this module reads; the message says where."""


@dataclass(frozen=True)
class Instance:
    instance_id: str
    repo: str
    problem_statement: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    fields: dict[str, Any] = field(compare=False, repr=False)
    """The whole record as read (SWE-smith's other fields included)."""

    @property
    def tests(self) -> int:
        return len(self.fail_to_pass) + len(self.pass_to_pass)

    @classmethod
    def from_record(cls, record: Any, where: str) -> Instance:
        if not isinstance(record, dict):
            raise InstanceError(
                f"{where}: an instance is a JSON object, not {type(record).__name__}"
            )
        missing = [key for key in REQUIRED if key not in record]
        if missing:
            raise InstanceError(f"{where}: the instance lacks {', '.join(missing)}")
        tests = {}
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            value = record[key]
            if isinstance(value, str):  # SWE-bench's own files keep these as JSON text
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as error:
                    raise InstanceError(f"{where}: {key} is not a list ({error})") from None
            if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
                raise InstanceError(f"{where}: {key} must be a list of test ids")
            tests[key] = tuple(value)
        for key in ("instance_id", "repo"):
            if not isinstance(record[key], str) or not record[key]:
                raise InstanceError(f"{where}: {key} must be a non-empty string")
        if not _INSTANCE_ID.fullmatch(record["instance_id"]):
            # It names the task and its rollouts, in the gateway's URL-safe ids: a `/` failed
            # `prepare`'s rollouts after the policy had loaded, and `reins train` its tasks.
            raise InstanceError(
                f"{where}: instance_id {record['instance_id']!r} may hold only [A-Za-z0-9._:-]"
            )
        statement = record["problem_statement"]
        return cls(
            instance_id=record["instance_id"],
            repo=record["repo"],
            problem_statement=statement if isinstance(statement, str) else "",
            fail_to_pass=tests["FAIL_TO_PASS"],
            pass_to_pass=tests["PASS_TO_PASS"],
            fields=dict(record),
        )


def load_instances(path: Path) -> list[Instance]:
    """Instances from a .jsonl file (one a line), a .json file (a list), or a folder of them;
    an id seen twice is an error (the second would silently replace the first's results)."""
    path = Path(path)
    if not path.exists():
        raise InstanceError(f"{path} does not exist")
    files = (
        sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json"))
        if path.is_dir()
        else [path]
    )
    files = [f for f in files if f.name != "repos.json"]
    instances: list[Instance] = []
    for file in files:
        try:
            instances += _read_file(file)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:  # a truncated .json
            raise InstanceError(f"{file}: not JSON in UTF-8 ({error})") from None
    seen: set[str] = set()
    for instance in instances:
        if instance.instance_id in seen:
            raise InstanceError(f"instance {instance.instance_id} appears twice under {path}")
        seen.add(instance.instance_id)
    return instances


def _read_file(file: Path) -> list[Instance]:
    instances: list[Instance] = []
    if file.suffix == ".json":
        records = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(records, list):
            raise InstanceError(f"{file}: a .json instance file holds a list of instances")
        return [Instance.from_record(r, f"{file}[{i}]") for i, r in enumerate(records)]
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise InstanceError(f"{file}:{number}: not JSON ({error})") from None
                instances.append(Instance.from_record(record, f"{file}:{number}"))
    return instances


@dataclass(frozen=True)
class RepoSource:
    repo: str
    source: Path
    """A git repository (folder) or bundle file holding a branch per instance."""
    test_command: str
    """Run in the repository's root; prints one line per test in pytest's `-rA` or `-v` form,
    then pytest's count line (`1 failed, 18 passed`): `workspace.summary_disagreement`."""
    test_paths: tuple[str, ...] = ("tests",)
    """Reset to the problem branch's parent (where the FAIL_TO_PASS tests still are) before the
    tests run: the agent's edits of tests do not count, and the removed tests come back."""

    def branches(self) -> set[str]:
        """The branch names the source holds (`git ls-remote`, which reads bundles too)."""
        done = subprocess.run(
            ["git", "ls-remote", "--heads", str(self.source)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise InstanceError(f"cannot list the branches of {self.source}: {done.stderr.strip()}")
        prefix = "refs/heads/"
        return {
            ref[len(prefix) :]
            for line in done.stdout.splitlines()
            for ref in line.split()[1:]
            if ref.startswith(prefix)
        }


def load_repos(path: Path) -> dict[str, RepoSource]:
    """`repos.json`: repository name -> where it is (relative to the file) and how it is tested."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise InstanceError(f"cannot read the repositories file {path}: {error}") from None
    if not isinstance(raw, dict):
        raise InstanceError(f"{path}: maps repository names to their sources")
    repos = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict) or "source" not in entry or "test_command" not in entry:
            raise InstanceError(f"{path}: {name} needs a `source` and a `test_command`")
        repos[name] = RepoSource(
            repo=name,
            source=(path.parent / entry["source"]).resolve(),
            test_command=str(entry["test_command"]),
            test_paths=_test_paths(path, name, entry.get("test_paths", ["tests"])),
        )
    return repos


def _test_paths(path: Path, name: str, paths: Any) -> tuple[str, ...]:
    """`test_paths` checked: a string was read letter by letter (`"tests"` as t, e, s...,
    leaving the tests editable), and an absolute path failed every rollout."""
    if not isinstance(paths, list) or not paths:
        raise InstanceError(f"{path}: {name}'s test_paths is {paths!r}, not a list of paths")
    for entry in paths:
        parts = PurePosixPath(entry).parts if isinstance(entry, str) else ()
        if not parts or entry.startswith("/") or ".." in parts:
            raise InstanceError(
                f"{path}: {name}'s test path {entry!r} is not a path inside the repository"
            )
    return tuple(paths)


@dataclass
class Stage:
    name: str
    kept: int
    dropped: int = 0


@dataclass
class Filtered:
    kept: list[Instance]
    stages: list[Stage]
    dropped: dict[str, str]
    """instance id -> why it was dropped."""


def static_filter(
    instances: Iterable[Instance], repos: dict[str, RepoSource], *, max_tests: int = MAX_TESTS
) -> Filtered:
    """The paper's filters, in its order: an empty problem statement, a problem branch missing
    from its repository (or a repository not in `repos`), more than `max_tests` tests."""
    kept = list(instances)
    stages, dropped = [Stage("loaded", len(kept))], {}

    def stage(name: str, reason_of: Any) -> None:
        nonlocal kept
        survivors = []
        for instance in kept:
            reason = reason_of(instance)
            if reason:
                dropped[instance.instance_id] = reason
            else:
                survivors.append(instance)
        stages.append(Stage(name, len(survivors), len(kept) - len(survivors)))
        kept = survivors

    stage(
        "problem statement",
        lambda i: "" if i.problem_statement.strip() else "empty problem statement",
    )
    # No test to make pass: doing nothing scored 1.
    stage("a FAIL_TO_PASS test", lambda i: "" if i.fail_to_pass else "no FAIL_TO_PASS test")
    branches = {
        name: repo.branches() for name, repo in repos.items() if name in {i.repo for i in kept}
    }

    def branch_missing(instance: Instance) -> str:
        if instance.repo not in repos:
            return f"repository {instance.repo} is not in the repositories file"
        if instance.instance_id not in branches[instance.repo]:
            return f"problem branch missing from {repos[instance.repo].source.name}"
        return ""

    stage("problem branch", branch_missing)
    stage(f"at most {max_tests} tests", lambda i: f"{i.tests} tests" if i.tests > max_tests else "")
    return Filtered(kept, stages, dropped)
