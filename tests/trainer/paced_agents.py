"""Agents for the crash and timing tests: three chat calls with a pause between them (a harness
that thinks), so rollouts are still in flight when the trainer updates or is killed."""

from __future__ import annotations

import os
import time
from typing import Any

from openai import OpenAI


def paced(task: dict[str, Any]) -> float:
    client = OpenAI(max_retries=5, timeout=300)
    messages: list[Any] = [{"role": "user", "content": f"Say {task['word']}."}]
    text = ""
    for _ in range(3):
        answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        content = answer.choices[0].message.content or ""
        text += content
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": "Again."},
        ]
        time.sleep(float(task.get("pause_s", 0.5)))
    return float(len(text) % 3) / 2


def one_slow(task: dict[str, Any]) -> float:
    """`paced`, but each group's rollout 1 pauses `slow_pause_s`: a straggler in every group."""
    if os.environ["REINS_ROLLOUT_ID"].endswith(".1"):
        task = {**task, "pause_s": task["slow_pause_s"]}
    return paced(task)


def stuck(task: dict[str, Any]) -> float:
    """Starts a child process, writes its own pid and the child's to `<pid_dir>/<rollout id>`,
    then never ends: an agent in flight, with a child of its own, whenever the trainer stops."""
    import subprocess

    child = subprocess.Popen(["sleep", "600"])
    # Written under a hidden name, then renamed: a reader globbing `<run>.*` sees whole records.
    pid_file = os.path.join(task["pid_dir"], os.environ["REINS_ROLLOUT_ID"])
    partial = os.path.join(task["pid_dir"], "." + os.environ["REINS_ROLLOUT_ID"])
    with open(partial, "w") as out:
        out.write(f"{os.getpid()} {child.pid}")
    os.replace(partial, pid_file)
    time.sleep(600)
    return 0.0
