"""The gateway's `controller` lease: two controllers on one gateway, real HTTP, real agents."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from reins.client import GatewayClient
from reins.controller import Controller, LocalReconciler
from reins.controller.loop import AgentLog, Key, LeaseLost
from reins.schemas import AGENT_LAUNCH, AGENT_LOG, REWARD, RolloutSpec
from tests.conftest import ADMIN_KEY
from tests.controller.conftest import ROOT, running, wait_for, wait_terminal

AGENTS = "tests.controller.agents"


class PausingReconciler(LocalReconciler):
    """A local reconciler whose controller pauses once, in the middle of a pass (after it read
    the gateway, before it acts): what a stopped process or a long collection does to it."""

    pause: Callable[[], None] | None = None

    def free_slots(self) -> int:
        pause, self.pause = self.pause, None
        if pause is not None:
            pause()  # blocks the controller's event loop, as SIGSTOP would
        return super().free_slots()


class LogPausingReconciler(LocalReconciler):
    """Pauses its controller once as it reads an ended agent's log: after the controller
    checked its lease, before it reports the end to the gateway."""

    pause: Callable[[], None] | None = None

    async def agent_log(self, key: Key) -> AgentLog:
        pause, self.pause = self.pause, None
        if pause is not None:
            pause()  # blocks the controller's event loop, as SIGSTOP would
        return await super().agent_log(key)


def start_cli_controller(gateway_url: str, log_dir: Path, agent: str) -> subprocess.Popen[bytes]:
    log_dir.mkdir(parents=True)
    return subprocess.Popen(
        [
            sys.executable, "-m", "reins.cli", "controller", "--runner", "local",
            "--gateway", gateway_url, "--api-key", ADMIN_KEY, "--agent", agent,
            "--log-dir", str(log_dir), "--poll-interval", "0.1",
        ],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(log_dir / "controller.log").open("ab"),
    )  # fmt: skip


def in_another_thread(work: Callable[[], object]) -> None:
    """Runs a coroutine function to its end on a loop of its own, blocking this thread."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, work()).result(timeout=120)  # type: ignore[arg-type]


