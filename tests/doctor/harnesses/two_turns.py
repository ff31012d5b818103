"""A good harness: a two-turn conversation with the openai client, history sent back unchanged
(greedy: in `val` mode every run is the same; `train` mode samples at temperature 1)."""

import openai

client = openai.OpenAI(timeout=300)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
messages = [{"role": "user", "content": "Name a fruit."}]
for question in ("Name another one.", None):
    answer = client.chat.completions.create(
        model="policy", messages=messages, max_tokens=12, temperature=0
    )
    messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    if question is not None:
        messages.append({"role": "user", "content": question})
print(messages)
