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
        ("--log-max-bytes", "1000", "--log-max-bytes must be at least 16384"),
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


def test_the_log_cap_reaches_the_local_reconciler(tmp_path: Path) -> None:
    from reins.controller.command import ControllerOptions, build_reconciler
    from reins.controller.local import LOG_MAX_BYTES, LocalReconciler

    def built(**cap: int) -> int:
        options = ControllerOptions(
            "local", "http://127.0.0.1:1", "key", "tests.controller.agents:succeed", 1,
            log_dir=tmp_path, **cap,
        )  # fmt: skip
        reconciler = build_reconciler(options)
        assert isinstance(reconciler, LocalReconciler)
        return reconciler.log_max_bytes

    assert built(log_max_bytes=20_000) == 20_000
    assert built() == LOG_MAX_BYTES
