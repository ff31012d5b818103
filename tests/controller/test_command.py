"""`reins controller` as a user runs it: what it refuses before it starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.controller.conftest import ROOT
from tests.support import free_port


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-attempts", "0", "--max-attempts must be at least 1, not 0"),
        ("--max-parallel", "-1", "--max-parallel must be at least 1, not -1"),
    ],
)
def test_a_count_below_one_is_refused_before_the_gateway_is_tried(
    flag: str, value: str, message: str, tmp_path: Path
) -> None:
    """`--max-attempts 0` was refused only after the controller had made its log folder and
    tried the gateway (`the gateway ... does not answer yet; retrying`, then the refusal)."""
    log_dir = tmp_path / "logs"
    done = subprocess.run(
        [
            sys.executable, "-m", "reins.cli", "controller", "--runner", "local",
            "--gateway", f"http://127.0.0.1:{free_port()}", "--api-key", "key",
            "--agent", "tests.controller.agents:succeed", "--log-dir", str(log_dir),
            flag, value,
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr, done.stderr[-2000:]
    assert "does not answer" not in done.stderr, done.stderr[-2000:]
    assert not log_dir.exists()
