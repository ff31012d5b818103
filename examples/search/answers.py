"""Search-R1's (and SQuAD's) answer normalisation and exact match: the agent's reward, and the
converter's check that a golden answer can be matched at all."""

from __future__ import annotations

import re
import string


def normalize(text: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the as whole words), single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(answer: str, golden: list[str]) -> float:
    """1.0 when the normalised answer is a normalised golden answer. Nothing matches an answer
    that normalises to nothing: a golden "..." or "The The" made `<answer></answer>` score 1."""
    normalized = normalize(answer)
    return 1.0 if normalized and normalized in {normalize(g) for g in golden} else 0.0
