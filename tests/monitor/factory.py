"""Rollouts and runs to look at: gateway content made through the real API (and the real proxy
against the stub engine), and a trainer-shaped metrics.jsonl."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import Gateway
from tests.stub_engine import encode, render_chat

SYSTEM = {"role": "system", "content": "You are a careful coding agent. Use the tools."}


def chat_call(
    messages: list[dict[str, Any]],
    reply: str,
    *,
    logprobs: list[float] | None = None,
    version: int = 3,
    status: int = 200,
    error: str | None = None,
) -> dict[str, Any]:
    """A `model_request` event as the proxy records it (stub tokenizer: UTF-8 bytes)."""
    prompt = encode(render_chat(messages))
    response = encode(reply) if status == 200 else []
    if logprobs is None and response:
        logprobs = [-0.05] * len(response)
    return {
        "type": "model_request",
        "data": {
            "prompt_token_ids": prompt if status == 200 else [],
            "response_token_ids": response,
            "response_logprobs": logprobs if status == 200 else None,
            "request": {"model": "policy", "messages": messages},
            "response": (
                {
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": reply},
                            "finish_reason": "stop",
                        }
                    ]
                }
                if status == 200
                else {}
            ),
            "model": "policy",
            "endpoint": "http://127.0.0.1:9/v1",
            "model_version": version,
            "latency_s": 0.42,
            "status": status,
            "finish_reason": "stop" if status == 200 else None,
            "error": error,
            "kind": "chat",
            "mode": "train",
            "stream": False,
            "choice_index": 0,
        },
    }


def declare(gateway: Gateway, specs: list[dict[str, Any]]) -> None:
    response = gateway.http.post("/api/rollouts", json=specs)
    assert response.status_code == 200, response.text


def post(gateway: Gateway, rollout_id: str, events: list[dict[str, Any]], attempt: int = 1) -> None:
    response = gateway.http.post(
        f"/api/rollouts/{rollout_id}/attempt/{attempt}/events", json=events
    )
    assert response.status_code == 200, response.text


def finish(
    gateway: Gateway, rollout_id: str, state: str = "succeeded", reason: str | None = None
) -> None:
    body = {"status": {"state": state, "reason": reason}}
    assert gateway.http.patch(f"/api/rollouts/{rollout_id}", json=body).status_code == 200


def agent_log(outcome: str = "succeeded", tail: str = "ran 3 tests: OK\n") -> dict[str, Any]:
    return {
        "type": "agent_log",
        "data": {
            "outcome": outcome,
            "exit_code": 0 if outcome == "succeeded" else 1,
            "path": "/var/log/reins/agent.log",
            "tail": tail,
        },
    }


def coding_rollout(gateway: Gateway, rollout_id: str = "fix-bug-1", *, run: str = "demo") -> None:
    """One rollout with every kind of boundary: merge, split (branch), split (unknown: the
    reply was reserialized), a retried call, a failed call, and reward, custom and log events."""
    declare(
        gateway,
        [
            {
                "rollout_id": rollout_id,
                "input": {"task": "fix the off-by-one in pagination", "repo": "acme/shop"},
                "group_id": "task-17",
                "metadata": {"run": run, "step": 4, "task": "task-17"},
            }
        ],
    )
    assert gateway.http.post(f"/api/rollouts/{rollout_id}/attempts").status_code == 200
    first = [SYSTEM, {"role": "user", "content": "The pager skips the last item. Fix it."}]
    reply1 = "Let me look at pager.py.\n<tool>cat pager.py</tool>"
    second = [
        *first,
        {"role": "assistant", "content": reply1},
        {"role": "user", "content": "def page(items, n):\n    return items[: n - 1]"},
    ]
    reply2 = "The slice drops one item. I will patch it."
    rng = random.Random(7)
    shaky = [math.log(rng.choice([0.97, 0.9, 0.6, 0.2, 0.04, 0.005])) for _ in encode(reply2)]
    third = [
        *second,
        {"role": "assistant", "content": reply2.upper()},
        {"role": "user", "content": "Patched. Run the tests?"},
    ]
    reply3 = "<tool>pytest -q</tool>"
    summary = [{"role": "user", "content": "Summarize what was changed in one line."}]
    post(
        gateway,
        rollout_id,
        [
            chat_call(first, reply1, version=3),
            chat_call(second, reply2, logprobs=shaky, version=3),
            {"type": "tool_result", "data": {"tool": "bash", "command": "sed -i ...", "exit": 0}},
            {
                "type": "tool",
                "data": {
                    "name": "run_shell",
                    "input": {"command": "curl -s https://example.com/pager.py"},
                    "output": "curl: (6) Could not resolve host: example.com",
                    "ok": False,
                    "seconds": 0.02,
                },
            },
            chat_call(third, reply3, version=4),
            chat_call(third, reply3, version=4),
            chat_call(summary, "", status=502, error="engine unreachable"),
            chat_call(summary, "Fixed the slice in page() to include the last item.", version=4),
            {"type": "reward", "data": {"value": 1.0, "source": "tests", "reason": "3 passed"}},
            agent_log("succeeded", "$ pytest -q\n...\n3 passed in 0.12s\n"),
        ],
    )
    finish(gateway, rollout_id)


def many_rollouts(gateway: Gateway, count: int, *, run: str = "demo", step: int = 1) -> list[str]:
    """`count` finished rollouts in groups of 4, rewards 0/1, each with one call."""
    ids = [f"{run}-s{step}-r{i:03d}" for i in range(count)]
    declare(
        gateway,
        [
            {
                "rollout_id": rid,
                "input": {"question": f"What is {i} + {i}?"},
                "group_id": f"{run}-g{i // 4}",
                "mode": "val" if i % 10 == 9 else "train",
                "metadata": {"run": run, "step": step, "task": f"q{i}"},
            }
            for i, rid in enumerate(ids)
        ],
    )
    for i, rid in enumerate(ids):
        gateway.http.post(f"/api/rollouts/{rid}/attempts")
        messages = [{"role": "user", "content": f"What is {i} + {i}?"}]
        events = [chat_call(messages, str(2 * i) if i % 3 else "I think 7.", version=step)]
        events.append({"type": "reward", "data": {"value": 0.0 if i % 3 == 0 else 1.0}})
        post(gateway, rid, events)
        finish(
            gateway,
            rid,
            "failed" if i % 7 == 6 else "succeeded",
            "agent crashed" if i % 7 == 6 else None,
        )
    return ids


def proxy_url(gateway: Gateway, rollout_id: str, attempt: int = 1, mode: str = "train") -> str:
    return f"{gateway.url}/proxy/rollout/{rollout_id}/attempt/{attempt}/mode/{mode}/openai/v1"


def proxied_rollout(gateway: Gateway, stub_url: str, rollout_id: str = "proxied-1") -> None:
    """A rollout whose calls went through the real proxy to the stub engine (the model is
    stubbed: UTF-8 byte tokens, fixed replies): two calls that merge, then a fresh conversation."""
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": stub_url})
    declare(
        gateway,
        [
            {
                "rollout_id": rollout_id,
                "input": {"task": "say hello twice"},
                "metadata": {"run": "demo", "step": 5},
            }
        ],
    )
    token = gateway.http.post(f"/api/rollouts/{rollout_id}/attempts").json()["token"]
    headers = {"Authorization": f"Bearer {token}"}
    url = proxy_url(gateway, rollout_id) + "/chat/completions"
    messages = [{"role": "user", "content": "Say hello."}]
    first = httpx.post(url, headers=headers, json={"messages": messages, "stub_reply": "Hello!"})
    assert first.status_code == 200, first.text
    messages += [
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again, with logprobs."},
    ]
    body = {"messages": messages, "stub_reply": "Hello again!", "logprobs": True, "stream": True}
    with httpx.stream("POST", url, headers=headers, json=body) as stream:
        assert stream.status_code == 200
        stream.read()
    fresh = {"messages": [{"role": "user", "content": "Unrelated: 2+2?"}], "stub_reply": "4"}
    assert httpx.post(url, headers=headers, json=fresh).status_code == 200
    post(gateway, rollout_id, [{"type": "reward", "data": {"value": 0.5, "source": "judge"}}])
    finish(gateway, rollout_id)


def write_run(runs_dir: Path, name: str = "demo", steps: int = 40) -> Path:
    """A run folder as the trainer writes it: metrics.jsonl (with a half-written last line) and
    config.yaml."""
    folder = runs_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    lines = []
    for step in range(1, steps + 1):
        reward = min(0.95, 0.2 + 0.018 * step + rng.uniform(-0.05, 0.05))
        row: dict[str, Any] = {
            "step": step,
            "time": 1_760_000_000 + 30 * step,
            "weight_version": step,
            "reward/mean": reward,
            "reward/std": 0.3 - 0.003 * step,
            "policy/entropy": 1.2 * math.exp(-step / 30) + 0.2,
            "policy/clip_fraction": 0.02 + rng.uniform(0, 0.01),
            "loss": -0.01 * reward,
            "samples/one_sample_rollout_ratio": 0.4 + rng.uniform(-0.05, 0.05),
            "samples/per_rollout": 2.4 + rng.uniform(-0.2, 0.2),
            "samples/split_reasons": {
                "retokenized": rng.randint(0, 4),
                "template": 2,
                "branch": rng.randint(3, 8),
                "unknown": 0,
            },
            "rollouts/failed": rng.randint(0, 2),
            "time/rollout": 20 + rng.uniform(-3, 3),
            "time/wait": 2.0,
            "time/update": 6 + rng.uniform(-1, 1),
            "time/publish": 1.0,
            "time/step": 30.0,
            "my_custom/accuracy": reward * 0.9,
        }
        if step % 10 == 0:
            row["val/reward_mean"] = reward - 0.05
        lines.append(json.dumps(row))
    text = "\n".join(lines) + '\n{"step": 41, "reward/me'
    (folder / "metrics.jsonl").write_text(text)
    (folder / "config.yaml").write_text("model: SmolLM2-135M-Instruct\nlr: 1.0e-6\ngroup_size: 4\n")
    return folder
