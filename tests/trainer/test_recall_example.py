"""The main job's reward (examples/recall): the right word, then fewer words; "OK" adds 0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.recall.agent import score

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("first", "second", "reward"),
    [
        ("OK", "vapor", 1.0),
        ("OK.", "Vapor.", 1.0),
        ("Sure!", "vapor", 1.0),
        ("Sure!", "Word: vapor", 0.48),
        ("OK", "Word: vapor", 0.58),
        ("Sure!", "The word is vapor.", 0.44),
        ("Sure!", "The secret word is vapor.", 0.42),
        ("Sure!", "It is vapor, or maybe cloud, mist, steam, fog, haze or smoke.", 0.3),
        ("OK", "cloud", 0.1),
        ("Sure!", "", 0.0),
    ],
)
def test_reward(first: str, second: str, reward: float) -> None:
    assert score("vapor", first, second) == pytest.approx(reward)


def test_validation_words_are_not_training_words() -> None:
    def words(name: str) -> set[str]:
        lines = (ROOT / "examples/recall" / name).read_text().splitlines()
        return {json.loads(line)["input"]["word"] for line in lines if line.strip()}

    assert words("train.jsonl").isdisjoint(words("val.jsonl"))
