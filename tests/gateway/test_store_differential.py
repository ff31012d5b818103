"""One random sequence of API calls, run against a gateway on a SQLite file and one on a real
PostgreSQL database: every answer must be the same (status, body, order, pagination, errors,
stats), but for what each store makes its own (times, tokens, generated keys, and seq numbers:
PostgreSQL's sequence leaves gaps where a refused post drew one)."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from reins.gateway import GatewaySettings
from tests.conftest import ADMIN_KEY, serve
from tests.support import PostgresServer

_OWN = {"seq", "last_seq", "created_at", "updated_at", "ended_at", "started_at", "token"}
_OWN |= {"database_id", "since", "expires_at"}
"""Fields each store fills in its own way."""

_VALUES: list[Any] = [0, 1, -1, 1.5, 2**53 + 1, 2**63, 2**64 + 5, -0.0, 1e308, 5e-324, "é"]
_VALUES += ["\x00", "😀", "\u2028", None, True, [], {}, {"b": 1, "a": 2}, "x" * 300]

Call = tuple[str, str, dict[str, Any] | None, Any]


def _same_form(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _same_form(v) for k, v in value.items() if k not in _OWN}
    if isinstance(value, list):
        return [_same_form(v) for v in value]
    if isinstance(value, str) and value.startswith("srv-"):
        return "srv-"  # a key the gateway made
    return value


def _event(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["note", "reward", "model_request", "custom.x"])
    if kind == "reward":
        data: dict[str, Any] = {"value": rng.choice([0.5, 1, -1, "1", 1e13, True])}
    elif kind == "model_request":
        data = {
            "prompt_token_ids": [1, 2, rng.randint(0, 9)],
            "response_token_ids": [3, 4],
            "response_logprobs": [-0.5, -0.25],
            "model_version": rng.choice([1, 2, "3", 1.5, True, None, 2**63]),
            "status": rng.choice([200, 500, "200"]),
            "model": rng.choice(["m", "other"]),
        }
    else:
        data = {"v": rng.choice(_VALUES)}
    event = {"type": kind, "data": data}
    if rng.random() < 0.7:
        event["idempotency_key"] = rng.choice(["k1", "k2", "k3", "ké"])
    return event


def _calls(seed: int, count: int) -> Iterator[Call]:
    rng = random.Random(seed)
    ids = [f"r{i}" for i in range(6)]
    for _ in range(count):
        pick, rollout_id = rng.random(), rng.choice(ids)
        if pick < 0.1:
            specs = [
                {
                    "rollout_id": rng.choice(ids),
                    "input": rng.choice(_VALUES),
                    "group_id": rng.choice([None, "g1", "g2"]),
                    "mode": rng.choice(["train", "val"]),
                    "metadata": {"run": rng.choice(["a", "b", 1, True]), "v": rng.choice(_VALUES)},
                }
                for _ in range(rng.randint(1, 3))
            ]
            yield "POST", "/api/rollouts", None, specs
        elif pick < 0.25:
            state = rng.choice(["queuing", "running", "succeeded", "failed"])
            reason = rng.choice([None, "why", "é"])
            change = (
                {"status": {"state": state, "reason": reason}}
                if rng.random() < 0.7
                else {"metadata": {"m": rng.choice(_VALUES)}}
            )
            yield "PATCH", f"/api/rollouts/{rollout_id}", None, change
        elif pick < 0.35:
            named = {"attempt_id": rng.randint(1, 3), "reason": rng.choice([None, "crash"])}
            yield "POST", f"/api/rollouts/{rollout_id}/attempts", None, rng.choice([{}, named])
        elif pick < 0.6:
            events = [_event(rng) for _ in range(rng.randint(1, 3))]
            path = f"/api/rollouts/{rollout_id}/attempt/{rng.randint(1, 3)}/events"
            yield "POST", path, None, events if rng.random() < 0.7 else events[0]
        elif pick < 0.7:
            # `after` only 0 or past everything: seq numbers differ between the stores.
            params: dict[str, Any] = {
                "after": rng.choice([0, 2**62]),
                "limit": rng.choice([1, 100]),
            }
            if rng.random() < 0.3:
                params["all_attempts"] = "true"
            if rng.random() < 0.3:
                params["type"] = rng.choice(["note", "reward", "model_request"])
            if rng.random() < 0.2:
                params["attempt_id"] = rng.randint(1, 3)
            yield "GET", f"/api/rollouts/{rollout_id}/events", params, None
        elif pick < 0.8:
            params = {"cursor": rng.choice([0, 1, 3, 10**6]), "limit": rng.choice([1, 2, 50])}
            for key, choices in (
                ("status", ["queuing", "running", "succeeded", "failed"]),
                ("mode", ["train", "val"]),
                ("group_id", ["g1", "g2"]),
                ("run", ["a", "1", "true"]),
                ("q", ["R1", "é", "%", "_", "x"]),
            ):
                if rng.random() < 0.3:
                    params[key] = rng.choice(choices)
            yield "GET", "/api/rollouts", params, None
        elif pick < 0.87:
            asked: dict[str, Any] = {"rollout_ids": rng.sample(ids, rng.randint(1, 3))}
            if rng.random() < 0.5:
                asked["model"] = "m"
            yield "POST", "/api/rollouts/stats", None, asked
        elif pick < 0.92:
            yield "GET", f"/api/rollouts/{rollout_id}", None, None
        elif pick < 0.96:
            endpoint = rng.choice(["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"])
            model = {"model": rng.choice(["m", "n"]), "endpoint": endpoint}
            yield "POST", "/api/models", None, {**model, "weight_version": rng.randint(0, 3)}
        else:
            yield "GET", "/api/models", None, None


def _answers(settings: GatewaySettings, calls: list[Call]) -> list[tuple[int, Any]]:
    answers = []
    with serve(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
            for method, path, params, body in calls:
                answer = http.request(method, path, params=params, json=body)
                answers.append((answer.status_code, _same_form(answer.json())))
    return answers


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_both_stores_answer_one_call_sequence_alike(
    tmp_path: Path, postgres: PostgresServer, seed: int
) -> None:
    calls = list(_calls(seed, 250))
    sqlite = GatewaySettings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}", api_key=ADMIN_KEY
    )
    database = postgres.create_database(f"t_{uuid.uuid4().hex[:16]}")
    postgresql = GatewaySettings(database_url=database, api_key=ADMIN_KEY)
    on_sqlite, on_postgresql = _answers(sqlite, calls), _answers(postgresql, calls)
    for n, (call, a, b) in enumerate(zip(calls, on_sqlite, on_postgresql, strict=True)):
        assert a == b, f"call {n}: {json.dumps(call, default=str)[:500]}"
