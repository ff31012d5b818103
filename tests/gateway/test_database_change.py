"""A cursor follower whose gateway comes back on another database (a fresh SQLite file behind
the same URL) says so, instead of waiting forever for rollouts that are not in it: the client's
`follow_rollouts` and the trainer's `CompletionWatch` raise `DatabaseChanged`; so do they when it
comes back on an older copy of its database (restored from a backup). (The controller,
which serves whatever database it finds, reads the new one from the start:
tests/controller/test_local.py.) Real: `reins gateway` processes on one port, two SQLite files."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from reins.client import DatabaseChanged, GatewayClient
from reins.monitor import export
from reins.schemas import RolloutSpec
from reins.trainer import resume
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


async def test_followers_of_a_gateway_restored_from_an_older_copy_fail_saying_so(
    tmp_path: Path,
) -> None:
    """The same database gone back to a backup keeps its id: its changes ending before the
    cursor is the sign, and a follower says so rather than miss the changes made after the
    copy until the counter passes its cursor again."""
    port = free_port()
    live, backup = tmp_path / "live.db", tmp_path / "backup.db"
    gateway = GatewayProcess(
        database_url=f"sqlite+aiosqlite:///{live}", api_key=ADMIN_KEY, port=port
    )
    await asyncio.to_thread(gateway.start)
    await asyncio.to_thread(gateway.stop)
    shutil.copyfile(live, backup)  # stopped: the WAL is checkpointed into the file
    await asyncio.to_thread(gateway.start)
    restored = GatewayProcess(
        database_url=f"sqlite+aiosqlite:///{backup}", api_key=ADMIN_KEY, port=port
    )
    try:
        async with GatewayClient(gateway.url, ADMIN_KEY) as client:
            await _finish(client, "old")
            watch = CompletionWatch(client, poll_s=0.05)
            watch.start()
            following = client.follow_rollouts(states=["succeeded"], poll_s=0.05)
            assert (await anext(following)).rollout_id == "old"
            while "old" not in watch.finished:
                await watch.changed(timeout_s=5)

            await asyncio.to_thread(gateway.stop)
            await asyncio.to_thread(restored.start)  # the same URL and database id, older
            with pytest.raises(DatabaseChanged, match="the gateway's database went back"):
                await asyncio.wait_for(anext(following), 30)
            with pytest.raises(DatabaseChanged, match="the gateway's database went back"):
                async with asyncio.timeout(30):
                    while True:
                        await watch.changed(timeout_s=1)
            await watch.stop()
    finally:
        await asyncio.to_thread(gateway.stop)
        await asyncio.to_thread(restored.stop)


class SwitchBeforeRead(httpx.AsyncBaseTransport):
    """Forwards for real; before the `nth` read of `/api/rollouts` it runs `switch` (the
    gateway behind the URL restarted on another database), between two pages of one sweep."""

    def __init__(self, nth: int, switch: Callable[[], None]) -> None:
        self.nth, self.switch = nth, switch
        self.reads = 0
        self.real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/api/rollouts":
            self.reads += 1
            if self.reads == self.nth:
                await asyncio.to_thread(self.switch)
        return await self.real.handle_async_request(request)


def _two_databases(tmp_path: Path) -> tuple[GatewayProcess, GatewayProcess]:
    port = free_port()
    return tuple(  # type: ignore[return-value]
        GatewayProcess(
            database_url=f"sqlite+aiosqlite:///{tmp_path / name}", api_key=ADMIN_KEY, port=port
        )
        for name in ("first.db", "second.db")
    )


async def _declare(gateway: GatewayProcess, ids: list[str]) -> None:
    await asyncio.to_thread(gateway.start)
    async with GatewayClient(gateway.url, ADMIN_KEY) as client:
        await client.create_rollouts(
            [RolloutSpec(rollout_id=i, metadata={"run": "r"}) for i in ids]
        )
    await asyncio.to_thread(gateway.stop)


async def test_the_leftover_sweep_spans_one_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarting trainer fails its run's rollouts left in flight, a page at a time: if the
    gateway comes back on another database between two pages, the sweep is of that database's
    rollouts, from its first page (not the old one's ids, unknown there, nor a cursor that
    skips the new one's first changes)."""
    first, second = _two_databases(tmp_path)
    await _declare(second, ["b1", "b2", "b3"])
    await _declare(first, ["a1", "a2"])
    await asyncio.to_thread(first.start)

    def switch() -> None:
        first.stop()
        second.start()

    monkeypatch.setattr(resume, "PAGE", 1)
    try:
        transport = SwitchBeforeRead(2, switch)
        async with GatewayClient(first.url, ADMIN_KEY, transport=transport) as client:
            cancelled = await resume.cancel_leftovers(client, "r", "the run restarted")
            states = {r: (await client.get_rollout(r)).rollout.status.state for r in cancelled}
    finally:
        await asyncio.to_thread(first.stop)
        await asyncio.to_thread(second.stop)
    assert states == {"b1": "failed", "b2": "failed", "b3": "failed"}


async def test_an_export_across_a_database_change_fails_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One file, one database: an export whose gateway comes back on another database between
    two pages stops with `DatabaseChanged` rather than write two histories into one file."""
    first, second = _two_databases(tmp_path)
    await _declare(second, ["b1"])
    await _declare(first, ["a1", "a2"])
    await asyncio.to_thread(first.start)

    def switch() -> None:
        first.stop()
        second.start()

    monkeypatch.setattr(export, "PAGE", 1)
    out = io.StringIO()
    try:
        transport = SwitchBeforeRead(2, switch)
        async with GatewayClient(first.url, ADMIN_KEY, transport=transport) as client:
            with pytest.raises(DatabaseChanged, match="the gateway's database changed"):
                await export.export_rollouts(client, out, run="r")
    finally:
        await asyncio.to_thread(first.stop)
        await asyncio.to_thread(second.stop)
    assert [json.loads(line)["rollout_id"] for line in out.getvalue().splitlines()] == ["a1"]
