"""`reins doctor litellm`: `litellm.completion` with the `openai/` provider (as mini-swe-agent and
many agents call it), the price table read from the package (no download at import)."""

from __future__ import annotations

import os
from typing import Any

from reins.doctor.harnesses import task


def main() -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = task.require("litellm", "litellm")
    common: dict[str, Any] = {
        "model": f"openai/{task.MODEL}",
        "api_base": task.env("OPENAI_BASE_URL"),
        "api_key": task.env("OPENAI_API_KEY"),
        "tools": [task.CHAT_TOOL],
        "max_tokens": task.MAX_TOKENS,
        "temperature": 0,
        "timeout": task.TIMEOUT_S,
        "num_retries": 0,
    }
    messages = task.chat_history()
    for number in range(task.turns()):
        answer = litellm.completion(messages=messages, **common)
        message: dict[str, Any] = answer.choices[0].message.model_dump(exclude_none=True)
        message = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
        messages.append(message)
        messages += task.chat_next(message, number)
        print(f"call {number + 1}: {message}", flush=True)


if __name__ == "__main__":
    main()
