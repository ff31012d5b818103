"""`reins doctor anthropic-messages`: the Anthropic SDK's Messages API (ANTHROPIC_BASE_URL, the
key as `x-api-key`), each answer's content blocks sent back as the assistant turn."""

from __future__ import annotations

from typing import Any

from reins.doctor.harnesses import task


def main() -> None:
    anthropic = task.require("anthropic", "anthropic")
    client = anthropic.Anthropic(
        base_url=task.env("ANTHROPIC_BASE_URL"),
        api_key=task.env("ANTHROPIC_API_KEY"),
        timeout=task.TIMEOUT_S,
        max_retries=0,
    )
    messages = task.messages_history()
    for number in range(task.turns()):
        answer = client.messages.create(
            model=task.MODEL,
            messages=messages,
            tools=[task.MESSAGES_TOOL],
            max_tokens=task.MAX_TOKENS,
            extra_body={"temperature": 0},
        )
        blocks: list[dict[str, Any]] = [block.model_dump() for block in answer.content]
        messages.append({"role": "assistant", "content": blocks})
        uses = [block for block in blocks if block["type"] == "tool_use"]
        if uses:
            results = [
                {"type": "tool_result", "tool_use_id": use["id"], "content": task.TOOL_RESULT}
                for use in uses
            ]
            messages.append({"role": "user", "content": results})
        else:
            messages.append({"role": "user", "content": task.follow_up(number)})
        print(f"call {number + 1}: {blocks}", flush=True)


if __name__ == "__main__":
    main()
