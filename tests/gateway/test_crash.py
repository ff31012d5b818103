"""Crash test: the gateway is SIGKILLed while 16 clients post events; nothing acknowledged is lost.

A real `reins gateway` process on loopback, on a SQLite file or a real PostgreSQL server. Every
event a client saw acknowledged (2xx) must be stored afterwards exactly once, after the clients'
retries (which reuse the event's idempotency key), and read back as it was posted. Each client's
events are calls of one growing conversation, so the store packs each against an earlier one
(`reins.packed`) across the kills: a restarted gateway rebuilds its bases from the rows.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import pytest
import sqlalchemy as sa

from reins.client import GatewayClient
from reins.gateway.store.sql import SqlStore
from reins.gateway.store.tables import events
from reins.packed import base_of
from reins.schemas import EventIn, RolloutSpec
from tests.support import GatewayProcess, free_port

pytestmark = pytest.mark.slow

CLIENTS = 16
KILLS = 2


async def _post_until(
    gateway: GatewayProcess, token: str, rollout_id: str, stop: asyncio.Event, acked: list[str]
) -> int:
    """Posts events until `stop`; returns how many posts had to be retried."""
    async with GatewayClient(
        gateway.url, token, timeout_s=10, max_retries=40, backoff_s=0.05, max_backoff_s=0.5
    ) as client:
        while not stop.is_set():
            key = uuid.uuid4().hex
            event = EventIn(type="model_request", data=_call(len(acked)), idempotency_key=key)
            await client.post_events(rollout_id, 1, [event])
            acked.append(key)
        return client.retries


def _call(n: int) -> dict[str, object]:
    """Call n of a conversation: its prompt extends call n-1's prompt + response."""
    return {
        "n": n,
        "prompt_token_ids": [t % 1000 for t in range(3 * n + 1)],
        "response_token_ids": [(3 * n + 1) % 1000, (3 * n + 2) % 1000],
        "response_logprobs": [-0.5, -0.25],
        "request": {"messages": [{"role": "user", "content": f"turn {i}"} for i in range(n + 1)]},
        "status": 200,
    }


async def _until_every_client_is_acked(acked: dict[str, list[str]], more: int) -> None:
    """Returns once every client got `more` acknowledgements past its count now (bounded)."""
    wanted = {rid: len(keys) + more for rid, keys in acked.items()}
    deadline = time.monotonic() + 60
    while any(len(acked[rid]) < count for rid, count in wanted.items()):
        assert time.monotonic() < deadline, "the clients stopped getting acknowledgements"
        await asyncio.sleep(0.02)


async def test_acknowledged_events_survive_sigkill_exactly_once(database_url: str) -> None:
    gateway = GatewayProcess(database_url=database_url, api_key="crash-key", port=free_port())
    await asyncio.to_thread(gateway.start)
    try:
        async with GatewayClient(gateway.url, "crash-key") as admin:
            ids = [f"crash-{i}" for i in range(CLIENTS)]
            await admin.create_rollouts([RolloutSpec(rollout_id=rid) for rid in ids])
            for rid in ids:
                await admin.open_attempt(rid, attempt_id=1)
        stop = asyncio.Event()
        acked: dict[str, list[str]] = {rid: [] for rid in ids}
        # `model_request` events are the proxy's to write: a scoped token may not post them.
        writers = [
            asyncio.create_task(_post_until(gateway, "crash-key", rid, stop, acked[rid]))
            for rid in ids
        ]
        kills_done = 0
        for _ in range(KILLS):
            # Killed while every client is posting (and, after a restart, posting again).
            await _until_every_client_is_acked(acked, 5)
            gateway.kill()
            kills_done += 1
            await asyncio.to_thread(gateway.start)
        await _until_every_client_is_acked(acked, 5)
        stop.set()
        retries = await asyncio.gather(*writers)
        assert kills_done == KILLS
        assert sum(retries) >= CLIENTS, "the kills must land while posts are in flight"

        async with GatewayClient(gateway.url, "crash-key") as admin:
            for rid in ids:
                stored = await admin.get_events(rid, attempt_id=1)
                counts = Counter(event.idempotency_key for event in stored)
                assert acked[rid], f"client of {rid} got no acknowledgement at all"
                missing = [key for key in acked[rid] if counts[key] == 0]
                assert not missing, f"{len(missing)} acknowledged events of {rid} were lost"
                assert all(count == 1 for count in counts.values())
                # Unacknowledged posts can only be the one in flight when the client stopped.
                assert set(counts) == set(acked[rid])
                for event in stored:
                    assert event.data == _call(event.data["n"]), f"{rid} seq {event.seq}"
        total = sum(len(keys) for keys in acked.values())
        assert total > CLIENTS * 10
        # Every call is packed, and each but a conversation's first names an earlier one as its
        # base, the restarts included.
        store = SqlStore(database_url)
        try:
            async with store.engine.connect() as conn:
                blobs = (await conn.execute(sa.select(events.c.packed))).scalars().all()
        finally:
            await store.close()
        assert len(blobs) == total
        assert all(blob is not None for blob in blobs)
        assert sum(base_of(blob) is None for blob in blobs) == CLIENTS
    finally:
        gateway.stop()
