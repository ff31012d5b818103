"""A cursor follower whose gateway comes back on another database (a fresh SQLite file behind
the same URL) says so, instead of waiting forever for rollouts that are not in it: the client's
`follow_rollouts` and the trainer's `CompletionWatch` raise `DatabaseChanged`. (The controller,
which serves whatever database it finds, reads the new one from the start:
tests/controller/test_local.py.) Real: `reins gateway` processes on one port, two SQLite files."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from reins.client import DatabaseChanged, GatewayClient
from reins.schemas import RolloutSpec
from reins.trainer.loop import CompletionWatch
from tests.conftest import ADMIN_KEY
from tests.support import GatewayProcess, free_port


async def _finish(client: GatewayClient, rollout_id: str) -> None:
    await client.create_rollouts([RolloutSpec(rollout_id=rollout_id)])
    await client.set_status(rollout_id, "running")
    await client.set_status(rollout_id, "succeeded")


async def test_followers_of_a_gateway_restarted_on_another_database_fail_saying_so(
    tmp_path: Path,
) -> None:
    port = free_port()
    first = GatewayProcess(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'first.db'}", api_key=ADMIN_KEY, port=port
    )
    await asyncio.to_thread(first.start)
    second = GatewayProcess(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'second.db'}", api_key=ADMIN_KEY, port=port
    )
    try:
        async with GatewayClient(first.url, ADMIN_KEY) as client:
            await _finish(client, "old")
            watch = CompletionWatch(client, poll_s=0.05)
            watch.start()
            following = client.follow_rollouts(states=["succeeded"], poll_s=0.05)
            assert (await anext(following)).rollout_id == "old"
            while "old" not in watch.finished:
                await watch.changed(timeout_s=5)

            await asyncio.to_thread(first.stop)
            await asyncio.to_thread(second.start)  # the same URL, another database
            await _finish(client, "new")
            with pytest.raises(DatabaseChanged, match="the gateway's database changed"):
                await asyncio.wait_for(anext(following), 30)
            with pytest.raises(DatabaseChanged, match="the gateway's database changed"):
                async with asyncio.timeout(30):
                    while True:
                        await watch.changed(timeout_s=1)
            assert "new" not in watch.finished
            await watch.stop()
    finally:
        await asyncio.to_thread(first.stop)
        await asyncio.to_thread(second.stop)
