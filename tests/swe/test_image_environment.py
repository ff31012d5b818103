"""The task image's environment in the coding example's sandboxes (SWE_SANDBOX_MOUNTS and
SWE_SANDBOX_PATH, what a SWE-smith image's conda environment needs): the agent's commands and
the tests' run both find the mounted folder's programs first on their PATH. A stand-in for the
environment: a folder with a `python3` that runs the host's and says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.swe.agent import play
from reins.swe.environment import SandboxEnvironment
from reins.swe.instances import Instance, RepoSource
from tests.swe.conftest import by_id, needs_sandbox


def test_the_agent_and_the_tests_run_with_the_images_environment(
    shipped: tuple[list[Instance], dict[str, RepoSource]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    needs_sandbox()
    env = tmp_path / "conda" / "envs" / "testbed" / "bin"
    env.mkdir(parents=True)
    python = env / "python3"
    python.write_text(
        '#!/bin/sh\n/usr/bin/python3 "$@"\ncode=$?\necho "(the image\'s python3)"\nexit $code\n'
    )
    python.chmod(0o755)
    monkeypatch.setenv("SWE_SANDBOX_MOUNTS", str(tmp_path / "conda"))
    monkeypatch.setenv("SWE_SANDBOX_PATH", f"{env}:/usr/bin:/bin")
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    seen: list[str] = []

    def run_agent(environment: SandboxEnvironment) -> str:
        seen.append(
            environment.execute({"command": "command -v python3; python3 -c 'print(6*7)'"})[
                "output"
            ]
        )
        environment.execute(
            {"command": "sed -i 's/elif out:/elif out and out[-1] != \"-\":/' minilib/text.py"}
        )
        return "Submitted"

    episode = play(instance, repos[instance.repo], run_agent)
    assert seen == [f"{python}\n42\n(the image's python3)\n"]
    assert episode.report is not None and episode.report.reward == 1.0
    assert episode.report.log_tail.rstrip().endswith("(the image's python3)")
