"""Token text from the policy's tokenizer (the default model's, from `reins model prepare`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reins.engine.prepare import default_model_dir
from reins.monitor import tokens
from reins.monitor.rollout import attempt_view
from tests import required
from tests.monitor.factory import chat_call
from tests.monitor.test_rollout_view import events


@pytest.fixture(scope="module")
def text() -> tokens.TokenText:
    folder = default_model_dir()
    if not (folder / "tokenizer.json").exists():
        required.missing(f"no tokenizer at {folder}: run `reins model prepare` (make test does)")
    required.module("transformers", "the train extra is not installed: pip install -e '.[dev]'")
    return tokens.load(str(folder))


def test_token_texts_join_back_into_the_text(text: tokens.TokenText) -> None:
    ids = text.tokenizer.encode("Hello world, again.")
    assert "".join(text.texts(ids)) == "Hello world, again."
    assert text.decode(np.asarray(ids, dtype=np.int32)) == "Hello world, again."


def test_with_a_tokenizer_the_page_shows_token_text_and_text_reasons(
    text: tokens.TokenText,
) -> None:
    first = chat_call([{"role": "user", "content": "hi"}], "x")
    first["data"]["prompt_token_ids"] = text.tokenizer.encode("<|im_start|>user\nhi")
    first["data"]["response_token_ids"] = text.tokenizer.encode(" having")
    first["data"]["response_logprobs"] = [-0.1] * len(first["data"]["response_token_ids"])
    second = chat_call([{"role": "user", "content": "hi"}], "y")
    # The same text, tokenized otherwise: " h" + "aving" (paper figure 3).
    second["data"]["prompt_token_ids"] = (
        first["data"]["prompt_token_ids"]
        + text.tokenizer.encode(" h")
        + text.tokenizer.encode("aving")
        + text.tokenizer.encode(" fun")
    )
    view = attempt_view("r", 1, events(first, second), decode=text.decode, token_texts=text.texts)
    assert view.calls[1].boundary.reason == "retokenized"
    assert "".join(t.text for t in view.calls[0].tokens) == " having"


def test_a_missing_tokenizer_folder_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(tokens.TokenizerError, match="is not a folder"):
        tokens.load(str(tmp_path / "nope"))
