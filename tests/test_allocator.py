"""glibc's mmap threshold (`reins.allocator`), measured in fresh processes: the setting is the
whole process's. The module is loaded from its file (stdlib only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from reins import allocator
from reins.trainer import runtime
from reins.trainer.config import TrainConfig

MODULE = Path(__file__).resolve().parents[1] / "src" / "reins" / "allocator.py"
PROBE = """
import ctypes, importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 2**20

def rss_mb():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE / MB

def touched(size):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    return block

was_set = allocator.map_large_blocks(1) if sys.argv[2] == "set" else None
# A large block freed, as a step's logits are: glibc's dynamic threshold rises to its size.
libc.free(touched(16 * MB))
base = rss_mb()
blocks, pins = [], []
for _ in range(50):
    blocks.append(touched(2 * MB))
    pins.append(touched(MB // 4))  # stays: the heap cannot shrink past it
held = rss_mb() - base
for block in blocks:
    libc.free(block)
print(json.dumps({"was_set": was_set, "held": held, "kept": rss_mb() - base}))
"""


def probe(mode: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(MODULE), mode],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},  # no MALLOC_* setting of this process's environment
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.skipif(allocator._glibc() is None, reason="glibc's allocator only")
def test_a_fixed_threshold_hands_freed_large_blocks_back_where_glibc_keeps_them() -> None:
    default, fixed = probe("default"), probe("set")
    assert fixed["was_set"] is True
    # 50 blocks of 2 MB, each followed by 256 KB that stay allocated (12.5 MB)
    assert default["held"] == pytest.approx(112.5, abs=8)
    assert fixed["held"] == pytest.approx(112.5, abs=8)
    assert default["kept"] == pytest.approx(112.5, abs=8)  # glibc keeps the freed blocks
    assert fixed["kept"] == pytest.approx(12.5, abs=4)


@pytest.mark.parametrize(
    "name,value",
    [
        ("MALLOC_MMAP_THRESHOLD_", "131072"),
        ("MALLOC_TRIM_THRESHOLD_", "0"),
        ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536"),
    ],
)
def test_the_users_own_allocator_setting_wins(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    assert allocator.map_large_blocks(1) is False


def test_a_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be positive, not 0 MB"):
        allocator.map_large_blocks(0)


@pytest.mark.parametrize("threshold,calls", [(None, []), (1.0, [1.0]), (4.5, [4.5])])
def test_the_trainer_sets_the_configured_threshold(
    monkeypatch: pytest.MonkeyPatch, threshold: float | None, calls: list[float]
) -> None:
    seen: list[float] = []
    monkeypatch.setattr(allocator, "map_large_blocks", lambda mb: seen.append(mb) or True)
    config = TrainConfig.model_validate(
        {"tasks": "tasks.jsonl", "agent": "true", "malloc_mmap_threshold_mb": threshold}
    )
    runtime.configure_allocator(config)
    assert seen == calls


def test_the_default_threshold_is_one_mb() -> None:
    config = TrainConfig.model_validate({"tasks": "tasks.jsonl", "agent": "true"})
    assert config.malloc_mmap_threshold_mb == 1.0


def test_the_train_command_sets_the_allocator_before_training(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`reins train` owns its process: it applies the setting, then trains; `runtime.train()`
    itself (a library call, as here in pytest) leaves the caller's allocator alone."""
    from reins import cli

    order: list[str] = []
    monkeypatch.setattr(allocator, "map_large_blocks", lambda mb: order.append(f"set {mb}"))

    async def train(config: TrainConfig, **_: Any) -> list[dict[str, Any]]:
        order.append("train")
        return []

    monkeypatch.setattr(runtime, "train", train)
    config = TrainConfig.model_validate(
        {"tasks": "tasks.jsonl", "agent": "true", "runs_dir": str(tmp_path)}
    )
    cli._run_training(config, resume=False, resume_command="reins train c.yaml --resume")
    assert order == ["set 1.0", "train"]
