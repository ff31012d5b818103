"""Fixtures of the controller tests: a real gateway on loopback (SQLite) and its client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import pytest

from reins.client import GatewayClient
from reins.controller import Controller
from reins.controller.local import LocalReconciler
from reins.gateway import GatewaySettings
from reins.schemas import TERMINAL_STATES, Rollout
from tests.conftest import ADMIN_KEY, serve

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gateway_url(tmp_path: Path) -> Iterator[str]:
    settings = GatewaySettings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}", api_key=ADMIN_KEY
    )
    with serve(settings) as server:
        yield f"http://127.0.0.1:{server.port}"


@pytest.fixture
async def client(gateway_url: str) -> AsyncIterator[GatewayClient]:
    async with GatewayClient(gateway_url, ADMIN_KEY) as gateway:
        yield gateway


def stop_dead(controller: Controller) -> None:
    """What the death of a local controller's process leaves: its agents run on, and the kernel
    closes its files, so its log folder's `controller.lock` is free for the next controller."""
    reconciler = controller.reconciler
    assert isinstance(reconciler, LocalReconciler)
    lock, reconciler._folder_lock = reconciler._folder_lock, None
    assert lock is not None, "the controller never started"
    os.close(lock)


@contextlib.asynccontextmanager
async def running(controller: Controller) -> AsyncIterator[Controller]:
    """Runs `controller` in a task; stops it (killing its local agents) on exit."""
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        yield controller
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def wait_terminal(
    client: GatewayClient, rollout_ids: Iterable[str], timeout_s: float = 90
) -> dict[str, Rollout]:
    """Waits until every rollout is succeeded or failed; returns them by id."""
    wanted = set(rollout_ids)
    deadline = time.monotonic() + timeout_s
    while True:
        done = {}
        for rollout_id in wanted:
            rollout = (await client.get_rollout(rollout_id)).rollout
            if rollout.status.state in TERMINAL_STATES:
                done[rollout_id] = rollout
        if len(done) == len(wanted):
            return done
        if time.monotonic() > deadline:
            pending = [(await client.get_rollout(r)) for r in sorted(wanted - set(done))]
            states = [
                (d.rollout.rollout_id, [(a.attempt_id, a.state, a.reason) for a in d.attempts])
                for d in pending
            ]
            raise AssertionError(f"rollouts still not terminal after {timeout_s} s: {states}")
        await asyncio.sleep(0.1)


async def wait_for(condition: object, timeout_s: float = 30, what: str = "condition") -> None:
    """Polls a sync or async zero-argument callable until it returns true."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition() if callable(condition) else condition
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen in {timeout_s} s")
        await asyncio.sleep(0.05)
