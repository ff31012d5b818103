"""`reins doctor openai-agents`: the OpenAI Agents SDK's default model (the Responses API) with a
function tool, tracing off (it would send traces to OpenAI). The few-shot history goes in as
Responses input items; each further question is a new run on `to_input_list()`. The SDK fails
a run whose response is `incomplete` (max tokens reached): the answers get room to end, and a
run that reaches it all the same ends the driver with its calls so far (exit 0)."""

from __future__ import annotations

from typing import Any

from reins.doctor.harnesses import task


def main() -> None:
    agents = task.require("agents", "openai-agents")
    openai = task.require("openai", "openai")
    task.env("OPENAI_BASE_URL")
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(
        openai.AsyncOpenAI(timeout=task.TIMEOUT_S, max_retries=0), use_for_tracing=False
    )
    agents.set_default_openai_api("responses")

    def get_weather(city: str) -> str:
        """The current weather in a city"""
        return task.TOOL_RESULT

    agent = agents.Agent(
        name="assistant",
        instructions="You answer in one sentence. Use get_weather for the weather.",
        model=task.MODEL,
        tools=[agents.function_tool(get_weather)],
        model_settings=agents.ModelSettings(max_tokens=96, temperature=0),
    )
    items: list[Any] = task.responses_history()
    runs = max(1, task.turns() // 2)
    for number in range(runs):
        try:
            result = agents.Runner.run_sync(agent, items, max_turns=4)
        except agents.exceptions.ModelBehaviorError as error:
            if "max_output_tokens" not in str(error):
                raise
            # Sampled at temperature 1 (`--mode train`) the model may ramble past the limit:
            # the SDK fails the run, whose calls so far are checked all the same.
            print(f"run {number + 1} ended at max_tokens ({error})", flush=True)
            return
        print(f"run {number + 1}: {result.final_output!r}", flush=True)
        items = [*result.to_input_list(), {"role": "user", "content": task.follow_up(number)}]


if __name__ == "__main__":
    main()
