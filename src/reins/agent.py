"""Harness-side helpers: read the environment the controller injects, report rewards and events.

An unmodified harness needs none of this: it reads `OPENAI_BASE_URL` and `OPENAI_API_KEY` like
any OpenAI client. These helpers are for the few lines that grade the result::

    from reins.agent import AgentContext, report_reward

    ctx = AgentContext.from_env()
    ...  # run the harness against ctx.openai_base_url
    report_reward(1.0 if solved else 0.0, reason="tests passed")

Calls are synchronous (harness code is often not async), use the attempt's scoped token (which
may post events to its own attempt and nothing else), and are retried on transport errors and
5xx answers with one idempotency key chosen before the first try, so a retry is stored once.
This module imports only the standard library: an agent is one short process per attempt, and
on this project's 2-core machines `import httpx` alone costs 0.25-0.35 s of CPU per attempt,
`urllib.request` under 0.1 s.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Union

Json = Union[dict[str, "Json"], list["Json"], str, int, float, bool, None]  # noqa: UP007

REWARD = "reward"
"""The built-in reward event type (`reins.schemas.REWARD`)."""

_VARIABLES = {
    "openai_base_url": "OPENAI_BASE_URL",
    "api_key": "OPENAI_API_KEY",
    "gateway_url": "REINS_GATEWAY_URL",
    "rollout_id": "REINS_ROLLOUT_ID",
    "attempt_id": "REINS_ATTEMPT_ID",
    "mode": "REINS_MODE",
    "input": "REINS_INPUT",
}


class AgentEnvError(RuntimeError):
    """The environment lacks what `reins controller` gives every agent."""


class ReportError(RuntimeError):
    """The gateway refused an event (4xx), or kept failing after every retry."""


@dataclass(frozen=True)
class AgentContext:
    """What the controller tells one agent run (docs/controller.md, "The agent's environment")."""

    openai_base_url: str
    """The gateway's proxy for this rollout, attempt and mode; point any OpenAI client here."""
    api_key: str
    """The attempt's scoped token: the proxy and this attempt's event posts, nothing else."""
    gateway_url: str
    rollout_id: str
    attempt_id: int
    mode: str
    """`train` or `val`."""
    input: Json
    """The rollout's input, JSON-decoded."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AgentContext:
        env = os.environ if environ is None else environ
        missing = [name for name in _VARIABLES.values() if name not in env]
        if missing:
            raise AgentEnvError(
                f"{', '.join(missing)} not set: this code expects to run as an agent launched by "
                "`reins controller`, which sets them (see docs/controller.md)"
            )
        try:
            attempt_id = int(env["REINS_ATTEMPT_ID"])
        except ValueError as error:
            raise AgentEnvError(
                f"REINS_ATTEMPT_ID is {env['REINS_ATTEMPT_ID']!r}, not an integer"
            ) from error
        try:
            value: Json = json.loads(env["REINS_INPUT"])
        except ValueError as error:
            raise AgentEnvError(f"REINS_INPUT is not JSON: {error}") from error
        return cls(
            openai_base_url=env["OPENAI_BASE_URL"],
            api_key=env["OPENAI_API_KEY"],
            gateway_url=env["REINS_GATEWAY_URL"].rstrip("/"),
            rollout_id=env["REINS_ROLLOUT_ID"],
            attempt_id=attempt_id,
            mode=env["REINS_MODE"],
            input=value,
        )


def emit_event(
    type: str,
    data: Mapping[str, Json],
    *,
    context: AgentContext | None = None,
    idempotency_key: str | None = None,
    retries: int = 6,
    timeout_s: float = 10.0,
) -> None:
    """Appends one event of `type` to this attempt at the gateway."""
    ctx = context or AgentContext.from_env()
    key = idempotency_key or uuid.uuid4().hex
    url = f"{ctx.gateway_url}/api/rollouts/{ctx.rollout_id}/attempt/{ctx.attempt_id}/events"
    body = json.dumps({"type": type, "data": dict(data), "idempotency_key": key}).encode()
    headers = {"Authorization": f"Bearer {ctx.api_key}", "Content-Type": "application/json"}
    problem = ""
    for attempt in range(retries + 1):
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                response.read()
            return
        except urllib.error.HTTPError as error:
            problem = f"{error.code}: {_message(error.read())}"
            if error.code < 500:
                raise ReportError(f"the gateway refused the {type} event ({problem})") from error
        except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out
            problem = repr(error)
        if attempt < retries:
            time.sleep(min(5.0, 0.1 * 2**attempt) * (0.5 + random.random()))
    raise ReportError(f"could not post the {type} event to {url} ({problem})")


def report_reward(
    value: float,
    *,
    reason: str | None = None,
    source: str = "agent",
    context: AgentContext | None = None,
) -> None:
    """Posts this attempt's `reward` event (the trainer reads the last one of the attempt)."""
    data: dict[str, Json] = {"value": float(value), "source": source}
    if reason is not None:
        data["reason"] = reason
    emit_event(REWARD, data, context=context)


def _message(body: bytes) -> str:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:300].decode(errors="replace")
    if isinstance(parsed, dict) and "error" in parsed:
        return str(parsed["error"])
    return str(parsed)[:300]
