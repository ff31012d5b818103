"""A Search-R1-style search agent on the plain `openai` SDK (paper section 4.1).

The model searches with `<search>query</search>`, reads the top passages the harness returns as a
user turn `<information>...</information>`, and ends with `<answer>...</answer>`; at most
MAX_TURNS model calls. A reply with neither tag gets Search-R1's kind of reminder and another
turn (ending there would give a 135M model's many untagged first replies no second chance, and
the reminder costs one turn of the same budget). The history is append-only and each assistant
message goes back exactly as the model wrote it (no stop strings, no trimming), so a rollout is
one growing conversation: one training sequence in reins' token-exact capture.

Reward: Search-R1's exact match (lowercase, no punctuation or articles, single spaces) of the
answer against any golden answer, 1 or 0; reported with `report_reward` along with the number
of searches, whether it answered, and the turns taken. Each search is a `tool` event.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

from examples.search import retrieval  # light: bm25s and numpy load at the first search
from examples.search.answers import exact_match, normalize  # noqa: F401 (the tests')
from reins.agent import report_reward, report_tool

MODEL = "policy"  # the gateway routes every name to the model being trained
MAX_TURNS = 4
MAX_TOKENS = 64
TOP_K = 3

SYSTEM = (
    "You answer questions with the help of a search engine. To search, reply with "
    "<search>query</search>; the search engine then returns results between <information> and "
    "</information>. Never write <information> yourself. You may search again if the results "
    "are not enough. When you know the answer, reply with <answer>answer</answer>, where the "
    "answer is only a short name, place or year, not a sentence."
)
# One worked example as chat turns; its names cannot come out of make_data.py (no "q" onset).
EXAMPLE = [
    {"role": "user", "content": "Question: Who founded Quillon Press?"},
    {"role": "assistant", "content": "<search>Quillon Press founder</search>"},
    {
        "role": "user",
        "content": "<information>Doc 1(Title: Quillon Press) Quillon Press is a maker of maps, "
        "founded in 1902 by Yvette Carrow. Its headquarters are in Ashby.\n"
        "Doc 2(Title: Quillon Works) Quillon Works is a maker of soap, founded in 1875 by "
        "Quentin Marsh. Its headquarters are in Oakmere.</information>",
    },
    {"role": "assistant", "content": "<answer>Yvette Carrow</answer>"},
]
REMINDER = (
    "Your reply had neither <search>query</search> nor <answer>answer</answer>, and only the "
    "search engine writes <information>. Search or answer in that form."
)
_TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def parse(reply: str) -> tuple[str, str] | None:
    """The reply's first complete `<search>` or `<answer>` tag as (kind, stripped text)."""
    match = _TAG.search(reply)
    return (match.group(1), match.group(2).strip()) if match else None


def corpus_path(task: dict[str, Any]) -> Path | None:
    """The task's corpus, else env REINS_SEARCH_CORPUS, else None (the example's own)."""
    chosen = task.get("corpus") or os.environ.get("REINS_SEARCH_CORPUS")
    return Path(chosen) if chosen else None


def run(task: dict[str, Any]) -> None:
    """The agent the controller runs; reports its own reward (so returns None)."""
    golden = task["golden_answers"]
    if not isinstance(golden, list) or not all(isinstance(g, str) for g in golden):
        # A string was read letter by letter: "D" matched the golden "Dreipolm".
        raise ValueError(f"the task's golden_answers is {golden!r}, not a list of strings")
    corpus = corpus_path(task) or retrieval.DEFAULT_CORPUS
    client = OpenAI(max_retries=5, timeout=600)
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        *EXAMPLE,
        {"role": "user", "content": f"Question: {task['question']}"},
    ]
    searches, turns, answer = 0, 0, None
    while turns < MAX_TURNS:
        response = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS
        )
        reply = response.choices[0].message.content or ""
        turns += 1
        messages.append({"role": "assistant", "content": reply})
        action = parse(reply)
        if action is not None and action[0] == "answer":
            answer = action[1]
            break
        if turns == MAX_TURNS:
            break  # no call would read the results
        if action is None:
            messages.append({"role": "user", "content": REMINDER})
            continue
        started = time.perf_counter()
        passages = retrieval.format_passages(retrieval.search(action[1], TOP_K, corpus))
        seconds = time.perf_counter() - started
        searches += 1
        report_tool("search", action[1], passages, seconds=seconds)
        messages.append({"role": "user", "content": f"<information>{passages}</information>"})
    reward = exact_match(answer, golden) if answer is not None else 0.0
    reason = (
        f"answer {answer!r}, golden {golden}"
        if answer is not None
        else f"no answer in {MAX_TURNS} turns"
    )
    report_reward(
        reward,
        reason=reason,
        metrics={"searches": searches, "answered": float(answer is not None), "turns": turns},
    )
