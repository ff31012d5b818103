"""`reins.agent`: the harness-side helpers, against a real gateway."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

from reins import agent, retry
from reins.agent import (
    AgentContext,
    AgentEnvError,
    ReportError,
    emit_event,
    report_reward,
    report_tool,
)
from reins.controller.run_agent import call_agent
from reins.gateway import GatewaySettings
from tests.conftest import ADMIN_KEY, serve
from tests.support import free_port


def context_for(gateway_url: str, rollout_id: str = "r-1", attempt_id: int = 1) -> AgentContext:
    """Declares a rollout, opens its attempt, and builds the environment an agent would get."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    httpx.post(
        f"{gateway_url}/api/rollouts",
        json=[{"rollout_id": rollout_id, "input": {"q": 1}}],
        headers=admin,
    ).raise_for_status()
    attempt = httpx.post(
        f"{gateway_url}/api/rollouts/{rollout_id}/attempts",
        json={"attempt_id": attempt_id},
        headers=admin,
    ).json()
    return AgentContext.from_env(
        {
            "OPENAI_BASE_URL": (
                f"{gateway_url}/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/train/openai/v1"
            ),
            "OPENAI_API_KEY": attempt["token"],
            "REINS_GATEWAY_URL": gateway_url,
            "REINS_ROLLOUT_ID": rollout_id,
            "REINS_ATTEMPT_ID": str(attempt_id),
            "REINS_MODE": "train",
            "REINS_INPUT": json.dumps({"q": 1}),
        }
    )


def events(gateway_url: str, rollout_id: str) -> list[dict[str, object]]:
    answer = httpx.get(
        f"{gateway_url}/api/rollouts/{rollout_id}/events",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    return [{"type": e["type"], "data": e["data"]} for e in answer.json()]


def test_from_env_names_what_is_missing() -> None:
    with pytest.raises(AgentEnvError, match=r"OPENAI_API_KEY, REINS_GATEWAY_URL.*reins controller"):
        AgentContext.from_env({"OPENAI_BASE_URL": "http://x"})


def test_from_env_decodes_the_input_and_attempt() -> None:
    env = {
        "OPENAI_BASE_URL": "http://gw/proxy/rollout/r/attempt/2/mode/val/openai/v1",
        "OPENAI_API_KEY": "rk-at-x",
        "REINS_GATEWAY_URL": "http://gw/",
        "REINS_ROLLOUT_ID": "r",
        "REINS_ATTEMPT_ID": "2",
        "REINS_MODE": "val",
        "REINS_INPUT": '{"question": "2+2", "tags": [1, 2]}',
    }
    context = AgentContext.from_env(env)
    assert context.attempt_id == 2 and context.gateway_url == "http://gw"
    assert context.input == {"question": "2+2", "tags": [1, 2]}
    with pytest.raises(AgentEnvError, match="REINS_INPUT is not JSON"):
        AgentContext.from_env({**env, "REINS_INPUT": "{nope"})


def test_rewards_and_events_are_posted_with_the_scoped_token(gateway_url: str) -> None:
    context = context_for(gateway_url)
    emit_event("tool_call", {"name": "bash", "ok": True}, context=context)
    report_reward(0.75, reason="3 of 4 tests", context=context)
    assert events(gateway_url, "r-1") == [
        {"type": "tool_call", "data": {"name": "bash", "ok": True}},
        {"type": "reward", "data": {"value": 0.75, "source": "agent", "reason": "3 of 4 tests"}},
    ]


def test_tool_uses_and_reward_metrics_are_posted_as_given(gateway_url: str) -> None:
    context = context_for(gateway_url)
    report_tool("search", "founder of Orlin Vale", "Maren Ostby.", seconds=0.01234, context=context)
    report_tool("run_shell", {"command": "ls"}, "", ok=False, context=context)
    report_reward(1, metrics={"searches": 1, "answered": 1}, context=context)
    assert events(gateway_url, "r-1") == [
        {
            "type": "tool",
            "data": {
                "name": "search",
                "input": "founder of Orlin Vale",
                "output": "Maren Ostby.",
                "ok": True,
                "seconds": 0.0123,
            },
        },
        {
            "type": "tool",
            "data": {"name": "run_shell", "input": {"command": "ls"}, "output": "", "ok": False},
        },
        {
            "type": "reward",
            "data": {
                "value": 1.0,
                "source": "agent",
                "metrics": {"searches": 1.0, "answered": 1.0},
            },
        },
    ]
    with pytest.raises(TypeError, match="metric 'answered' is True, not a number"):
        report_reward(1, metrics={"answered": True}, context=context)
    # Each was stored as 1.0 or 0.7, a raw OverflowError, or a key silently made a string.
    with pytest.raises(TypeError, match="the reward is True, not a number"):
        report_reward(True, context=context)
    with pytest.raises(TypeError, match=r"the reward is '0\.7', not a number"):
        report_reward("0.7", context=context)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="metric 'big' is an integer too large for a float"):
        report_reward(1, metrics={"big": 10**400}, context=context)
    with pytest.raises(TypeError, match="metric name 3 is not a string"):
        report_reward(1, metrics={3: 1.0}, context=context)  # type: ignore[dict-item]
    assert len(events(gateway_url, "r-1")) == 3  # none of them posted