async def test_a_controller_whose_lease_changed_hands_while_it_paused_reads_again(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    """A paused past its lease; B took the lease, ran the rollout's attempt 1 (its agent posted
    a reward), stopped and gave the lease back. A's renewal was granted again (a new `since`),
    and A went on with what it had read before its pause: the rollout queuing, so it launched a
    second agent into attempt 1 (two rewards in one attempt). It now reads the gateway again
    first, and runs the rollout as a new attempt."""
    reconciler = PausingReconciler(f"{AGENTS}:succeed", 2, tmp_path / "a", workdir=ROOT)
    first = Controller(
        client, reconciler, gateway_url=gateway_url, poll_interval_s=0.1, lease_ttl_s=1.0
    )
    other_agent = (
        f"{sys.executable} -c 'from reins.agent import report_reward; report_reward(0.5)'"
        " && exec sleep 600"
    )
    other: subprocess.Popen[bytes] | None = None

    async def other_runs_attempt_1_and_stops() -> None:
        assert other is not None
        async with GatewayClient(gateway_url, ADMIN_KEY) as gateway:
            deadline = time.monotonic() + 60
            while not await gateway.get_events("r", all_attempts=True, types=[REWARD]):
                assert time.monotonic() < deadline, "the other controller never ran attempt 1"
                assert other.poll() is None, "the other controller ended"
                await asyncio.sleep(0.1)
        other.send_signal(signal.SIGTERM)  # it stops its agent and gives the lease back
        other.wait(60)

    try:
        async with running(first):
            await wait_for(lambda: first.stats.passes > 0, what="the first controller's pass")
            other = start_cli_controller(gateway_url, tmp_path / "b", other_agent)
            reconciler.pause = lambda: in_another_thread(other_runs_attempt_1_and_stops)
            await client.create_rollouts([RolloutSpec(rollout_id="r", input={})])
            rollout = (await wait_terminal(client, ["r"]))["r"]
    finally:
        if other is not None and other.poll() is None:
            other.kill()
            other.wait(30)
    rewards = await client.get_events("r", all_attempts=True, types=[REWARD])
    assert sorted((e.attempt_id, e.data["value"]) for e in rewards) == [(1, 0.5), (2, 1.0)]
    assert (rollout.status.state, rollout.attempt_count) == ("succeeded", 2)


async def test_a_poll_interval_longer_than_the_lease_keeps_the_lease(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    """The lease was renewed only as a pass began: a controller idle for its poll interval
    (`--poll-interval` takes up to an hour; the lease lasts 15 s) let it lapse between two
    passes, and a second controller took it and ran rollouts beside the first."""

    def idle_controller(name: str, poll_interval_s: float) -> Controller:
        reconciler = LocalReconciler(f"{AGENTS}:succeed", 2, tmp_path / name, workdir=ROOT)
        return Controller(
            client, reconciler, gateway_url=gateway_url, poll_interval_s=poll_interval_s,
            lease_ttl_s=1.0,
        )  # fmt: skip

    first, second = idle_controller("first", 30.0), idle_controller("second", 0.1)
    async with running(first):
        await wait_for(lambda: first.stats.passes > 0, what="the first controller's pass")
        async with running(second):
            # Four lease lifetimes while the first one idles between its passes.
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                assert second.stats.passes == 0, "the second controller took the lease"
                await asyncio.sleep(0.05)
        assert first.stats.passes == 1  # still idle: its lease renewed without passes


async def test_a_controller_that_lost_its_lease_mid_action_has_its_late_writes_refused(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    """A paused between its lease check and its report of an agent's end; B took the lease,
    reported A's attempt 1 lost and launched attempt 2. A resumed and reported attempt 1
    succeeded: the gateway stored it and marked the rollout succeeded while B's agent still
    ran (two controllers acting on one rollout). The gateway now refuses A's write (its lease
    is B's), and A stops."""
    reconciler = LogPausingReconciler(f"{AGENTS}:succeed", 2, tmp_path / "a", workdir=ROOT)
    first = Controller(
        client, reconciler, gateway_url=gateway_url, poll_interval_s=0.1, lease_ttl_s=1.0
    )
    go = tmp_path / "go"
    other_agent = (
        f"while [ ! -e {go} ]; do sleep 0.05; done; "
        f"{sys.executable} -c 'from reins.agent import report_reward; report_reward(0.5)'"
    )
    other: subprocess.Popen[bytes] | None = None

    async def other_runs_attempt_2() -> None:
        assert other is not None
        async with GatewayClient(gateway_url, ADMIN_KEY) as gateway:
            deadline = time.monotonic() + 60
            while (await gateway.get_rollout("r")).rollout.attempt_count < 2:
                assert time.monotonic() < deadline, "the other controller never took over"
                assert other.poll() is None, "the other controller ended"
                await asyncio.sleep(0.1)

    stop = asyncio.Event()
    try:
        task = asyncio.create_task(first.run(stop))
        await wait_for(lambda: first.stats.passes > 0, what="the first controller's pass")
        other = start_cli_controller(gateway_url, tmp_path / "b", other_agent)
        reconciler.pause = lambda: in_another_thread(other_runs_attempt_2)
        await client.create_rollouts([RolloutSpec(rollout_id="r", input={})])
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(task, 60)
        assert first.stats.succeeded == 0
        rollout = (await client.get_rollout("r")).rollout
        assert (rollout.status.state, rollout.attempt_count) == ("running", 2)
        go.touch()
        rollout = (await wait_terminal(client, ["r"]))["r"]
    finally:
        stop.set()
        if other is not None and other.poll() is None:
            other.send_signal(signal.SIGTERM)
            other.wait(60)
    assert (rollout.status.state, rollout.attempt_count) == ("succeeded", 2)
    logs = await client.get_events("r", all_attempts=True, types=[AGENT_LOG])
    assert [(e.attempt_id, e.data["outcome"]) for e in logs] == [(1, "lost"), (2, "succeeded")]


async def test_a_controller_whose_write_is_refused_renews_its_lease_at_once(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    """The lease was released from under the controller (by its holder's name: an operator, a
    stale process of the same holder), so the gateway refused its next write. It then waited
    for its regular renewal (up to a third of the lease's time), its passes spinning meanwhile,
    each action stopping at once. It now renews at once, reads the rollouts again under its
    new grant, and reports the end."""
    go = tmp_path / "go"
    reconciler = LocalReconciler(
        f"while [ ! -e {go} ]; do sleep 0.05; done", 2, tmp_path / "a", workdir=ROOT
    )
    controller = Controller(client, reconciler, gateway_url=gateway_url, poll_interval_s=0.1)
    async with running(controller):
        await client.create_rollouts([RolloutSpec(rollout_id="r", input={})])
        await wait_for(lambda: ("r", 1) in controller._recorded, what="the agent's launch")
        renewed = controller._lease_renewed
        await wait_for(lambda: controller._lease_renewed != renewed, what="a renewal")
        assert await client.release_lease("controller", reconciler.lease_holder)
        passes = controller.stats.passes
        go.touch()  # the agent ends: its report is refused, the lease being nobody's
        rollout = (await wait_terminal(client, ["r"]))["r"]
        assert controller.stats.passes - passes <= 10, "its passes spun, the lease not renewed"
    assert (rollout.status.state, rollout.attempt_count) == ("succeeded", 1)
    launches = await client.get_events("r", all_attempts=True, types=[AGENT_LAUNCH])
    assert len(launches) == 1
