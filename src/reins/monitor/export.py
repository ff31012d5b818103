"""`reins export`: the rollouts of a run (or any filter) as JSONL, one rollout per line.

Each line is a self-contained JSON object meant for grep and for an AI agent reading a run:
the rollout (input, status, metadata) and, per attempt, its calls in order (the request and
response as the harness saw them, token counts, logprob summary, what the Sample Adapter did
with the call), its rewards, the agent's logs (`agent_log` events) and every other event.
Token IDs and logprobs are left out unless asked for (`tokens=True`): they are large and
unreadable.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from reins.client import GatewayClient, check_database
from reins.monitor.rollout import LOW_P, decisions, mean_logprob, probability
from reins.packed import unpack_events
from reins.schemas import AGENT_LOG, MODEL_REQUEST, REWARD, Event, RolloutDetail, RolloutPage

PAGE = 1000


def _call(event: Event, decision: dict[str, Any] | None, tokens: bool) -> dict[str, Any]:
    data = dict(event.data)
    prompt_ids = data.pop("prompt_token_ids", None)
    if isinstance(prompt_ids, np.ndarray):  # restored with `token_arrays`: made a list if shown
        prompt_count: int | None = int(prompt_ids.size)
        prompt_ids = prompt_ids.tolist() if tokens else []
    else:
        prompt_ids = prompt_ids or []
        prompt_count = len(prompt_ids) if isinstance(prompt_ids, list) else None
    response_ids = data.pop("response_token_ids", None) or []
    logprobs = data.pop("response_logprobs", None)
    out: dict[str, Any] = {"seq": event.seq, "created_at": event.created_at.isoformat()}
    out["prompt_tokens"] = prompt_count
    out["response_tokens"] = len(response_ids) if isinstance(response_ids, list) else None
    if (
        isinstance(logprobs, list)
        and logprobs
        and all(isinstance(v, int | float) for v in logprobs)
    ):
        out["min_logprob"] = min(logprobs)
        out["mean_logprob"] = mean_logprob(logprobs)
        out["low_p_tokens"] = sum(1 for v in logprobs if probability(v) < LOW_P)
    out["sample"] = decision
    # The event's own seq and figures, whatever its data says (as for rewards and logs below).
    out.update((key, value) for key, value in data.items() if key not in out)
    if tokens:
        out["prompt_token_ids"] = prompt_ids
        out["response_token_ids"] = response_ids
        out["response_logprobs"] = logprobs
    return out


def rollout_line(
    detail: RolloutDetail, events: Sequence[Event], *, tokens: bool = False
) -> dict[str, Any]:
    """One rollout, every attempt, as a JSON-ready dict."""
    rollout = detail.rollout
    line: dict[str, Any] = {
        "rollout_id": rollout.rollout_id,
        "status": rollout.status.state,
        "status_reason": rollout.status.reason,
        "mode": rollout.mode,
        "group_id": rollout.group_id,
        "input": rollout.input,
        "metadata": rollout.metadata,
        "created_at": rollout.created_at.isoformat(),
        "updated_at": rollout.updated_at.isoformat(),
        "reward": None,
        "attempts": [],
    }
    for attempt in detail.attempts:
        mine = [e for e in events if e.attempt_id == attempt.attempt_id]
        found, sequences, splits, error = decisions(
            rollout.rollout_id, mine, attempt.attempt_id, decode=None
        )
        calls, rewards, logs, other = [], [], [], []
        for event in mine:
            if event.type == MODEL_REQUEST:
                decision = found.get(event.seq)
                sample = (
                    None
                    if decision is None
                    else {
                        "decision": decision.kind,
                        "reason": decision.reason,
                        "sequence": decision.sequence,
                        "text": decision.text,
                    }
                )
                calls.append(_call(event, sample, tokens))
            elif event.type == REWARD:
                # The event's own seq, whatever the data says: a harness writes the data.
                rewards.append({**event.data, "seq": event.seq})
            elif event.type == AGENT_LOG:
                logs.append({**event.data, "seq": event.seq})
            else:
                other.append({"seq": event.seq, "type": event.type, "data": event.data})
        reward = rewards[-1].get("value") if rewards else None
        line["attempts"].append(
            {
                "attempt_id": attempt.attempt_id,
                "state": attempt.state,
                "reason": attempt.reason,
                "created_at": attempt.created_at.isoformat(),
                "ended_at": attempt.ended_at.isoformat() if attempt.ended_at else None,
                "reward": reward,
                "calls": calls,
                "sequences": sequences,
                "split_reasons": splits,
                "samples_error": error,
                "rewards": rewards,
                "logs": logs,
                "events": other,
            }
        )
    if line["attempts"]:
        line["reward"] = line["attempts"][-1]["reward"]
    return line


async def _lines(
    client: GatewayClient, rollout_ids: list[str], tokens: bool
) -> list[dict[str, Any]]:
    async def one(rollout_id: str) -> dict[str, Any]:
        detail = await client.get_rollout(rollout_id)
        # As stored, prompts restored as arrays: whole, a long rollout's prompts are most of its
        # JSON (140 MB for 200 calls growing to 128k tokens) and grow with the square of its turns.
        stored = await client.get_packed_events(rollout_id, all_attempts=True)
        return rollout_line(detail, unpack_events(stored, token_arrays=True), tokens=tokens)

    return list(await asyncio.gather(*(one(rid) for rid in rollout_ids)))


async def export_rollouts(
    client: GatewayClient,
    out: TextIO,
    *,
    run: str | None = None,
    states: Sequence[str] = (),
    mode: str | None = None,
    search: str | None = None,
    tokens: bool = False,
    concurrency: int = 8,
) -> int:
    """Writes every matching rollout as one JSON line, in the order of their last change;
    returns how many were written."""
    params: dict[str, Any] = {"limit": PAGE}
    if run:
        params["run"] = run
    if states:
        params["status"] = list(states)
    if mode:
        params["mode"] = mode
    if search:
        params["q"] = search
    cursor, database = 0, None
    written = 0
    seen: set[str] = set()
    while True:
        page = await client.request("GET", "/api/rollouts", params={**params, "cursor": cursor})
        # Lines already written came from one database: one from another (the gateway restarted
        # on it meanwhile) or from an older copy would mix two histories in one file.
        head = RolloutPage(
            items=[], next_cursor=page["next_cursor"], database_id=page.get("database_id")
        )
        database = check_database(database, cursor, head)
        ids = [item["rollout_id"] for item in page["items"] if item["rollout_id"] not in seen]
        for start in range(0, len(ids), concurrency):
            for line in await _lines(client, ids[start : start + concurrency], tokens):
                out.write(json.dumps(line, ensure_ascii=False, default=str) + "\n")
                written += 1
        seen.update(ids)
        cursor = int(page["next_cursor"])
        # Only an empty page is the end: a gateway answers at most its REINS_MAX_PAGE_SIZE,
        # which may be below PAGE (a short page is no sign that nothing follows).
        if not page["items"]:
            return written


def export_to(
    gateway_url: str,
    api_key: str,
    out: TextIO,
    *,
    run: str | None = None,
    states: Sequence[str] = (),
    mode: str | None = None,
    search: str | None = None,
    tokens: bool = False,
) -> int:
    """`export_rollouts` from a gateway URL, synchronously (the command line's entry)."""

    async def go() -> int:
        async with GatewayClient(gateway_url, api_key, max_retries=3) as client:
            return await export_rollouts(
                client, out, run=run, states=states, mode=mode, search=search, tokens=tokens
            )

    return asyncio.run(go())