def test_numpy_numbers_are_rewards_and_metrics(gateway_url: str) -> None:
    """A reward computed over numpy arrays (`np.float32`, `np.int64`) was refused as "not a
    number"; numpy's bool still is not one."""
    context = context_for(gateway_url)
    report_reward(np.float32(0.5), metrics={"passed": np.int64(2)}, context=context)
    assert events(gateway_url, "r-1") == [
        {"type": "reward", "data": {"value": 0.5, "source": "agent", "metrics": {"passed": 2.0}}}
    ]
    with pytest.raises(TypeError, match=r"the reward is .*True.*, not a number"):
        report_reward(np.bool_(True), context=context)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"REINS_GATEWAY_URL": "127.0.0.1:8080"}, "is not an http\\(s\\)://HOST:PORT URL"),
        ({"REINS_GATEWAY_URL": ""}, "is not an http\\(s\\)://HOST:PORT URL"),
        ({"OPENAI_API_KEY": "tok\nen"}, "holds characters no HTTP header can carry"),
        ({"OPENAI_API_KEY": "tøken"}, "holds characters no HTTP header can carry"),
        ({"REINS_ATTEMPT_ID": "0"}, "the attempt id is 0: attempts count from 1"),
        ({"REINS_INPUT": "NaN"}, "REINS_INPUT is not JSON: NaN is not a JSON number"),
        ({"REINS_ROLLOUT_ID": ""}, "the rollout id \\(REINS_ROLLOUT_ID\\) is empty"),
    ],
)
def test_an_environment_no_event_could_be_posted_with_says_so(
    change: dict[str, str], says: str
) -> None:
    """A URL without its scheme was retried for two minutes as an outage; the others were bare
    ValueErrors or UnicodeEncodeErrors at the first post."""
    good = AgentContext(
        "http://127.0.0.1:1/p/openai/v1", "tok", "http://127.0.0.1:1", "r", 1, "train", 1
    )
    env = {**good.env(), **change}
    with pytest.raises(AgentEnvError, match=says):
        AgentContext.from_env(env)


def test_a_token_of_another_attempt_is_refused_at_once(gateway_url: str) -> None:
    context = context_for(gateway_url)
    other = AgentContext(**{**context.__dict__, "attempt_id": 2})
    with pytest.raises(ReportError, match=r"refused the reward event.*403"):
        report_reward(1.0, context=other)


class _Flaky(BaseHTTPRequestHandler):
    bodies: list[dict[str, object]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        self.send_response(503 if len(type(self).bodies) == 1 else 200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "busy"}' if len(type(self).bodies) == 1 else b"{}")

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def flaky_server() -> Iterator[str]:
    _Flaky.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_retry_after_a_5xx_carries_the_same_idempotency_key(flaky_server: str) -> None:
    context = AgentContext(flaky_server, "tok", flaky_server, "r", 1, "train", None)
    report_reward(1.0, context=context)
    first, second = _Flaky.bodies
    assert first == second and first["idempotency_key"]


class _Redirecting(BaseHTTPRequestHandler):
    """An ingress that sends the gateway's http URL to https: POSTs are redirected, and the
    GET that urllib made of one answered 200."""

    gets = 0

    def do_POST(self) -> None:
        self.send_response(302)
        self.send_header("Location", "/elsewhere")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        type(self).gets += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *_: object) -> None:
        pass


