"""The trainer fails, naming the cause, when its rollout controller stops under it, instead of
waiting forever for rollouts no one launches (`runtime._while_controller_runs`). Real asyncio
tasks; the controller's failure is a `KeyRefused`, as a refused key raises it."""

from __future__ import annotations

import asyncio

import pytest

from reins.controller.loop import KeyRefused
from reins.trainer.runtime import _while_controller_runs


async def _controller(fails: asyncio.Event) -> None:
    await fails.wait()
    raise KeyRefused("the gateway refuses this controller's key")


async def test_the_work_fails_with_the_controllers_error_and_is_cancelled() -> None:
    fails, cancelled = asyncio.Event(), asyncio.Event()

    async def training() -> int:
        try:
            fails.set()
            await asyncio.Event().wait()  # rollouts that never come
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1

    controller = asyncio.create_task(_controller(fails))
    with pytest.raises(RuntimeError, match="rollout controller stopped") as raised:
        await asyncio.wait_for(_while_controller_runs(training(), controller), 30)
    assert isinstance(raised.value.__cause__, KeyRefused)
    assert cancelled.is_set()


async def test_the_work_returns_its_result_while_the_controller_runs() -> None:
    never = asyncio.Event()
    controller = asyncio.create_task(_controller(never))

    async def training() -> int:
        return 7

    assert await _while_controller_runs(training(), controller) == 7
    assert not controller.done()
    controller.cancel()


async def test_cancelling_the_run_cancels_the_work_and_waits_for_its_cleanup() -> None:
    started, cleaned = asyncio.Event(), asyncio.Event()
    controller = asyncio.create_task(_controller(asyncio.Event()))

    async def training() -> int:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # a cleanup that itself awaits
            cleaned.set()
        return 0

    run = asyncio.create_task(_while_controller_runs(training(), controller))
    await started.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert cleaned.is_set()
    controller.cancel()
