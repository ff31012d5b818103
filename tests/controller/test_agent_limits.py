"""What an agent may post and print without losing its attempt: events past the gateway's body
limit (`reins.agent`), an `agent.log` past its cap (`LocalReconciler`), the retries' deadline,
a malformed environment (`run_agent`)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path

import pytest

from reins import agent, retry
from reins.agent import (
    MAX_EVENT_BYTES,
    POSTED_CHARS,
    AgentContext,
    AgentEnvError,
    ReportError,
    emit_event,
    report_reward,
    report_tool,
)
from reins.client import GatewayClient
from reins.controller import Controller, LocalReconciler
from reins.controller.local import _cap_log
from reins.controller.run_agent import call_agent
from reins.schemas import AGENT_LOG, REWARD, RolloutSpec
from tests.controller.conftest import ROOT, running, wait_terminal
from tests.controller.test_agent import context_for, events


def test_a_tool_output_past_the_gateways_body_limit_is_posted_as_its_head_and_tail(
    gateway_url: str,
) -> None:
    """A tool's whole output was posted: the gateway answered 413 and the agent crashed on the
    ReportError, before its reward."""
    context = context_for(gateway_url)
    output = "HEAD" + "x" * 40_000_000 + "TAIL"
    report_tool("bash", "cat big.log", output, context=context)
    report_reward(1.0, reason="why " + "y" * 40_000_000 + " END", context=context)

    tool, reward = events(gateway_url, "r-1")
    assert tool["type"] == "tool" and reward["type"] == REWARD
    posted = tool["data"]["output"]  # type: ignore[index]
    assert posted.startswith("HEAD") and posted.endswith("TAIL")
    assert "output truncated: 40000008 characters in all" in posted
    assert POSTED_CHARS < len(posted) < POSTED_CHARS + 200
    reason = reward["data"]["reason"]  # type: ignore[index]
    assert reason.startswith("why ") and reason.endswith(" END")
    assert "reason truncated: 40000008 characters in all" in reason
    assert reward["data"]["value"] == 1.0  # type: ignore[index]


def test_an_event_past_the_body_limit_is_refused_before_it_is_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past 256 MB the gateway resets the body unread: urllib saw a reset, which was retried
    for two minutes as an outage; under that, a 413 after the whole upload."""
    sent: list[object] = []

    class Recording:
        def open(self, request: object, **_: object) -> object:
            sent.append(request)
            raise AssertionError("posted")

    monkeypatch.setattr(agent, "_POSTER", Recording())
    url = "http://127.0.0.1:9"
    context = AgentContext(url, "tok", url, "r", 1, "train", None)
    with pytest.raises(
        ReportError, match=rf"the log event is \d+ bytes .* over the {MAX_EVENT_BYTES}"
    ):
        emit_event("log", {"text": "x" * MAX_EVENT_BYTES}, context=context)
    assert sent == []


