"""A bad harness: between turns it rewrites the answer it got (upper case) before sending it
back, so the next prompt never continues the sampled tokens (every rollout splits)."""

import openai

client = openai.OpenAI(timeout=300)
messages = [{"role": "user", "content": "Name a fruit."}]
for question in ("Name another one.", None):
    answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
    edited = "EDITED: " + (answer.choices[0].message.content or "").upper()
    messages.append({"role": "assistant", "content": edited})
    if question is not None:
        messages.append({"role": "user", "content": question})
