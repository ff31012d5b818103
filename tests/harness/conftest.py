"""Real harnesses against the real stack: harness -> gateway proxy -> embedded engine.

One embedded engine (the default model, the engine's default dtype) and one gateway (SQLite in a
temp folder) serve the whole session; each test gets a rollout attempt of its own and reads back
what the proxy recorded for it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from reins.engine.chat import parse_tool_calls
from reins.gateway import GatewaySettings
from reins.samples import Call, dedup_calls, merge_calls
from tests.conftest import ADMIN_KEY, serve
from tests.embedded_support import ServedEngine, served_engine
from tests.harness import recorded

# The harnesses run offline: no price tables, traces or hub downloads.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_CONFIGURED", "true")
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")


@dataclass(frozen=True)
class Received:
    """What the harness got back from one call: text, or tool calls (and the text beside them)."""

    content: str | None
    tool_calls: tuple[tuple[str, Any], ...] = ()
    """(name, parsed arguments) of each call."""

    @classmethod
    def text(cls, content: str | None) -> Received:
        return cls(content or "")

    @classmethod
    def calls(cls, content: str | None, calls: list[tuple[str, str]]) -> Received:
        """`calls`: (name, arguments as the JSON text the harness received)."""
        return cls(content or None, tuple((name, json.loads(args)) for name, args in calls))


@dataclass
class Rollout:
    """One rollout attempt on the gateway, and the proxy URL a harness is pointed at."""

    gateway_url: str
    rollout_id: str
    token: str
    engine: ServedEngine
    mode: str = "train"

    @property
    def attempt_url(self) -> str:
        return f"{self.gateway_url}/proxy/rollout/{self.rollout_id}/attempt/1/mode/{self.mode}"

    @property
    def base_url(self) -> str:
        return f"{self.attempt_url}/openai/v1"

    @property
    def anthropic_base_url(self) -> str:
        """The base URL of Anthropic clients (they append `/v1/messages`)."""
        return f"{self.attempt_url}/anthropic"

    @property
    def model(self) -> str:
        return self.engine.name

    def calls(self) -> list[dict[str, Any]]:
        """The `model_request` events' data, in call order."""
        response = httpx.get(
            f"{self.gateway_url}/api/rollouts/{self.rollout_id}/events",
            params={"type": "model_request"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=30,
        )
        response.raise_for_status()
        return [event["data"] for event in response.json()]

    def sequences(self) -> tuple[int, list[str]]:
        """How many training sequences the sample adapter makes of this rollout's calls, and
        the reason of each split."""
        return training_sequences(self.calls(), self.engine)

    def assert_recorded_as_received(
        self, received: list[Received], kind: str | None = None
    ) -> None:
        """Call after call, the recorded response token IDs decode to exactly what the harness
        received: the same text, or text that parses to the same tool calls; each call has
        logprobs that are real log-probabilities, and the wire API's `kind` when given."""
        calls = self.calls()
        assert len(calls) == len(received), [c["response"] for c in calls]
        assert any(got.content or got.tool_calls for got in received), "every answer was empty"
        for number, (call, got) in enumerate(zip(calls, received, strict=True), start=1):
            assert call["status"] == 200, f"call {number}: {call.get('error')}"
            if kind is not None:
                assert call["kind"] == kind, f"call {number}"
            assert call["prompt_token_ids"], f"call {number} has no prompt token IDs"
            logprobs = call["response_logprobs"]
            assert len(logprobs) == len(call["response_token_ids"])
            assert all(math.isfinite(value) and value <= 0 for value in logprobs), logprobs
            assert call["model_version"] == self.engine.engine.weight_version
            decoded = self.engine.engine.decode(call["response_token_ids"])
            if got.tool_calls:
                content, parsed = parse_tool_calls(decoded)
                calls_seen = [
                    (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed
                ]
                assert calls_seen == list(got.tool_calls), f"call {number}"
                assert content == got.content, f"call {number}"
            else:
                assert decoded == got.content, f"call {number}"
        # Values, not only lengths: the trainer's logprobs, the template's prompt.
        recorded.assert_logprobs_are_the_policys(self.engine, calls)
        recorded.assert_prompts_are_the_template(self.engine, calls)
        note_fidelity(kind or "chat", calls, self.engine)


def training_sequences(calls: list[dict[str, Any]], engine: ServedEngine) -> tuple[int, list[str]]:
    """How many training sequences the sample adapter makes of recorded calls, and the reason of
    each split."""
    kept = [
        Call(c["prompt_token_ids"], c["response_token_ids"], seq=number)
        for number, c in enumerate(calls)
        if c["status"] == 200 and c["response_token_ids"]
    ]
    merged, splits = merge_calls(dedup_calls(kept), decode=engine.engine.decode)
    return len(merged), [split.reason for split in splits]


def note_fidelity(api: str, calls: list[dict[str, Any]], engine: ServedEngine) -> None:
    sequences, reasons = training_sequences(calls, engine)
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    FIDELITY.append((test, api, len(calls), sequences, reasons))


FIDELITY: list[tuple[str, str, int, int, list[str]]] = []
"""(test, API, calls, training sequences, split reasons) of every checked rollout: printed at
the end of the session (docs/harnesses.md's samples-per-rollout column comes from it)."""


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIDELITY:
        return
    terminalreporter.section("harness rollouts: calls -> training sequences")
    for test, api, calls, sequences, reasons in FIDELITY:
        why = f" (splits: {', '.join(reasons)})" if reasons else ""
        terminalreporter.write_line(f"{test} [{api}]: {calls} calls -> {sequences}{why}")


@pytest.fixture(scope="session")
def embedded() -> Iterator[ServedEngine]:
    with served_engine() as served:
        yield served


@contextlib.contextmanager
def gateway_for(settings: GatewaySettings, engine: ServedEngine) -> Iterator[tuple[str, int]]:
    """A gateway served on loopback with `engine` registered as its model; (URL, port)."""
    with serve(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        httpx.post(
            f"{url}/api/models",
            json={"model": engine.name, "endpoint": engine.base_url, "engine": "embedded"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        ).raise_for_status()
        yield url, server.port


@pytest.fixture(scope="session")
def gateway_url(embedded: ServedEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    database = tmp_path_factory.mktemp("harness-gateway") / "gateway.db"
    settings = GatewaySettings(database_url=str(database), api_key=ADMIN_KEY)
    with gateway_for(settings, embedded) as (url, _):
        yield url


def open_rollout(gateway_url: str, engine: ServedEngine, mode: str = "train") -> Rollout:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    rollout_id = f"harness-{uuid.uuid4().hex[:12]}"
    httpx.post(
        f"{gateway_url}/api/rollouts", json=[{"rollout_id": rollout_id}], headers=admin
    ).raise_for_status()
    attempt = httpx.post(f"{gateway_url}/api/rollouts/{rollout_id}/attempts", headers=admin)
    attempt.raise_for_status()
    return Rollout(gateway_url, rollout_id, attempt.json()["token"], engine, mode)


@pytest.fixture
def rollout(gateway_url: str, embedded: ServedEngine) -> Rollout:
    """A rollout attempt in `train` mode: the proxy samples at temperature 1."""
    return open_rollout(gateway_url, embedded)


@pytest.fixture
def val_rollout(gateway_url: str, embedded: ServedEngine) -> Rollout:
    """A rollout attempt in `val` mode: the harness's own sampling settings are kept."""
    return open_rollout(gateway_url, embedded, mode="val")
