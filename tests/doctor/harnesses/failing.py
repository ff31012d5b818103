"""A bad harness: every call sends a prompt longer than the engine's context (4096 tokens), so
the engine refuses each one; the harness prints the errors and exits 1."""

import sys

import openai

client = openai.OpenAI(timeout=300, max_retries=0)
failures = 0
for _ in range(2):
    try:
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "word " * 5000}], max_tokens=8
        )
    except openai.APIError as error:
        failures += 1
        print("call failed:", error)
sys.exit(1 if failures else 0)