def test_the_retry_time_counts_from_the_first_try(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline started at the first wait, after the first try had failed: a first try that
    timed out was added to the two minutes."""
    now = [0.0]
    monkeypatch.setattr(retry.time, "monotonic", lambda: now[0])
    delays = retry.retry_delays(120.0)
    now[0] += 100.0  # the first try took this long
    for delay in delays:
        now[0] += delay
    assert now[0] == pytest.approx(120.0)


def test_a_malformed_input_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REINS_INPUT", '{"question": ')
    assert call_agent("tests:agent", lambda _task: 1.0) == 2
    err = capsys.readouterr().err
    assert err.startswith("reins: REINS_INPUT is not JSON") and err.count("\n") == 1


def test_a_log_past_its_cap_keeps_its_head_its_tail_and_a_note(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    log.write_bytes(b"H" * 10_000 + b"m" * 50_000 + b"T" * 10_000)
    _cap_log(log, 40_000)
    first = log.read_bytes()
    assert first.startswith(b"H" * 10_000) and first.endswith(b"T" * 10_000)
    assert b"[reins: 50000 bytes of the agent's output left out here" in first
    assert len(first) < 21_000

    with log.open("ab") as more:  # it goes on printing: cut again, the count goes on
        more.write(b"n" * 30_000 + b"E" * 10_000)
    _cap_log(log, 40_000)
    second = log.read_bytes()
    assert second.startswith(b"H" * 10_000) and second.endswith(b"E" * 10_000)
    assert b"[reins: 90000 bytes of the agent's output left out here" in second
    assert second.count(b"[reins:") == 1

    target = tmp_path / "host-file"
    target.write_bytes(b"z" * 100_000)
    os.replace(log, tmp_path / "old.log")
    log.symlink_to(target)  # what the agent put in the log's place is not followed
    _cap_log(log, 40_000)
    assert target.read_bytes() == b"z" * 100_000


@pytest.mark.parametrize("preload", [True, False], ids=["forked", "fresh"])
async def test_an_agent_printing_in_a_loop_has_its_log_cut_back_as_it_runs(
    client: GatewayClient, gateway_url: str, tmp_path: Path, preload: bool
) -> None:
    """agent.log grew without bound: an agent printing in a loop filled the disk."""
    cap = 64 * 1024
    reconciler = LocalReconciler(
        "tests.controller.flooding_agent:flood", 1, tmp_path / "logs", workdir=ROOT,
        preload=preload, log_max_bytes=cap, log_check_s=0.05,
    )  # fmt: skip
    controller = Controller(
        client, reconciler, gateway_url=gateway_url, max_attempts=1, poll_interval_s=0.1
    )
    await client.create_rollouts([RolloutSpec(rollout_id="r-flood", input={"bytes": 4 * cap})])
    async with running(controller):
        rollouts = await wait_terminal(client, ["r-flood"])

    assert rollouts["r-flood"].status.state == "succeeded"
    (log_event,) = await client.get_events("r-flood", types=[AGENT_LOG])
    assert "the last line of the agent, after" in log_event.data["tail"]
    text = await asyncio.to_thread(Path(log_event.data["path"]).read_text)
    assert len(text) <= cap
    assert text.startswith("the first line of the agent\n")
    assert "bytes of the agent's output left out here" in text
    assert text.rstrip().splitlines()[-1].startswith("the last line of the agent")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"REINS_ROLLOUT_ID": "r 1"}, r"the rollout id 'r 1' \(REINS_ROLLOUT_ID\) is not one"),
        ({"REINS_ROLLOUT_ID": "r/1"}, r"the rollout id 'r/1' \(REINS_ROLLOUT_ID\) is not one"),
        (
            {"REINS_MODE": "training"},
            r"the mode 'training' \(REINS_MODE\) is neither train nor val",
        ),
    ],
    ids=["space", "slash", "mode"],
)
def test_a_rollout_id_or_mode_the_gateway_never_gives_is_refused_naming_it(
    change: dict[str, str], says: str
) -> None:
    """A space in the rollout id made every post a bare `http.client.InvalidURL`; a slash posted
    to another route."""
    good = AgentContext(
        "http://127.0.0.1:1/p/openai/v1", "tok", "http://127.0.0.1:1", "r.1:a-b_c", 1, "val", 1
    )
    assert AgentContext.from_env(good.env()) == good
    with pytest.raises(AgentEnvError, match=says):
        AgentContext.from_env({**good.env(), **change})


class _CutShort:
    """A server on loopback whose answers, `answers[n]` for the n-th post, promise 100 bytes of
    body and send 5 before closing, unless they are whole."""

    def __init__(self, answers: list[bytes]) -> None:
        self.answers = answers
        self.posts = 0
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen()
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            with connection:
                connection.recv(65536)
                answer = self.answers[min(self.posts, len(self.answers) - 1)]
                self.posts += 1
                connection.sendall(answer)


def _answer(status: str, body: bytes, length: int) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


def test_an_answer_cut_short_is_retried_or_reported_not_a_bare_traceback() -> None:
    """`http.client.IncompleteRead` is no OSError: an answer cut short (a gateway restarting as
    it answered) escaped from `emit_event` as a bare traceback, never retried."""
    ack = _CutShort([_answer("200 OK", b'{"seq', 100), _answer("200 OK", b"{}", 2)])
    refusal = _CutShort([_answer("400 Bad Request", b'{"error": "no', 100)])
    try:
        context = AgentContext(ack.url, "tok", ack.url, "r", 1, "train", None)
        emit_event("x", {}, context=context, retry_for_s=30)
        assert ack.posts == 2

        context = AgentContext(refusal.url, "tok", refusal.url, "r", 1, "train", None)
        with pytest.raises(ReportError, match=r"refused the x event \(400: "):
            emit_event("x", {}, context=context, retry_for_s=30)
        assert refusal.posts == 1
    finally:
        ack.server.close()
        refusal.server.close()


@pytest.mark.parametrize(
    "rollout_id",
    ["r", "R-1.a_b:c", "a" * 200, "a" * 201, ".r", "-r", "r/1", "r 1", "r\n", "é", "r%2F"],
)
def test_the_agent_takes_exactly_the_rollout_ids_the_gateway_takes(rollout_id: str) -> None:
    """`reins.agent` keeps its own copy of the id rule (it imports the standard library only):
    an id the gateway gives must never be refused by the agent, nor the other way round."""
    from pydantic import TypeAdapter, ValidationError

    from reins.schemas import Identifier

    try:
        TypeAdapter(Identifier).validate_python(rollout_id)
        gateway_takes = True
    except ValidationError:
        gateway_takes = False
    assert (agent._ROLLOUT_ID.fullmatch(rollout_id) is not None) == gateway_takes
