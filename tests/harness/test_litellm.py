"""`litellm.completion` (the `openai/` provider, as mini-swe-agent and many agents call it),
pointed at the gateway proxy in front of the embedded engine."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.conftest import Received, Rollout

pytestmark = pytest.mark.slow

QUESTIONS = ["Name a fruit.", "And a vegetable?"]


def test_conversation_plain_then_streamed(rollout: Rollout) -> None:
    import litellm

    common: dict[str, Any] = {
        "model": f"openai/{rollout.model}",
        "api_base": rollout.base_url,
        "api_key": rollout.token,
        "max_tokens": 24,
        "timeout": 300,
    }
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTIONS[0]}]
    first = litellm.completion(messages=messages, **common)
    text = first.choices[0].message.content
    received = [Received.text(text)]

    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": QUESTIONS[1]}]
    pieces = []
    for chunk in litellm.completion(messages=messages, stream=True, **common):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    received.append(Received.text("".join(pieces)))
    rollout.assert_recorded_as_received(received)
    assert [call["stream"] for call in rollout.calls()] == [False, True]
