"""A model path that is no model folder is refused saying so (transformers took a missing folder
for a hub id and answered about repo id syntax, and a folder without a model with advice about
tokenizer packages)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from reins.engine.embedded import EmbeddedEngine


def test_a_missing_folder_or_one_without_a_model_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--model .*missing is not a folder: name a Hugging"):
        EmbeddedEngine.load(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"is not a Hugging Face model folder \(it has no config"):
        EmbeddedEngine.load(tmp_path)


def test_reins_engine_says_it_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        # Port 0: the port is checked first, and another engine on the default 8000 failed it.
        [
            sys.executable,
            "-m",
            "reins",
            "engine",
            "--port",
            "0",
            "--model",
            str(tmp_path / "missing"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert f"--model {tmp_path / 'missing'} is not a folder" in result.stderr
    assert "Repo id" not in result.stderr and "Traceback" not in result.stderr


def test_a_prepared_folder_is_readable_as_the_umask_allows_without_setting_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors writes its files 0600 (another account's engine could not read them): they
    get the mode a plain open would. The umask is read, not set: `os.umask(0)` and back left any
    file another thread created meanwhile world-writable."""
    import os

    from reins.engine import prepare

    umask = os.umask(0o027)
    try:
        weights = tmp_path / "model.safetensors"
        weights.write_bytes(b"weights")
        weights.chmod(0o600)
        set_to: list[int] = []
        monkeypatch.setattr(os, "umask", lambda mask: set_to.append(mask) or 0o027)
        prepare._make_durable(tmp_path)
        monkeypatch.undo()
    finally:
        os.umask(umask)
    assert set_to == []
    assert (weights.stat().st_mode & 0o777, tmp_path.stat().st_mode & 0o777) == (0o640, 0o750)
