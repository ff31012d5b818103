"""Fixtures of the examples' training tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the default model's tokenizer (tests/trainer/conftest.py)."""
    from tests.trainer.conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama")
