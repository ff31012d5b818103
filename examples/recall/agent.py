"""A two-call harness on the plain `openai` SDK: the model is told a secret word, then asked for it.

It is an ordinary agent: it reads `OPENAI_BASE_URL` / `OPENAI_API_KEY` (the controller points them
at the gateway's proxy for this rollout) and knows nothing of reins but `report_reward`.
Reward (verifiable), recall first and form second: 1 when the second answer is exactly the word;
0.5 when it names the word (as a word of its own: "environment" does not name "iron") in a longer
answer, less 0.02 per extra word (at least 0.3: "The secret word is vapor." 0.42), so that shorter
answers stay better within a group; 0 when the word is missing; plus 0.1 when the first answer is
exactly "OK"; at most 1.
"""

from __future__ import annotations

import re
from typing import Any

from openai import OpenAI

MODEL = "policy"  # the gateway routes every name to the model being trained


def score(word: str, first: str, second: str) -> float:
    def normalize(text: str) -> str:
        return re.sub(r"[^a-z]", "", text.lower())

    answer = normalize(second)
    if answer == word:
        reward = 1.0
    elif word in re.findall(r"[a-z]+", second.lower()):  # "environment" does not name "iron"
        reward = max(0.3, 0.5 - 0.02 * (len(second.split()) - 1))
    else:
        reward = 0.0
    if normalize(first) == "ok":
        reward += 0.1
    return min(reward, 1.0)


def converse(client: OpenAI, word: str, max_tokens: int = 16) -> tuple[str, str]:
    messages: list[Any] = [
        {"role": "user", "content": f"Remember this secret word: {word}. Reply with just OK."}
    ]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)
    first_text = first.choices[0].message.content or ""
    messages += [
        {"role": "assistant", "content": first_text},
        {"role": "user", "content": "What is the secret word? Reply with the word only."},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)
    return first_text, second.choices[0].message.content or ""


def run(task: dict[str, Any]) -> float:
    """The agent the controller runs: returns the reward (reported as a `reward` event)."""
    client = OpenAI(max_retries=5, timeout=600)
    first, second = converse(client, task["word"])
    return score(task["word"], first, second)
