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
        [sys.executable, "-m", "reins", "engine", "--model", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert f"--model {tmp_path / 'missing'} is not a folder" in result.stderr
    assert "Repo id" not in result.stderr and "Traceback" not in result.stderr
