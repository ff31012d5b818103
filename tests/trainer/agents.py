"""Agents for the trainer's end-to-end tests: real `openai` SDK harnesses, two calls each."""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

from openai import OpenAI


def two_calls(task: dict[str, Any]) -> float:
    """Two chat calls (the second extends the first's conversation); between them it waits until
    the file `wait_for` exists, if set (at most 300 s); `crash: true` makes the agent fail;
    `silent: true` makes no call."""
    if task.get("crash"):
        raise RuntimeError("this task always crashes")
    if task.get("silent"):
        return 0.25  # rewarded without a call: nothing to train
    client = OpenAI(max_retries=5, timeout=300)
    messages: list[Any] = [{"role": "user", "content": f"Say {task['word']}."}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    if task.get("wait_for"):
        deadline = time.monotonic() + 300
        while not os.path.exists(task["wait_for"]) and time.monotonic() < deadline:
            time.sleep(0.1)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Again."},
    ]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    text = (first.choices[0].message.content or "") + (second.choices[0].message.content or "")
    # A reward that differs whenever the two texts differ, so a group's advantages are zero only
    # when its samples are identical (a reward with few values left whole steps without a
    # gradient by chance: the resume test's logprob-gap check then had nothing to check).
    return (zlib.crc32(text.encode()) % 1001) / 1000


def no_reward(task: dict[str, Any]) -> float | None:
    """`two_calls`, but it reports no reward (it exits 0 without one) unless the task says
    `rewarded: true`."""
    reward = two_calls(task)
    return reward if task.get("rewarded") else None


def same_reward(task: dict[str, Any]) -> float:
    """`two_calls` rewarded 0.5 whatever it said: every advantage is 0, no weight moves."""
    two_calls(task)
    return 0.5
