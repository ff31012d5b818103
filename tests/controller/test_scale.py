"""200 rollouts through `reins controller --runner local`, killed (SIGKILL) and restarted midway."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from reins.client import GatewayClient
from reins.schemas import AGENT_LAUNCH, AGENT_LOG, REWARD, RolloutSpec
from tests.controller.conftest import wait_for, wait_terminal
from tests.controller.test_local import AGENTS, alive, start_cli_controller
from tests.support import running_gateway

ROLLOUTS = 200
PARALLEL = 8


def running_agents(log_dir: Path) -> list[int]:
    """Wrapper pids of agents alive now (a `pid` file, no `exit` file, a live process)."""
    pids = []
    for pid_file in log_dir.glob("*/attempt-*/pid"):
        if not (pid_file.parent / "exit").exists():
            pid = int(pid_file.read_text())
            if alive(pid):
                pids.append(pid)
    return pids


@pytest.mark.slow
async def test_200_rollouts_with_crashes_survive_a_controller_kill(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    log_dir = tmp_path / "agents"
    crashing = {f"r-{i:03d}" for i in range(ROLLOUTS) if i % 3 == 0}
    with running_gateway(str(tmp_path / "gateway.db")) as gateway:
        async with GatewayClient(gateway.url, gateway.api_key) as client:
            ids = [f"r-{i:03d}" for i in range(ROLLOUTS)]
            await client.create_rollouts(
                [
                    RolloutSpec(
                        rollout_id=rid,
                        input={"markers": str(markers), "crash": rid in crashing, "sleep": 0.2},
                    )
                    for rid in ids
                ]
            )
            started = time.monotonic()
            first = start_cli_controller(gateway.url, log_dir, f"{AGENTS}:scale", PARALLEL)

            async def progressed() -> bool:
                page = await client.list_rollouts(states=["succeeded"], limit=1000)
                return len(page.items) >= ROLLOUTS // 3

            try:
                await wait_for(progressed, timeout_s=180, what="a third of the rollouts")
                await wait_for(lambda: running_agents(log_dir), what="agents running")
                # Taken just before the kill: a 0.2 s agent may end before `wait` returns, and
                # what matters is that the first controller died with agents in flight.
                orphans = running_agents(log_dir)
            finally:
                os.kill(first.pid, signal.SIGKILL)
                first.wait(timeout=30)

            second = start_cli_controller(gateway.url, log_dir, f"{AGENTS}:scale", PARALLEL)
            try:
                rollouts = await wait_terminal(client, ids, timeout_s=240)
            finally:
                second.send_signal(signal.SIGTERM)
                assert second.wait(timeout=30) == 0
            wall_s = time.monotonic() - started

            assert {r.status.state for r in rollouts.values()} == {"succeeded"}
            launches = 0
            for rid in ids:
                attempts = (await client.get_rollout(rid)).attempts
                expected = 2 if rid in crashing else 1
                assert [a.state for a in attempts] == ["failed"] * (expected - 1) + ["succeeded"]
                if rid in crashing:
                    assert attempts[0].reason is not None
                    assert "exited with status 3" in attempts[0].reason
                events = await client.get_events(rid, all_attempts=True)
                for attempt in attempts:
                    mine = [e.type for e in events if e.attempt_id == attempt.attempt_id]
                    assert mine.count(AGENT_LAUNCH) == 1 and mine.count(AGENT_LOG) == 1
                assert [e.attempt_id for e in events if e.type == REWARD] == [expected]
                launches += expected

    assert not (markers / "DUPLICATES").exists(), "an attempt was launched twice"
    assert len(list(markers.iterdir())) == launches == ROLLOUTS + len(crashing)
    assert orphans, "the kill should have left agents in flight for the new controller to adopt"
    print(
        f"\n{ROLLOUTS} rollouts ({len(crashing)} crashing once), {PARALLEL} at a time, "
        f"controller killed once with {len(orphans)} agents running: {wall_s:.1f} s"
    )
    await asyncio.sleep(0)
