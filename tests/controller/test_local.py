"""The controller with `LocalReconciler`: real gateway, real agent processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from reins.client import GatewayClient
from reins.controller import Controller, LocalReconciler
from reins.gateway import GatewaySettings
from reins.schemas import AGENT_LAUNCH, AGENT_LOG, REWARD, RolloutConfig, RolloutSpec
from tests.conftest import ADMIN_KEY, serve
from tests.controller.conftest import ROOT, running, stop_dead, wait_for, wait_terminal
from tests.support import GatewayProcess, PostgresServer, alive, free_port

AGENTS = "tests.controller.agents"


def controller(
    client: GatewayClient,
    gateway_url: str,
    log_dir: Path,
    agent: str = f"{AGENTS}:succeed",
    *,
    max_parallel: int = 4,
    max_attempts: int = 3,
    timeout_s: float | None = None,
) -> Controller:
    reconciler = LocalReconciler(agent, max_parallel, log_dir, workdir=ROOT, kill_grace_s=0.5)
    return Controller(
        client,
        reconciler,
        gateway_url=gateway_url,
        max_attempts=max_attempts,
        default_timeout_s=timeout_s,
        poll_interval_s=0.1,
    )


def start_cli_controller(
    gateway_url: str, log_dir: Path, agent: str, max_parallel: int = 4, *flags: str
) -> subprocess.Popen[bytes]:
    """`reins controller --runner local` as a user starts it, in its own process."""
    return subprocess.Popen(
        [
            sys.executable, "-m", "reins.cli", "controller", "--runner", "local",
            "--gateway", gateway_url, "--api-key", ADMIN_KEY, "--agent", agent,
            "--max-parallel", str(max_parallel), "--log-dir", str(log_dir),
            "--poll-interval", "0.1", *flags,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=(log_dir.parent / "controller.log").open("ab"),
    )  # fmt: skip


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def test_agent_gets_its_environment_and_its_return_value_becomes_the_reward(
    client: GatewayClient, gateway_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REINS_API_KEY", "the-admin-key-must-not-leak")
    out = tmp_path / "env.json"
    task = {"out": str(out), "nested": [1, {"a": "b"}]}
    await client.create_rollouts([RolloutSpec(rollout_id="r-env", input=task, mode="val")])
    async with running(controller(client, gateway_url, tmp_path / "logs", f"{AGENTS}:record_env")):
        rollouts = await wait_terminal(client, ["r-env"])

    assert rollouts["r-env"].status.state == "succeeded"
    detail = await client.get_rollout("r-env")
    (attempt,) = detail.attempts
    seen = json.loads(out.read_text())
    env = seen["env"]
    assert env["OPENAI_BASE_URL"] == (
        f"{gateway_url}/proxy/rollout/r-env/attempt/1/mode/val/openai/v1"
    )
    assert env["OPENAI_API_KEY"] == attempt.token
    assert env["ANTHROPIC_BASE_URL"] == (
        f"{gateway_url}/proxy/rollout/r-env/attempt/1/mode/val/anthropic"
    )
    assert env["ANTHROPIC_AUTH_TOKEN"] == env["ANTHROPIC_API_KEY"] == attempt.token
    assert env["REINS_GATEWAY_URL"] == gateway_url
    assert (env["REINS_ROLLOUT_ID"], env["REINS_ATTEMPT_ID"], env["REINS_MODE"]) == (
        "r-env",
        "1",
        "val",
    )
    assert json.loads(env["REINS_INPUT"]) == task == seen["context_input"]
    assert "REINS_API_KEY" not in env  # agents hold their scoped token, never the admin key
    assert seen["cwd"] == str(ROOT)

    events = await client.get_events("r-env")
    # The controller records the launch once the agent runs, so a quick agent's reward can come
    # first; the log comes once the agent has exited, after both.
    assert sorted(e.type for e in events[:2]) == sorted([AGENT_LAUNCH, REWARD])
    assert events[2].type == AGENT_LOG and len(events) == 3
    (reward,) = [e for e in events if e.type == REWARD]
    assert reward.data == {"value": 1.0, "source": "agent"}
    agent_log = events[2].data
    assert agent_log["outcome"] == "succeeded" and agent_log["exit_code"] == 0
    assert agent_log["path"] == str((tmp_path / "logs/r-env/attempt-1/agent.log").resolve())


async def test_a_crash_opens_a_new_attempt_and_keeps_the_log(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    await client.create_rollouts([RolloutSpec(rollout_id="r-crash", input={})])
    async with running(controller(client, gateway_url, tmp_path / "logs", f"{AGENTS}:crash_once")):
        rollouts = await wait_terminal(client, ["r-crash"])

    assert rollouts["r-crash"].status.state == "succeeded"
    first, second = (await client.get_rollout("r-crash")).attempts
    assert first.state == "failed" and second.state == "succeeded"
    assert first.reason is not None
    assert "attempt 1 of 3: the agent exited with status 1" in first.reason
    (crash_log,) = await client.get_events("r-crash", attempt_id=1, types=[AGENT_LOG])
    assert crash_log.data["outcome"] == "crashed" and crash_log.data["exit_code"] == 1
    assert "RuntimeError: the first attempt crashes on purpose" in crash_log.data["tail"]
    assert "working on it" in await asyncio.to_thread(Path(crash_log.data["path"]).read_text)


async def test_a_command_line_agent_fails_the_rollout_after_max_attempts(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    failing = "echo nope from $REINS_ROLLOUT_ID >&2; exit 7"
    await client.create_rollouts(
        [
            RolloutSpec(rollout_id="r-ok", input={}, config=RolloutConfig(agent="exit 0")),
            RolloutSpec(rollout_id="r-bad", input={}, config=RolloutConfig(agent=failing)),
        ]
    )
    # The controller's own agent would fail: the rollouts' config.agent must win.
    async with running(
        controller(client, gateway_url, tmp_path / "logs", "exit 99", max_attempts=2)
    ):
        rollouts = await wait_terminal(client, ["r-ok", "r-bad"])

    assert rollouts["r-ok"].status.state == "succeeded"
    bad = rollouts["r-bad"]
    assert bad.status.state == "failed" and bad.attempt_count == 2
    assert bad.status.reason is not None
    assert "attempt 2 of 2: the agent exited with status 7" in bad.status.reason
    logs = await client.get_events("r-bad", all_attempts=True, types=[AGENT_LOG])
    assert [(e.attempt_id, e.data["exit_code"]) for e in logs] == [(1, 7), (2, 7)]
    assert all("nope from r-bad" in e.data["tail"] for e in logs)


async def test_a_timeout_kills_the_whole_process_group(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    await client.create_rollouts(
        [
            RolloutSpec(
                rollout_id="r-slow",
                input={"pid_file": str(pid_file)},
                config=RolloutConfig(timeout_s=1.5),
            )
        ]
    )
    agent = f"{AGENTS}:spawn_and_hang"
    async with running(controller(client, gateway_url, tmp_path / "logs", agent, max_attempts=1)):
        rollouts = await wait_terminal(client, ["r-slow"])

    rollout = rollouts["r-slow"]
    assert rollout.status.state == "failed"
    assert rollout.status.reason is not None and "timed out after 1.5 s" in rollout.status.reason
    agent_pid, grandchild_pid = map(int, pid_file.read_text().split())
    assert not alive(agent_pid) and not alive(grandchild_pid)
    (agent_log,) = await client.get_events("r-slow", types=[AGENT_LOG])
    assert agent_log.data["outcome"] == "timeout" and agent_log.data["exit_code"] is None
    assert "hanging" in agent_log.data["tail"]


@pytest.mark.parametrize(
    ("kind", "function"),
    [
        ("command", None),
        ("plain", "hang"),
        ("zygote", "hang"),
        ("plain", "hang_in_try"),
        ("zygote", "hang_in_try"),
    ],
)
async def test_an_agent_gets_its_grace_after_sigterm_whatever_runs_it(
    client: GatewayClient, gateway_url: str, tmp_path: Path, kind: str, function: str | None
) -> None:
    """SIGTERM, then SIGKILL after `kill_grace_s`: a command's `sh` wrapper died of the SIGTERM
    at once and its group was SIGKILLed then, the agent's cleanup cut short. An agent function
    with no handler of its own gets its `finally` run (Python's SIGTERM skipped it: the
    examples' temporary folders were left behind)."""
    cleaned = tmp_path / "cleaned"
    spec = RolloutSpec(
        rollout_id=f"r-grace-{kind}",
        input={"file": str(cleaned)},
        config=RolloutConfig(timeout_s=2),
    )
    await client.create_rollouts([spec])
    agent = (
        f"{sys.executable} {ROOT / 'tests/controller/graceful_agent.py'} {cleaned}"
        if kind == "command"
        else f"tests.controller.graceful_agent:{function}"
    )
    reconciler = LocalReconciler(
        agent, 2, tmp_path / "logs", workdir=ROOT, kill_grace_s=5, preload=kind == "zygote"
    )
    ctl = Controller(
        client, reconciler, gateway_url=gateway_url, max_attempts=1, poll_interval_s=0.1
    )
    async with running(ctl):
        rollouts = await wait_terminal(client, [spec.rollout_id])
    assert rollouts[spec.rollout_id].status.state == "failed"  # timed out
    assert cleaned.read_text() == "cleaned up"


@pytest.mark.parametrize("preload", [True, False], ids=["zygote", "plain"])
@pytest.mark.parametrize("then", ["exit", "hang"])
async def test_processes_that_left_the_group_end_with_the_attempt(
    client: GatewayClient, gateway_url: str, tmp_path: Path, preload: bool, then: str
) -> None:
    """A tool started in its own session and daemons (double fork, setsid; one forked by
    Python without an exec) are outside the attempt's process group: found by the attempt's
    mark in their environment, they end when the agent exits, and on a timeout."""
    pid_file = tmp_path / "pids"
    timeout = RolloutConfig(timeout_s=5.0 if then == "hang" else None)
    spec = RolloutSpec(
        rollout_id="r-escape", input={"pid_file": str(pid_file), "then": then}, config=timeout
    )
    await client.create_rollouts([spec])
    reconciler = LocalReconciler(
        f"{AGENTS}:escape", 4, tmp_path / "logs", workdir=ROOT, kill_grace_s=0.5, preload=preload
    )
    ctl = Controller(
        client, reconciler, gateway_url=gateway_url, max_attempts=1, poll_interval_s=0.1
    )
    try:
        async with running(ctl):
            rollouts = await wait_terminal(client, ["r-escape"])
        expected = "succeeded" if then == "exit" else "failed"
        assert rollouts["r-escape"].status.state == expected
        pids = json.loads(pid_file.read_text())
        assert pids["daemon_parent"] != pids["agent"]  # the daemon is no descendant of it
        left = ("tool", "daemon", "python_daemon")
        ended = lambda: not any(alive(pids[name]) for name in left)  # noqa: E731
        await wait_for(ended, what="the end of what left the group", timeout_s=10)
    finally:
        if pid_file.exists():
            for name in ("tool", "daemon", "python_daemon"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(json.loads(pid_file.read_text())[name], signal.SIGKILL)


async def test_async_functions_self_reports_and_bad_return_values(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    specs = {
        "r-async": f"{AGENTS}:succeed_async",
        "r-self": f"{AGENTS}:report_itself",
        "r-text": f"{AGENTS}:return_text",
        "r-missing": f"{AGENTS}:no_such_function",
    }
    await client.create_rollouts(
        [
            RolloutSpec(rollout_id=rid, input={}, config=RolloutConfig(agent=agent))
            for rid, agent in specs.items()
        ]
    )
    async with running(controller(client, gateway_url, tmp_path / "logs", max_attempts=1)):
        rollouts = await wait_terminal(client, specs)

    rewards = {rid: [e.data for e in await client.get_events(rid, types=[REWARD])] for rid in specs}
    assert rollouts["r-async"].status.state == "succeeded"
    assert rewards["r-async"] == [{"value": 0.5, "source": "agent"}]
    assert rollouts["r-self"].status.state == "succeeded"
    assert rewards["r-self"] == [
        {"value": 0.25, "source": "agent", "reason": "graded by the agent"}
    ]
    for rid, says in (("r-text", "return a number"), ("r-missing", "cannot load agent")):
        assert rollouts[rid].status.state == "failed" and rewards[rid] == []
        (agent_log,) = await client.get_events(rid, types=[AGENT_LOG])
        assert says in agent_log.data["tail"]


@pytest.mark.parametrize("preload", [True, False], ids=["forked", "fresh"])
async def test_a_numpy_number_returned_is_the_reward(
    client: GatewayClient, gateway_url: str, tmp_path: Path, preload: bool
) -> None:
    """A reward computed with numpy (`np.int64`, `np.float32`) was refused as "not a number":
    the attempt crashed and its rollout failed with no reward."""
    specs = {
        "r-np-int": (f"{AGENTS}:return_numpy_int", 2.0),
        "r-np-f32": (f"{AGENTS}:return_numpy_float32", 0.5),
    }
    await client.create_rollouts(
        [
            RolloutSpec(rollout_id=rid, input={}, config=RolloutConfig(agent=agent))
            for rid, (agent, _) in specs.items()
        ]
    )
    reconciler = LocalReconciler(
        f"{AGENTS}:succeed", 2, tmp_path / "logs", workdir=ROOT, preload=preload
    )
    ctl = Controller(client, reconciler, gateway_url=gateway_url, max_attempts=1)
    async with running(ctl):
        rollouts = await wait_terminal(client, specs)
    for rid, (_, reward) in specs.items():
        assert rollouts[rid].status.state == "succeeded", rollouts[rid].status.reason
        events = await client.get_events(rid, types=[REWARD])
        assert [e.data for e in events] == [{"value": reward, "source": "agent"}]


async def test_no_more_agents_run_at_once_than_max_parallel(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "intervals"
    ids = [f"r-{i}" for i in range(5)]
    await client.create_rollouts(
        [RolloutSpec(rollout_id=rid, input={"sleep": 0.3, "log": str(log)}) for rid in ids]
    )
    async with running(
        controller(client, gateway_url, tmp_path / "logs", f"{AGENTS}:timed", max_parallel=2)
    ):
        rollouts = await wait_terminal(client, ids)

    assert {r.status.state for r in rollouts.values()} == {"succeeded"}
    intervals = [tuple(map(float, line.split())) for line in log.read_text().splitlines()]
    assert len(intervals) == 5
    overlap = max(sum(1 for s, e in intervals if s <= t < e) for t, _ in intervals)
    assert overlap <= 2


async def test_an_agent_whose_rollout_ends_at_the_gateway_is_killed(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    await client.create_rollouts(
        [RolloutSpec(rollout_id="r-cancel", input={"pid_file": str(pid_file)})]
    )
    ctl = controller(client, gateway_url, tmp_path / "logs", f"{AGENTS}:spawn_and_hang")
    async with running(ctl):
        await wait_for(pid_file.exists, what="the agent starting")
        agent_pid, grandchild_pid = map(int, pid_file.read_text().split())
        await client.set_status("r-cancel", "failed", reason="cancelled by the trainer")
        await wait_for(lambda: not alive(agent_pid) and not alive(grandchild_pid), what="the kill")
        await wait_for(lambda: ctl.stats.removed == 1, what="the removal")
    rollout = (await client.get_rollout("r-cancel")).rollout
    assert rollout.status.reason == "cancelled by the trainer" and rollout.attempt_count == 1


async def test_stopping_the_controller_kills_its_agents(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    await client.create_rollouts(
        [RolloutSpec(rollout_id="r-stop", input={"pid_file": str(pid_file)})]
    )
    async with running(
        controller(client, gateway_url, tmp_path / "logs", f"{AGENTS}:spawn_and_hang")
    ):
        await wait_for(pid_file.exists, what="the agent starting")
    agent_pid, grandchild_pid = map(int, pid_file.read_text().split())
    assert not alive(agent_pid) and not alive(grandchild_pid)
    exit_file = tmp_path / "logs/r-stop/attempt-1/exit"
    assert exit_file.read_text().strip() == "stopped"


async def test_a_new_controller_adopts_running_agents_and_launches_nothing_twice(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "intervals"
    ids = [f"r-{i}" for i in range(3)]
    await client.create_rollouts(
        [RolloutSpec(rollout_id=rid, input={"sleep": 1.5, "log": str(log)}) for rid in ids]
    )
    first = controller(client, gateway_url, tmp_path / "logs", f"{AGENTS}:timed")
    await first.reconcile_once()
    await first.wait_idle()
    assert first.stats.launched == 3
    stop_dead(first)  # no shutdown: its agents keep running
    second = controller(client, gateway_url, tmp_path / "logs", f"{AGENTS}:timed")
    async with running(second):
        rollouts = await wait_terminal(client, ids)

    assert second.stats.adopted == 3 and second.stats.launched == 0
    for rid in ids:
        assert rollouts[rid].status.state == "succeeded" and rollouts[rid].attempt_count == 1
        assert len(await client.get_events(rid, types=[AGENT_LAUNCH])) == 1
    assert len(log.read_text().splitlines()) == 3


async def test_a_second_controller_on_a_live_controllers_log_folder_is_refused(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    """Both were one holder of the gateway's controller lease (it names the folder): the second
    launched every rollout again, adopted the first one's agents and killed them on its stop."""
    log = tmp_path / "intervals"
    await client.create_rollouts(
        [RolloutSpec(rollout_id="r", input={"sleep": 1.5, "log": str(log)})]
    )
    first = controller(client, gateway_url, tmp_path / "logs", f"{AGENTS}:timed")
    await first.reconcile_once()
    second = controller(client, gateway_url, tmp_path / "logs", f"{AGENTS}:timed")
    with pytest.raises(
        ValueError, match=r"another controller \(pid \d+ on .*\) uses the log folder"
    ):
        await asyncio.wait_for(second.run(), 30)
    async with running(first):
        rollouts = await wait_terminal(client, ["r"])
    assert rollouts["r"].status.state == "succeeded" and rollouts["r"].attempt_count == 1
    assert len(log.read_text().splitlines()) == 1
    # Once the first one has stopped, the folder is free.
    third = controller(client, gateway_url, tmp_path / "logs", f"{AGENTS}:timed")
    await third.start()
    await third.close()


async def test_an_agent_that_vanished_while_no_controller_ran_is_retried(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    """Its `sh` wrapper killed with it, nothing saw how it ended (a forked agent's zygote would
    have: the next test)."""
    pid_file = tmp_path / "pids"
    task = {"pid_file": str(pid_file), "only_first": True}
    await client.create_rollouts([RolloutSpec(rollout_id="r-lost", input=task)])
    log_dir = tmp_path / "logs"
    agent = f"{AGENTS}:spawn_and_hang"
    first = start_cli_controller(gateway_url, log_dir, agent, 4, "--no-preload")
    try:
        await wait_for(pid_file.exists, what="the agent starting")
    finally:
        os.kill(first.pid, signal.SIGKILL)  # the controller dies: nobody watches its agent
        first.wait(timeout=30)
    wrapper_pid = int((log_dir / "r-lost/attempt-1/pid").read_text())
    os.killpg(wrapper_pid, signal.SIGKILL)  # and the agent dies without an exit status
    await wait_for(lambda: not alive(wrapper_pid), what="the kill")

    second = controller(client, gateway_url, log_dir, f"{AGENTS}:spawn_and_hang")
    async with running(second):
        rollouts = await wait_terminal(client, ["r-lost"])

    assert rollouts["r-lost"].status.state == "succeeded"
    first_attempt, second_attempt = (await client.get_rollout("r-lost")).attempts
    assert first_attempt.reason is not None and "left no exit status" in first_attempt.reason
    assert second_attempt.state == "succeeded"
    (lost_log,) = await client.get_events("r-lost", attempt_id=1, types=[AGENT_LOG])
    assert lost_log.data["outcome"] == "lost"


async def test_a_forked_agent_killed_after_its_controller_died_keeps_its_exit_status(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    """The dead controller's zygote stays until its last agent has ended: one killed by a signal
    meanwhile (it writes no `exit` itself) gets its real status, not `lost`."""
    pid_file = tmp_path / "pids"
    task = {"pid_file": str(pid_file), "only_first": True}
    await client.create_rollouts([RolloutSpec(rollout_id="r-orphan", input=task)])
    log_dir = tmp_path / "logs"
    folder = log_dir / "r-orphan/attempt-1"
    first = start_cli_controller(gateway_url, log_dir, f"{AGENTS}:spawn_and_hang")
    try:
        await wait_for(pid_file.exists, what="the agent starting")
        agent_pid = int((folder / "pid").read_text())
        zygote_pid = parent_of(agent_pid)
    finally:
        os.kill(first.pid, signal.SIGKILL)  # its zygote's stdin closes
        first.wait(timeout=30)
    assert (folder / "pid.start").read_text().strip()  # forked from the zygote
    os.killpg(agent_pid, signal.SIGKILL)
    await wait_for(lambda: (folder / "exit").exists(), what="the agent's exit status")
    assert (folder / "exit").read_text().strip() == "137"
    await wait_for(lambda: not alive(zygote_pid), what="the zygote's end after its last agent")

    async with running(controller(client, gateway_url, log_dir, f"{AGENTS}:spawn_and_hang")):
        rollouts = await wait_terminal(client, ["r-orphan"])
    assert rollouts["r-orphan"].status.state == "succeeded"
    first_attempt, _ = (await client.get_rollout("r-orphan")).attempts
    assert "the agent exited with status 137" in (first_attempt.reason or "")
    [report] = await client.get_events("r-orphan", attempt_id=1, types=[AGENT_LOG])
    assert (report.data["outcome"], report.data["exit_code"]) == ("crashed", 137)


async def test_a_forked_agent_that_outlived_its_killed_zygote_is_lost_saying_why(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    """A killed zygote cannot record how its agents end, and nothing else can see it."""
    pid_file = tmp_path / "pids"
    task = {"pid_file": str(pid_file), "only_first": True}
    await client.create_rollouts([RolloutSpec(rollout_id="r-no-zygote", input=task)])
    ctl = controller(client, gateway_url, tmp_path / "logs", f"{AGENTS}:spawn_and_hang")
    async with running(ctl):
        await wait_for(pid_file.exists, what="the agent starting")
        zygote = ctl.reconciler._zygotes[f"{AGENTS}:spawn_and_hang"].process  # type: ignore[attr-defined]
        assert zygote is not None
        zygote.kill()
        await zygote.wait()
        os.killpg(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        rollouts = await wait_terminal(client, ["r-no-zygote"])
    assert rollouts["r-no-zygote"].status.state == "succeeded"
    first_attempt, _ = (await client.get_rollout("r-no-zygote")).attempts
    assert "left no exit status; its zygote, which alone could see how it ended, was gone" in (
        first_attempt.reason or ""
    )
    [report] = await client.get_events("r-no-zygote", attempt_id=1, types=[AGENT_LOG])
    assert report.data["outcome"] == "lost"


async def test_an_attempt_opened_but_never_launched_is_launched_once(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    await client.create_rollouts([RolloutSpec(rollout_id="r-open", input={})])
    await client.open_attempt("r-open", attempt_id=1)  # a controller that stopped right here
    async with running(controller(client, gateway_url, tmp_path / "logs")) as ctl:
        rollouts = await wait_terminal(client, ["r-open"])
    assert rollouts["r-open"].status.state == "succeeded"
    assert rollouts["r-open"].attempt_count == 1
    assert ctl.stats.launched == 1


async def test_an_input_too_large_for_the_environment_fails_with_the_reason(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    await client.create_rollouts([RolloutSpec(rollout_id="r-big", input={"blob": "x" * 200_000})])
    async with running(controller(client, gateway_url, tmp_path / "logs")):
        rollouts = await wait_terminal(client, ["r-big"])
    reason = rollouts["r-big"].status.reason
    assert rollouts["r-big"].status.state == "failed"
    assert reason is not None and "REINS_INPUT" in reason and "131059 bytes" in reason


async def test_an_idle_controller_only_polls(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    ctl = controller(client, gateway_url, tmp_path / "logs")
    async with running(ctl):
        await asyncio.sleep(1.0)
    assert ctl.stats.launched == 0 and ctl.stats.errors == 0
    assert ctl.stats.passes <= 1.0 / ctl.poll_interval_s + 2


async def test_files_left_by_an_older_rollout_with_the_same_id_are_set_aside(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    log_dir = tmp_path / "logs"
    older = GatewaySettings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'older.db'}", api_key=ADMIN_KEY
    )
    with serve(older) as server:  # another gateway database, the same rollout id, one log dir
        older_url = f"http://127.0.0.1:{server.port}"
        async with GatewayClient(older_url, ADMIN_KEY) as older_client:
            await older_client.create_rollouts(
                [RolloutSpec(rollout_id="r-same", input={}, config=RolloutConfig(agent="exit 0"))]
            )
            async with running(controller(older_client, older_url, log_dir)):
                await wait_terminal(older_client, ["r-same"])

    marker = tmp_path / "ran"
    agent = f"touch {marker}; exit 5"
    await client.create_rollouts(
        [RolloutSpec(rollout_id="r-same", input={}, config=RolloutConfig(agent=agent))]
    )
    async with running(controller(client, gateway_url, log_dir, max_attempts=1)):
        rollouts = await wait_terminal(client, ["r-same"])

    # Its own agent ran; the older rollout's success was not reported for it.
    assert rollouts["r-same"].status.state == "failed" and marker.exists()
    assert [p.name.split(".")[0] for p in (log_dir / "r-same").iterdir()] == ["attempt-1"] * 2


def test_the_command_says_what_is_missing() -> None:
    base = [sys.executable, "-m", "reins.cli", "controller", "--gateway", "http://127.0.0.1:9"]
    for args, says in (
        (["--runner", "local", "--api-key", "k"], "--agent is required with --runner local"),
        (["--runner", "kubernetes", "--api-key", "k"], "pass --set image=..."),
    ):
        done = subprocess.run(base + args, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and says in done.stderr


async def test_function_agents_fork_from_a_preloaded_zygote(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    ids = ["r-z1", "r-z2"]
    await client.create_rollouts([RolloutSpec(rollout_id=rid, input={}) for rid in ids])
    ctl = controller(client, gateway_url, tmp_path / "logs")
    async with running(ctl):
        rollouts = await wait_terminal(client, ids)
        zygote = ctl.reconciler._zygotes[f"{AGENTS}:succeed"].process  # type: ignore[attr-defined]
        assert zygote is not None and zygote.returncode is None  # one zygote served both
    assert all(rollouts[rid].status.state == "succeeded" for rid in ids)
    for rid in ids:
        folder = tmp_path / "logs" / rid / "attempt-1"
        assert (folder / "pid.start").read_text().strip()  # forked: identified by start time
        assert (folder / "exit").read_text().strip() == "0"


async def test_a_module_that_prints_when_imported_does_not_break_its_zygote(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    ids = ["r-noisy1", "r-noisy2"]
    await client.create_rollouts([RolloutSpec(rollout_id=rid, input={}) for rid in ids])
    ctl = controller(client, gateway_url, tmp_path / "logs", "tests.controller.noisy_agent:succeed")
    async with running(ctl):
        rollouts = await wait_terminal(client, ids, timeout_s=60)
    assert {rid: rollouts[rid].status.state for rid in ids} == dict.fromkeys(ids, "succeeded")
    for rid in ids:
        folder = tmp_path / "logs" / rid / "attempt-1"
        assert (folder / "pid.start").read_text().strip()  # forked from the zygote
        assert (folder / "agent.log").read_text() == "and the agent prints too\n"
    assert "prints a banner" in (tmp_path / "logs" / "zygote.log").read_text()


async def test_without_preload_function_agents_run_in_a_fresh_interpreter(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    await client.create_rollouts([RolloutSpec(rollout_id="r-plain", input={})])
    reconciler = LocalReconciler(
        f"{AGENTS}:succeed", 2, tmp_path / "logs", workdir=ROOT, preload=False
    )
    ctl = Controller(client, reconciler, gateway_url=gateway_url, poll_interval_s=0.1)
    async with running(ctl):
        rollouts = await wait_terminal(client, ["r-plain"])
    assert rollouts["r-plain"].status.state == "succeeded"
    assert not (tmp_path / "logs/r-plain/attempt-1/pid.start").exists()


@pytest.mark.parametrize("preload", [True, False], ids=["forked", "fresh"])
async def test_an_agent_ends_as_a_fresh_interpreter_does_after_its_threads_and_atexit(
    client: GatewayClient, gateway_url: str, tmp_path: Path, preload: bool
) -> None:
    """A forked agent ended at once when its function returned: a reward reported from a
    thread was lost (the rollout succeeded without one) and `atexit` never ran."""
    rid = f"r-thread-{preload}"
    marker = tmp_path / "atexit"
    await client.create_rollouts([RolloutSpec(rollout_id=rid, input={"atexit_file": str(marker)})])
    reconciler = LocalReconciler(
        f"{AGENTS}:report_from_a_thread", 2, tmp_path / "logs", workdir=ROOT, preload=preload
    )
    ctl = Controller(client, reconciler, gateway_url=gateway_url, poll_interval_s=0.1)
    async with running(ctl):
        rollouts = await wait_terminal(client, [rid])
    assert rollouts[rid].status.state == "succeeded"
    rewards = await client.get_events(rid, types=["reward"])
    assert [event.data["value"] for event in rewards] == [0.75]
    assert marker.read_text() == "ran"


async def test_a_forked_agent_does_not_run_its_zygotes_atexit_functions(
    client: GatewayClient, gateway_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registered when the zygote imported the module: each of its children ran them too (a
    module's cleanup of what it made, at every attempt's end)."""
    record = tmp_path / "atexit"
    monkeypatch.setenv("REINS_TEST_ATEXIT_RECORD", str(record))
    ids = ["r-atexit-1", "r-atexit-2"]
    await client.create_rollouts([RolloutSpec(rollout_id=rid, input={}) for rid in ids])
    reconciler = LocalReconciler(
        "tests.controller.atexit_agent:succeed", 2, tmp_path / "logs", workdir=ROOT
    )
    ctl = Controller(client, reconciler, gateway_url=gateway_url, poll_interval_s=0.1)
    async with running(ctl):
        rollouts = await wait_terminal(client, ids)
    assert {rollouts[rid].status.state for rid in ids} == {"succeeded"}
    agents = {int((tmp_path / "logs" / rid / "attempt-1" / "pid").read_text()) for rid in ids}
    ran = {int(line) for line in record.read_text().split()} if record.exists() else set()
    assert not ran & agents


@pytest.mark.parametrize("preload", [True, False], ids=["forked", "fresh"])
async def test_sys_exit_in_an_agent_is_its_exit_status(
    client: GatewayClient, gateway_url: str, tmp_path: Path, preload: bool
) -> None:
    rid = f"r-exit-{preload}"
    await client.create_rollouts([RolloutSpec(rollout_id=rid, input={"status": 5})])
    reconciler = LocalReconciler(
        f"{AGENTS}:exit_with", 2, tmp_path / "logs", workdir=ROOT, preload=preload
    )
    ctl = Controller(
        client, reconciler, gateway_url=gateway_url, max_attempts=1, poll_interval_s=0.1
    )
    async with running(ctl):
        rollouts = await wait_terminal(client, [rid])
    reason = rollouts[rid].status.reason
    assert reason is not None and "the agent exited with status 5" in reason
    assert (tmp_path / "logs" / rid / "attempt-1" / "exit").read_text().strip() == "5"


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux-only")
async def test_a_pidfd_wakes_the_watch_when_the_agent_exits() -> None:
    from reins.controller.local import _open_pidfd, _readable

    process = await asyncio.create_subprocess_exec("sleep", "0.5")
    pidfd = _open_pidfd(process.pid)
    assert pidfd is not None
    try:
        started = asyncio.get_running_loop().time()
        await _readable(pidfd, 0.05)  # still running: returns at the timeout
        assert process.returncode is None
        await _readable(pidfd, 30)  # returns at the exit, long before the timeout
        waited = asyncio.get_running_loop().time() - started
        assert 0.3 < waited < 10
    finally:
        os.close(pidfd)
        await process.wait()


@pytest.mark.parametrize("preload", [True, False], ids=["forked", "fresh"])
async def test_an_agent_ending_without_cleanup_reports_its_real_status(
    client: GatewayClient, gateway_url: str, tmp_path: Path, preload: bool
) -> None:
    """os._exit, a signal, a KeyboardInterrupt: the same outcome forked as in a fresh interpreter
    (the shell's 128 + N for signal N), never `lost`."""
    cases = {
        "r-osexit0": ("os_exit_with", {"status": 0}, "succeeded", 0),
        "r-osexit5": ("os_exit_with", {"status": 5}, "failed", 5),
        "r-sigkill": ("kill_self", {"signal": "SIGKILL"}, "failed", 137),
        "r-sigsegv": ("kill_self", {"signal": "SIGSEGV"}, "failed", 139),
        "r-ctrl-c": ("interrupted", {}, "failed", 130),
    }
    await client.create_rollouts(
        [
            RolloutSpec(rollout_id=rid, input=task, config=RolloutConfig(agent=f"{AGENTS}:{name}"))
            for rid, (name, task, _, _) in cases.items()
        ]
    )
    reconciler = LocalReconciler(
        f"{AGENTS}:succeed", 8, tmp_path / "logs", workdir=ROOT, preload=preload
    )
    ctl = Controller(
        client, reconciler, gateway_url=gateway_url, max_attempts=1, poll_interval_s=0.1
    )
    async with running(ctl):
        rollouts = await wait_terminal(client, list(cases))
    for rid, (_, _, state, code) in cases.items():
        assert rollouts[rid].status.state == state, rid
        [log] = await client.get_events(rid, attempt_id=1, types=[AGENT_LOG])
        assert log.data["exit_code"] == code, rid
        assert log.data["outcome"] == ("succeeded" if code == 0 else "crashed"), rid


def test_no_preload_reaches_the_local_reconciler(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from reins.cli import app
    from reins.controller import command

    seen: list[command.ControllerOptions] = []
    base = ["controller", "--runner", "local", "--gateway", "http://127.0.0.1:1"]
    base += ["--api-key", "k", "--agent", f"{AGENTS}:succeed", "--log-dir", str(tmp_path)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(command, "main", seen.append)
        for flags in ([], ["--no-preload"]):
            result = CliRunner().invoke(app, base + flags)
            assert result.exit_code == 0, result.output
    reconcilers = [command.build_reconciler(options) for options in seen]
    assert [r.preload for r in reconcilers] == [True, False]  # type: ignore[attr-defined]


async def test_a_module_that_hangs_when_imported_times_out_instead_of_running_forever(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    ids = ["r-hang-import1", "r-hang-import2"]
    config = RolloutConfig(agent="tests.controller.hanging_import_agent:succeed", timeout_s=1)
    await client.create_rollouts([RolloutSpec(rollout_id=rid, config=config) for rid in ids])
    ctl = controller(client, gateway_url, tmp_path / "logs", max_attempts=1)
    async with running(ctl):
        rollouts = await wait_terminal(client, ids, timeout_s=30)
        assert ctl.reconciler.free_slots() == 4  # nothing left holding a slot
    for rid in ids:
        assert rollouts[rid].status.state == "failed", rid
        reason = rollouts[rid].status.reason
        assert reason is not None and "timed out after 1" in reason, reason


@pytest.mark.parametrize(
    ("agent", "preload", "python", "says"),
    [
        ("true", False, sys.executable, "No such file or directory"),  # the workdir is gone
        (f"{AGENTS}:succeed", True, sys.executable, "No such file or directory"),
        (f"{AGENTS}:succeed", True, "/bin/false", "zygote of agent"),  # it dies at once, twice
    ],
    ids=["plain-spawn", "zygote-spawn", "zygote-dies"],
)
async def test_an_agent_that_cannot_be_started_is_a_failed_attempt_not_a_loop(
    client: GatewayClient,
    gateway_url: str,
    tmp_path: Path,
    agent: str,
    preload: bool,
    python: str,
    says: str,
) -> None:
    await client.create_rollouts([RolloutSpec(rollout_id="r-unstartable", input={})])
    workdir = ROOT if python == "/bin/false" else tmp_path / "gone"
    reconciler = LocalReconciler(
        agent, 2, tmp_path / "logs", workdir=workdir, preload=preload, python=python
    )
    ctl = Controller(
        client, reconciler, gateway_url=gateway_url, max_attempts=2, poll_interval_s=0.1
    )
    async with running(ctl):
        rollouts = await wait_terminal(client, ["r-unstartable"])
    status = rollouts["r-unstartable"].status
    assert status.state == "failed"
    assert status.reason is not None and status.reason.startswith("attempt 2 of 2: the agent")
    assert "could not be started" in status.reason and says in status.reason
    detail = await client.get_rollout("r-unstartable")
    assert [a.attempt_id for a in detail.attempts] == [1, 2]


@pytest.mark.parametrize(
    ("agent", "preload", "python", "says"),
    [
        ("true", False, sys.executable, "No such file or directory"),  # the workdir is gone
        (f"{AGENTS}:succeed", True, "/bin/false", "zygote of agent"),  # it dies at once, twice
    ],
    ids=["plain-spawn", "zygote-dies"],
)
async def test_a_start_failure_reads_as_one_after_a_restart(
    client: GatewayClient,
    gateway_url: str,
    tmp_path: Path,
    agent: str,
    preload: bool,
    python: str,
    says: str,
) -> None:
    await client.create_rollouts([RolloutSpec(rollout_id="r-unstarted", input={})])
    logs = tmp_path / "logs"
    workdir = ROOT if python == "/bin/false" else tmp_path / "gone"
    unstartable = LocalReconciler(agent, 2, logs, workdir=workdir, preload=preload, python=python)
    first = Controller(client, unstartable, gateway_url=gateway_url, poll_interval_s=0.1)
    await first.reconcile_once()
    await first.wait_idle()
    assert first.stats.launched == 1
    stop_dead(first)  # before it reported the failed start
    reconciler = LocalReconciler(agent, 2, logs, workdir=ROOT, preload=preload)
    second = Controller(client, reconciler, gateway_url=gateway_url, poll_interval_s=0.1)
    async with running(second):
        rollouts = await wait_terminal(client, ["r-unstarted"])
    assert rollouts["r-unstarted"].status.state == "succeeded"
    first_attempt, _ = (await client.get_rollout("r-unstarted")).attempts
    reason = first_attempt.reason or ""
    assert "the agent could not be started" in reason and says in reason, reason
    [report] = await client.get_events("r-unstarted", attempt_id=1, types=[AGENT_LOG])
    assert report.data["outcome"] == "crashed"


DIES_AFTER_ITS_FORK = """\
import json, subprocess, sys
from pathlib import Path
from reins.controller.zygote import process_start_time

request = json.loads(sys.stdin.readline())
folder = Path(request["folder"])
with Path(__file__).with_suffix(".forks").open("a") as forks:
    forks.write(request["folder"] + "\\n")
# The agent it forked: ends with status 0, as a wrapper's last act records it.
ends = f"echo 0 > {folder}/exit.tmp && mv {folder}/exit.tmp {folder}/exit"
agent = subprocess.Popen(["sh", "-c", ends])
(folder / "pid.start").write_text(process_start_time(agent.pid) or "")
(folder / "pid").write_text(str(agent.pid))
agent.wait()
sys.exit(1)  # dies before its answer
"""


async def test_a_zygote_that_died_after_its_fork_is_not_asked_again(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    """Its agent runs (or ran): a second zygote would start the same attempt twice."""
    zygote = tmp_path / "zygote.py"
    zygote.write_text(f"#!{sys.executable}\n{DIES_AFTER_ITS_FORK}")
    zygote.chmod(0o755)
    await client.create_rollouts([RolloutSpec(rollout_id="r-forked", input={})])
    reconciler = LocalReconciler(
        f"{AGENTS}:succeed", 2, tmp_path / "logs", workdir=ROOT, python=str(zygote)
    )
    ctl = Controller(
        client, reconciler, gateway_url=gateway_url, max_attempts=1, poll_interval_s=0.1
    )
    async with running(ctl):
        rollouts = await wait_terminal(client, ["r-forked"])
    assert len(zygote.with_suffix(".forks").read_text().splitlines()) == 1
    assert rollouts["r-forked"].status.state == "succeeded", rollouts["r-forked"].status


async def test_the_largest_input_accepted_fits_in_the_environment(client: GatewayClient) -> None:
    """MAX_INPUT_BYTES counts what Linux counts: `REINS_INPUT=`, the value and its NUL."""
    from reins.controller.loop import MAX_INPUT_BYTES, LaunchError, agent_env

    sizes = {"r-largest": MAX_INPUT_BYTES, "r-too-large": MAX_INPUT_BYTES + 1}
    await client.create_rollouts(
        [RolloutSpec(rollout_id=rid, input="x" * (size - 2)) for rid, size in sizes.items()]
    )
    envs = {}
    for rid in sizes:
        attempt = await client.open_attempt(rid, attempt_id=1)
        rollout = (await client.get_rollout(rid)).rollout
        try:
            envs[rid] = agent_env("http://127.0.0.1:1", rollout, attempt)
        except LaunchError as error:
            assert "REINS_INPUT" in str(error)
    assert list(envs) == ["r-largest"]
    assert len(envs["r-largest"]["REINS_INPUT"]) == MAX_INPUT_BYTES
    process = await asyncio.create_subprocess_exec("true", env=envs["r-largest"])
    assert await process.wait() == 0  # the kernel takes it


async def test_a_graceful_restart_does_not_use_up_an_attempt(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    task = {"pid_file": str(pid_file), "only_first": True}  # attempt 1 hangs, 2 succeeds
    config = RolloutConfig(max_attempts=1)
    await client.create_rollouts([RolloutSpec(rollout_id="r", input=task, config=config)])
    logs = tmp_path / "logs"
    async with running(controller(client, gateway_url, logs, f"{AGENTS}:spawn_and_hang")):
        await wait_for(pid_file.exists, what="the agent starting")
    # Stopped (SIGTERM's path): the next controller retries the attempt, its last one though it was.
    async with running(controller(client, gateway_url, logs, f"{AGENTS}:spawn_and_hang")):
        rollout = (await wait_terminal(client, ["r"]))["r"]
    assert (rollout.status.state, rollout.attempt_count) == ("succeeded", 2)
    [report] = await client.get_events("r", attempt_id=1, types=[AGENT_LOG])
    assert report.data["outcome"] == "stopped"
    attempts = (await client.get_rollout("r")).attempts
    assert "stopped by the controller's shutdown" in (attempts[0].reason or "")


async def test_an_attempt_that_ended_as_the_controller_stopped_keeps_its_outcome(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    """Its `exit` was written over with `stopped`, so the next controller ran the finished
    rollout again. The agent's end is stood in for: it writes its `exit` as the wrapper would,
    then lingers (its ending was not seen yet when the stop came)."""
    logs = tmp_path / "logs"
    folder = logs / "r-ended" / "attempt-1"
    agent = f"printf '0\\n' > {folder / 'exit'}; sleep 1000"
    await client.create_rollouts([RolloutSpec(rollout_id="r-ended", input={})])
    async with running(controller(client, gateway_url, logs, agent)):
        await wait_for((folder / "exit").exists, what="the agent's exit")
    assert (folder / "exit").read_text() == "0\n"
    async with running(controller(client, gateway_url, logs, agent)):
        rollout = (await wait_terminal(client, ["r-ended"]))["r-ended"]
    assert (rollout.status.state, rollout.attempt_count) == ("succeeded", 1)


async def test_a_second_controller_on_one_gateway_waits_for_the_first(
    client: GatewayClient, gateway_url: str, tmp_path: Path
) -> None:
    """Both launched every rollout (opening an attempt is idempotent): two agents per attempt,
    two rewards. The second now waits for the gateway's controller lease, and takes it once the
    first stops."""

    def second_controller(name: str) -> Controller:
        reconciler = LocalReconciler(f"{AGENTS}:succeed", 4, tmp_path / name, workdir=ROOT)
        return Controller(client, reconciler, gateway_url=gateway_url, poll_interval_s=0.1)

    first, second = second_controller("first"), second_controller("second")
    ids = [f"r-two-{n}" for n in range(4)]
    await client.create_rollouts([RolloutSpec(rollout_id=rid, input={}) for rid in ids[:2]])
    async with running(first), running(second):
        await wait_terminal(client, ids[:2])
        assert second.stats.passes == 0  # waiting, not reconciling
    # The first stopped (its lease released): the second goes on alone.
    async with running(second):
        await client.create_rollouts([RolloutSpec(rollout_id=rid, input={}) for rid in ids[2:]])
        await wait_terminal(client, ids[2:])
    for rid in ids:
        assert len(await client.get_events(rid, types=[AGENT_LAUNCH])) == 1, rid
        assert len(await client.get_events(rid, types=[REWARD])) == 1, rid
    launched = {name: sorted(p.name for p in (tmp_path / name).glob("r-two-*")) for name in
                ("first", "second")}  # fmt: skip
    assert launched == {"first": ids[:2], "second": ids[2:]}


def test_the_command_stops_when_the_gateway_refuses_its_key(gateway_url: str) -> None:
    """A wrong admin key is no outage: the controller says so and exits, instead of logging a
    401 and retrying forever."""
    done = subprocess.run(
        [
            sys.executable, "-m", "reins.cli", "controller", "--runner", "local",
            "--gateway", gateway_url, "--api-key", "not-the-admin-key",
            "--agent", "tests.controller.agents:succeed", "--poll-interval", "0.1",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "the gateway refuses this controller's key" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
async def test_a_gateway_restarted_on_another_database_has_its_rollouts_run(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    def new_database(name: str) -> str:
        if backend == "sqlite":
            return f"sqlite+aiosqlite:///{tmp_path / name}.db"
        server: PostgresServer = request.getfixturevalue("postgres")
        return server.create_database(f"t_{uuid.uuid4().hex[:16]}")

    port = free_port()
    gateway = GatewayProcess(database_url=new_database("first"), api_key=ADMIN_KEY, port=port)
    await asyncio.to_thread(gateway.start)
    try:
        async with GatewayClient(gateway.url, ADMIN_KEY) as client:
            ctl = controller(client, gateway.url, tmp_path / "logs")
            async with running(ctl):
                old_ids = [f"old-{i}" for i in range(20)]
                await client.create_rollouts([RolloutSpec(rollout_id=r, input={}) for r in old_ids])
                await wait_terminal(client, old_ids)
                # The controller has read the first database's changes: its cursor is past 20.
                await wait_for(lambda: not ctl.active, what="the controller reading the ends")
                await asyncio.to_thread(gateway.stop)
                # The same URL, another database: its change counter starts again from 1.
                gateway = GatewayProcess(
                    database_url=new_database("second"), api_key=ADMIN_KEY, port=port
                )
                await asyncio.to_thread(gateway.start)
                new_ids = [f"new-{i}" for i in range(3)]
                await client.create_rollouts([RolloutSpec(rollout_id=r, input={}) for r in new_ids])
                rollouts = await wait_terminal(client, new_ids, timeout_s=60)
    finally:
        await asyncio.to_thread(gateway.stop)
    assert {r.status.state for r in rollouts.values()} == {"succeeded"}
    assert ctl.stats.launched == 23


async def test_a_gateway_restored_from_an_older_copy_has_its_new_rollouts_run(
    tmp_path: Path,
) -> None:
    """The same database restored from a backup keeps its id and counts its changes again from
    where the copy ends, below the controller's cursor: the controller reads it from the start
    rather than leave its new rollouts queuing until the counter passes its cursor again."""
    port = free_port()
    live, backup = tmp_path / "live.db", tmp_path / "backup.db"
    gateway = GatewayProcess(
        database_url=f"sqlite+aiosqlite:///{live}", api_key=ADMIN_KEY, port=port
    )
    await asyncio.to_thread(gateway.start)
    await asyncio.to_thread(gateway.stop)
    shutil.copyfile(live, backup)  # stopped: the WAL is checkpointed into the file
    await asyncio.to_thread(gateway.start)
    try:
        async with GatewayClient(gateway.url, ADMIN_KEY) as client:
            ctl = controller(client, gateway.url, tmp_path / "logs")
            async with running(ctl):
                old_ids = [f"old-{i}" for i in range(20)]
                await client.create_rollouts([RolloutSpec(rollout_id=r, input={}) for r in old_ids])
                await wait_terminal(client, old_ids)
                await wait_for(lambda: not ctl.active, what="the controller reading the ends")
                await asyncio.to_thread(gateway.stop)
                gateway = GatewayProcess(
                    database_url=f"sqlite+aiosqlite:///{backup}", api_key=ADMIN_KEY, port=port
                )
                await asyncio.to_thread(gateway.start)
                new_ids = [f"new-{i}" for i in range(3)]
                await client.create_rollouts([RolloutSpec(rollout_id=r, input={}) for r in new_ids])
                rollouts = await wait_terminal(client, new_ids, timeout_s=60)
    finally:
        await asyncio.to_thread(gateway.stop)
    assert {r.status.state for r in rollouts.values()} == {"succeeded"}
    assert ctl.stats.launched == 23
