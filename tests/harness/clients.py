"""Harness clients pointed at a rollout's proxy URL, set up as a user sets them up."""

from __future__ import annotations

from typing import Any

from tests.harness.conftest import Rollout


def chat_openai(rollout: Rollout, max_tokens: int, *, timeout: float = 300, **settings: Any) -> Any:
    """LangChain's `ChatOpenAI` on the rollout (no retries: a failed call fails the test)."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=rollout.model,
        base_url=rollout.base_url,
        api_key=rollout.token,  # type: ignore[arg-type]
        max_tokens=max_tokens,  # type: ignore[call-arg]
        timeout=timeout,
        max_retries=0,
        **settings,
    )


def agents_sdk_on(rollout: Rollout) -> None:
    """The Agents SDK's default client (its Responses model) is the rollout's; tracing is off
    (it would send traces to OpenAI)."""
    from agents import set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    set_default_openai_client(
        AsyncOpenAI(base_url=rollout.base_url, api_key=rollout.token, timeout=300),
        use_for_tracing=False,
    )
