"""A harness that asks the proxy for embeddings (which it does not serve: a 404 that leaves no
event), then makes one chat call (recorded). HEAD on its base URL, as Claude Code sends, too."""

import os

import httpx
import openai

base = os.environ["OPENAI_BASE_URL"]
headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
httpx.head(base, headers=headers, timeout=30)
client = openai.OpenAI(timeout=300, max_retries=0)
for _ in range(2):
    try:
        client.embeddings.create(model="policy", input="a fruit")
    except openai.NotFoundError as error:
        print("embeddings:", error.status_code)
answer = client.chat.completions.create(
    model="policy", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8
)
print(answer.choices[0].message.content)
