"""The shipped task set (examples/swe/make_tasks.py) and `reins.swe.instances`: reading
SWE-smith's format, the repositories file, and the paper's static filters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reins.swe.instances import Instance, InstanceError, load_instances, load_repos, static_filter
from tests.swe.conftest import DATA, ROOT


def test_generation_is_deterministic_and_equals_the_committed_files(tmp_path: Path) -> None:
    """Whatever the user's git settings: `diff.noprefix` changed every instance's patch."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[diff]\n\tnoprefix = true\n")
    env = {**os.environ, "HOME": str(home)}
    env.pop("XDG_CONFIG_HOME", None)
    out = tmp_path / "data"
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "swe" / "make_tasks.py"), str(out)],
        check=True, capture_output=True, timeout=300, env=env,
    )  # fmt: skip
    for name in ("instances.jsonl", "repos.json", "minilib.bundle", "tablelib.bundle"):
        assert (out / name).read_bytes() == (DATA / name).read_bytes(), name


def test_the_static_filters_drop_what_each_one_is_built_for(shipped) -> None:  # type: ignore[no-untyped-def]
    instances, repos = shipped
    filtered = static_filter(instances, repos)
    stages = [(s.name, s.kept, s.dropped) for s in filtered.stages]
    assert stages == [
        ("loaded", 28, 0),
        ("problem statement", 24, 4),
        ("a FAIL_TO_PASS test", 24, 0),
        ("problem branch", 21, 3),
        ("at most 200 tests", 19, 2),
    ]
    reasons = sorted(filtered.dropped.values())
    assert reasons.count("empty problem statement") == 4
    assert reasons.count("problem branch missing from minilib.bundle") == 3
    assert sorted(r for r in reasons if r.endswith(" tests")) == ["258 tests", "258 tests"]
    assert {i.instance_id for i in filtered.kept}.isdisjoint(filtered.dropped)
    kept_repos = {i.repo for i in filtered.kept}
    assert kept_repos == {"reins-swe/reins__minilib.0b4eb3cb"}
    assert all(i.fail_to_pass and i.tests == 39 for i in filtered.kept)


def test_an_instance_with_no_fail_to_pass_test_is_dropped(shipped) -> None:  # type: ignore[no-untyped-def]
    """Its reward was 1 for doing nothing."""
    instances, repos = shipped
    idle = Instance.from_record({**instances[0].fields, "FAIL_TO_PASS": []}, "t")
    filtered = static_filter([idle], repos)
    assert filtered.kept == []
    assert filtered.dropped == {idle.instance_id: "no FAIL_TO_PASS test"}


@pytest.mark.parametrize(
    ("paths", "says"),
    [
        ('"tests"', "test_paths is 'tests', not a list of paths"),
        ("null", "test_paths is None, not a list of paths"),
        ("[]", "test_paths is \\[\\], not a list of paths"),
        ('["/tests"]', "test path '/tests' is not a path inside the repository"),
        ('["../x"]', "test path '../x' is not a path inside the repository"),
        ('[""]', "test path '' is not a path inside the repository"),
        ("[3]", "test path 3 is not a path inside the repository"),
    ],
)
def test_test_paths_that_are_no_paths_inside_the_repository_are_refused(
    tmp_path: Path, paths: str, says: str
) -> None:
    """A string was read letter by letter, which left the tests editable (reward 1 for an
    edited runner); an absolute path failed every rollout."""
    (tmp_path / "repos.json").write_text(
        f'{{"r": {{"source": "x", "test_command": "pytest", "test_paths": {paths}}}}}'
    )
    with pytest.raises(InstanceError, match=says):
        load_repos(tmp_path / "repos.json")


def test_an_instance_of_a_repository_not_listed_is_dropped_with_the_reason(shipped) -> None:  # type: ignore[no-untyped-def]
    instances, repos = shipped
    stranger = Instance.from_record(
        {**instances[0].fields, "instance_id": "x__y.1", "repo": "x/y"}, "t"
    )
    filtered = static_filter([stranger], repos)
    assert filtered.kept == []
    assert filtered.dropped == {"x__y.1": "repository x/y is not in the repositories file"}


def test_a_branch_listing_reads_the_bundle(shipped) -> None:  # type: ignore[no-untyped-def]
    _, repos = shipped
    minilib = repos["reins-swe/reins__minilib.0b4eb3cb"]
    branches = minilib.branches()
    assert "main" in branches
    assert len(branches) == 1 + 26 - 3  # main, and every minilib bug but the three left out
    assert minilib.source == DATA / "minilib.bundle"
    assert minilib.test_paths == ("tests", "run_tests.py")


def test_instances_read_from_a_folder_of_jsonl_and_json_with_swe_bench_string_lists(
    tmp_path: Path,
) -> None:
    record = {"instance_id": "a", "repo": "r", "problem_statement": "p",
              "FAIL_TO_PASS": '["t::a"]', "PASS_TO_PASS": [], "extra": 1}  # fmt: skip
    (tmp_path / "one.jsonl").write_text(json.dumps(record) + "\n\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "two.json").write_text(json.dumps([{**record, "instance_id": "b"}]))
    (tmp_path / "repos.json").write_text("{}")  # beside the instances: not read as instances
    loaded = load_instances(tmp_path)
    assert [(i.instance_id, i.fail_to_pass, i.fields["extra"]) for i in loaded] == [
        ("a", ("t::a",), 1),
        ("b", ("t::a",), 1),
    ]


GOOD = '{"instance_id": "a", "repo": "r", "problem_statement": "", "PASS_TO_PASS": []'


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"instance_id": "a"}\n',
         "one.jsonl:1: the instance lacks repo, problem_statement, FAIL_TO_PASS, PASS_TO_PASS"),
        ("not json\n", "one.jsonl:1: not JSON"),
        (GOOD + ', "FAIL_TO_PASS": [1]}\n', "one.jsonl:1: FAIL_TO_PASS must be a list of test ids"),
        ((GOOD + ', "FAIL_TO_PASS": []}\n') * 2, "instance a appears twice"),
        ("[1]\n", "one.jsonl:1: an instance is a JSON object, not list"),
        # It becomes the gateway's rollout ids and the trainer's task ids: a `/` failed both.
        ('{"instance_id": "o/r.1", "repo": "r", "problem_statement": "", "PASS_TO_PASS": [], '
         '"FAIL_TO_PASS": []}\n', "one.jsonl:1: instance_id 'o/r.1' may hold only"),
    ],
)  # fmt: skip
def test_a_bad_instance_file_says_where(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "one.jsonl").write_text(content)
    with pytest.raises(InstanceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_instances(tmp_path / "one.jsonl")


def test_a_bad_repos_file_says_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "repos.json").write_text('{"r": {"source": "x.bundle"}}')
    with pytest.raises(InstanceError, match="r needs a `source` and a `test_command`"):
        load_repos(tmp_path / "repos.json")
    with pytest.raises(InstanceError, match="cannot read the repositories file"):
        load_repos(tmp_path / "absent.json")


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("bad.json", b'[{"instance_id": "a"', "bad.json: not JSON in UTF-8"),
        ("bad.jsonl", b'{"instance_id": "caf\xe9"}\n', "bad.jsonl: not JSON in UTF-8"),
    ],
)
def test_an_instance_file_that_is_not_json_in_utf8_is_named(
    tmp_path: Path, name: str, content: bytes, says: str
) -> None:
    """Both were tracebacks (JSONDecodeError, UnicodeDecodeError)."""
    (tmp_path / name).write_bytes(content)
    with pytest.raises(InstanceError, match=says):
        load_instances(tmp_path)
