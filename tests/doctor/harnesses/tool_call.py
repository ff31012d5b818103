"""A tool-using harness: the openai client offers a weather tool, runs the call the model makes
and sends the result back (greedy; a few-shot history in which the assistant always called the
tool makes the default 135M model call it too)."""

import json

import openai

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def asked(city: str, call_id: str) -> list[dict[str, object]]:
    """A question the assistant answered with a tool call (no result: the pattern the model
    copies)."""
    arguments = json.dumps({"city": city})
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    return [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]


client = openai.OpenAI(timeout=300)
messages = [*asked("Rome", "call_1"), *asked("Oslo", "call_2")]
messages.append({"role": "user", "content": "Weather in Paris?"})
for _ in range(2):
    answer = client.chat.completions.create(
        model="policy", messages=messages, tools=[TOOL], max_tokens=40, temperature=0
    )
    message = answer.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
        break
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
print(json.dumps(messages, indent=1))
