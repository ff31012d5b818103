"""`reins doctor openai-responses`: the `openai` SDK's Responses API (`store=False`, the whole
input sent each time, the output items appended as the SDK returned them)."""

from __future__ import annotations

from typing import Any

from reins.doctor.harnesses import task


def main() -> None:
    openai = task.require("openai", "openai")
    task.env("OPENAI_BASE_URL")
    client = openai.OpenAI(timeout=task.TIMEOUT_S, max_retries=0)
    items = task.responses_history()
    for number in range(task.turns()):
        response = client.responses.create(
            model=task.MODEL,
            input=items,
            tools=[task.RESPONSES_TOOL],
            temperature=0,
            max_output_tokens=task.MAX_TOKENS,
            store=False,
        )
        output: list[dict[str, Any]] = [i.model_dump(exclude_none=True) for i in response.output]
        items += output
        calls = [item for item in output if item.get("type") == "function_call"]
        for call in calls:
            items.append(
                {"type": "function_call_output", "call_id": call["call_id"],
                 "output": task.TOOL_RESULT}
            )  # fmt: skip
        if not calls:
            items.append({"role": "user", "content": task.follow_up(number)})
        print(f"call {number + 1}: {output}", flush=True)


if __name__ == "__main__":
    main()