def test_a_redirected_event_post_fails_naming_the_redirect() -> None:
    """urllib followed the redirect as a GET without the event, and its 200 passed for the
    event's ack: the reward was lost without a word."""
    _Redirecting.gets = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Redirecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        context = AgentContext(url, "tok", url, "r", 1, "train", None)
        with pytest.raises(ReportError, match="302: redirected to /elsewhere"):
            report_reward(1.0, context=context)
    finally:
        server.shutdown()
        server.server_close()
    assert _Redirecting.gets == 0


class _Clock:
    """The retries' clock, moved by their sleeps: minutes of retrying in no time."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        monkeypatch.setattr(retry.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(agent.time, "sleep", self.sleep)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Restarting(_Flaky):
    """A gateway that answers 503 until `clock.now` reaches `up_at`, then 200."""

    clock: _Clock
    up_at = 0.0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        up = self.clock.now >= self.up_at
        self.send_response(200 if up else 503)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}" if up else b'{"error": "restarting"}')


def test_a_reward_outlasts_a_gateway_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    _Restarting.clock, _Restarting.up_at, _Restarting.bodies = _Clock(monkeypatch), 45.0, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Restarting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        report_reward(1.0, context=AgentContext(url, "tok", url, "r", 1, "train", None))
    finally:
        server.shutdown()
        server.server_close()
    assert _Restarting.clock.now >= 45.0
    keys = {body["idempotency_key"] for body in _Restarting.bodies}
    assert len(_Restarting.bodies) > 10 and len(keys) == 1


def test_an_event_over_the_gateways_body_limit_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway answered 413 without reading the body: urllib, still sending, saw the
    connection reset, and the agent retried it for two minutes as an outage."""
    tries: list[object] = []
    opener = agent._POSTER

    class Counting:
        def open(self, request: object, **options: object) -> object:
            tries.append(request)
            return opener.open(request, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(agent, "_POSTER", Counting())
    settings = GatewaySettings(
        database_url=str(tmp_path / "g.db"), api_key=ADMIN_KEY, max_body_bytes=4096
    )
    with serve(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        context = AgentContext(url, "tok", url, "r", 1, "train", None)
        with pytest.raises(ReportError, match=r"refused the log event \(413: .*4096 bytes"):
            # Past the default limit `emit_event` refuses it itself: here the gateway's is tested.
            emit_event("log", {"text": "x" * 40_000_000}, context=context, max_bytes=10**9)
    assert len(tries) == 1  # no retry


def test_an_unreachable_gateway_fails_after_the_retry_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock(monkeypatch)
    url = f"http://127.0.0.1:{free_port()}"
    context = AgentContext(url, "tok", url, "r", 1, "train", None)
    with pytest.raises(ReportError, match=r"could not post the reward event .* in 120 s"):
        emit_event("reward", {"value": 1.0}, context=context)
    assert clock.now == pytest.approx(retry.RETRY_FOR_S)


@pytest.mark.parametrize(
    ("returned", "said"),
    [
        (10**400, "returned 100000000000000000...0000000000000000000, not a finite number"),
        (float("nan"), "returned nan, not a finite number"),
        (float("-inf"), "returned -inf, not a finite number"),
    ],
    ids=["huge-int", "nan", "-inf"],
)
def test_a_returned_reward_that_is_not_a_finite_number_crashes_the_attempt_saying_so(
    gateway_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    returned: float,
    said: str,
) -> None:
    context = context_for(gateway_url)
    for name, value in context.env().items():
        monkeypatch.setenv(name, value)
    assert call_agent("tests:grade", lambda _task: returned) == 1
    assert said in capsys.readouterr().err
    assert events(gateway_url, "r-1") == []


def test_a_returned_reward_the_gateway_refuses_crashes_the_attempt_saying_so(
    gateway_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    context = context_for(gateway_url)
    for name, value in context.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("REINS_ATTEMPT_ID", "2")  # the token is attempt 1's: 403
    assert call_agent("tests:grade", lambda _task: 1) == 1
    err = capsys.readouterr().err
    assert "the reward 1.0 agent tests:grade returned was not posted" in err and "403" in err
