"""A tiny randomly initialised Llama with the default model's real tokenizer and chat template:
loads in milliseconds, so trainer tests run the real code paths quickly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import default_tokenizer, tiny_llama


def make_tiny_model(folder: Path, seed: int = 0, initializer_range: float = 0.02) -> Path:
    """The tiny model (`tests.tiny_model`, the tokenizer's bos and padding ids) and its
    tokenizer, saved in `folder` as a model folder `reins train` loads."""
    tokenizer = default_tokenizer()
    model = tiny_llama(tokenizer, seed=seed, initializer_range=initializer_range)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama")
