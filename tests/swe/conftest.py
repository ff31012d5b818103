from __future__ import annotations

from pathlib import Path

import pytest

from reins.sandbox import sandbox_problem
from reins.swe.instances import Instance, RepoSource, load_instances, load_repos
from tests.required import missing

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "swe" / "data"


def needs_sandbox() -> None:
    problem = sandbox_problem()
    if problem:
        missing(problem)


@pytest.fixture(scope="session")
def shipped() -> tuple[list[Instance], dict[str, RepoSource]]:
    return load_instances(DATA / "instances.jsonl"), load_repos(DATA / "repos.json")


def by_id(instances: list[Instance], suffix: str) -> Instance:
    (found,) = [i for i in instances if i.instance_id.endswith(suffix)]
    return found


# The controller tests' gateway and client fixtures, for the safeguard tests.
from tests.controller.conftest import client, gateway_url  # noqa: E402, F401
