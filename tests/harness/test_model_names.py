"""A model registered under any name (the README's `policy`) serves calls that name it, or any
other name a harness was configured with: the proxy sends the engine the name it answers to."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import ADMIN_KEY
from tests.harness.conftest import Rollout

pytestmark = pytest.mark.slow


def test_engine_registered_as_policy_serves_calls_for_policy(
    gateway_url: str, rollout: Rollout
) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    httpx.post(
        f"{gateway_url}/api/models",
        json={"model": "policy", "endpoint": rollout.engine.base_url, "engine": "embedded"},
        headers=admin,
    ).raise_for_status()
    try:
        sdk = openai.OpenAI(base_url=rollout.base_url, api_key=rollout.token, timeout=300)
        for name in ("policy", "claude-opus-4-8"):
            completion = sdk.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            assert completion.choices[0].message.content is not None
        calls = rollout.calls()
        assert [call["status"] for call in calls] == [200, 200]
        assert calls[0]["model"] == "policy"
    finally:
        removed = httpx.delete(
            f"{gateway_url}/api/models", params={"model": "policy"}, headers=admin
        )
        assert removed.json() == {"deleted": 1}
