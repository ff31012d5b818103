"""`SandboxEnvironment.execute`, mini-swe-agent's environment, on the real sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from reins.sandbox import Sandbox, SandboxLimits
from reins.swe.environment import SandboxEnvironment
from tests.required import missing
from tests.swe.conftest import needs_sandbox

LIMITS = SandboxLimits(wall_s=10, cpu_s=2, memory_mb=256, processes=32)


@pytest.mark.parametrize("name", ["it's $HOME", "tab\there", "plain"])
def test_a_cwd_is_quoted_for_the_shell(tmp_path: Path, name: str) -> None:
    """The cwd was quoted with Python's repr: `it's $HOME` became `"it's $HOME"`, in which
    bash expanded `$HOME`, and a tab became the two characters `\\t`: the `cd` failed."""
    needs_sandbox()
    (tmp_path / "work" / name).mkdir(parents=True)
    with Sandbox(tmp_path / "work", LIMITS) as box:
        output = SandboxEnvironment(box).execute({"command": "pwd"}, cwd=f"/work/{name}")
    assert output["returncode"] == 0, output
    assert output["output"] == f"/work/{name}\n"


def test_a_child_ended_by_the_memory_limit_keeps_the_commands_own_code(tmp_path: Path) -> None:
    """The command ran on after the kernel ended its child: its own code reaches the model,
    with what the limit did."""
    needs_sandbox()
    with Sandbox(tmp_path / "work", LIMITS) as box:
        if box._cgroups is None:
            missing("no writable cgroup (v1 memory and pids, or v2): run as root on Linux")
        hog = "python3 -c 'data = b\"x\" * (2 * 1024**3)'"
        output = SandboxEnvironment(box).execute({"command": f"{hog}; echo after"})
    assert output["returncode"] == 0
    assert output["exception_info"] == "the command ran on after reaching the memory limit"
