"""The peak memory a training step reports (`reins.trainer.memory.peak_rss_mb`), measured in a
fresh process: the peak is the whole process's. The module is loaded from its file (stdlib
only), not through `reins.trainer`, which imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reins.trainer.memory import peak_rss_mb

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")

MODULE = Path(__file__).resolve().parents[2] / "src" / "reins" / "trainer" / "memory.py"
PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("memory", sys.argv[1])
memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)

def high_water_mb():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024

before = (memory.peak_rss_mb(), high_water_mb())
block = bytearray(300 * 2**20)
block[::4096] = b"\\1" * len(block[::4096])  # resident only once touched
after = (memory.peak_rss_mb(), high_water_mb())
print(json.dumps({"before": before, "after": after}))
"""


def test_peak_rss_is_this_process_own_and_grows_with_an_allocation() -> None:
    """The probe starts small (~15 MB) from this larger process: `ru_maxrss` would start at
    this process's size, inherited at fork."""
    parent = peak_rss_mb()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(MODULE)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    (before, before_kernel), (after, after_kernel) = result["before"], result["after"]
    assert before == pytest.approx(before_kernel, abs=1)
    assert before < 100 < parent
    assert after == pytest.approx(after_kernel, abs=1)
    assert after - before == pytest.approx(300, abs=15)  # the block, and little else
