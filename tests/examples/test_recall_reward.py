"""The main job's reward (examples/recall) on answers that hold the word's letters but not the
word: a wrong guess that contains it is no recall."""

from __future__ import annotations

import pytest

from examples.recall.agent import score


@pytest.mark.parametrize(
    ("word", "second", "reward"),
    [
        ("iron", "environment", 0.0),  # was 0.5: "iron" is in "envIRONment"
        ("iron", "The word is environment.", 0.0),
        ("raven", "Ravenous.", 0.0),
        ("panda", "Expand a bit?", 0.0),  # the letters run across two words
        ("iron", "The word is iron.", 0.44),  # named as a word of its own: as before
        ("iron", "IRON!", 1.0),
        ("iron", "iron, I think", 0.46),
    ],
)
def test_only_the_word_itself_counts_as_naming_it(word: str, second: str, reward: float) -> None:
    assert score(word, "Sure!", second) == pytest.approx(reward)
