"""A sandbox's one network door (`Sandbox(relays=...)` and `reins.sandbox.gateway.GatewayDoor`)
against real bubblewrap and a real HTTP server on 127.0.0.1 in the gateway's place (it echoes
what it received; streamed answers arrive in pieces): the attempt's proxy paths pass, with their
bodies, headers and streams; every other path, port and host is out of reach. Also the mounts and
per-run variables a harness run inside needs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest

from reins.sandbox import Mount, Sandbox, SandboxLimits, sandbox_problem
from reins.sandbox.gateway import GatewayDoor
from tests.required import missing
from tests.support import http_server

ATTEMPT = "/proxy/rollout/r1/attempt/2/mode/train"  # the gateway's proxy path for it
LIMITS = SandboxLimits(wall_s=20, cpu_s=10, memory_mb=512, processes=64)


@pytest.fixture(autouse=True)
def _bwrap_available() -> None:
    problem = sandbox_problem()
    if problem:
        missing(problem)


@pytest.fixture
def gateway() -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(port, requests): POST echoes the request as JSON; `.../stream` answers three SSE events,
    0.3 s apart."""
    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()
            seen = {"path": self.path, "body": body, "auth": self.headers.get("Authorization")}
            received.append(seen)
            if self.path.endswith("/stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for index in range(3):
                    self.wfile.write(f"data: {index} {time.monotonic():.3f}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.3)
                return
            data = json.dumps(seen).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    with http_server(Handler) as port:
        yield port, received


def test_the_door_passes_only_the_attempts_proxy_paths() -> None:
    with GatewayDoor(f"http://127.0.0.1:9/{ATTEMPT.lstrip('/')}/openai/v1") as door:
        passes = [
            f"{ATTEMPT}/openai/v1/chat/completions",
            f"{ATTEMPT}/openai/v1/responses",
            f"{ATTEMPT}/anthropic/v1/messages",
            f"{ATTEMPT}/anthropic",  # Claude Code's first `HEAD` of its base URL
        ]
        refused = [
            "/api/rollouts/r1/attempt/2/events",  # posting a reward with the harness's token
            "/api/rollouts",
            f"{ATTEMPT}/openai/v1/../../../../events",
            f"{ATTEMPT}/openai/v1/%2e%2e/%2e%2e/events",
            f"{ATTEMPT}/openaiX/v1",
            "/proxy/rollout/r1/attempt/3/mode/train/openai/v1/chat/completions",  # another one
            f"{ATTEMPT}/openai\\..\\events",
        ]
        assert [door.passes(path) for path in passes] == [True] * len(passes)
        assert [door.passes(path) for path in refused] == [False] * len(refused)
        # Under 1024 the sandbox cannot listen without a capability: 8000 + the port inside.
        assert door.relays == {8009: door.socket_path}
        assert door.inside_url("http://127.0.0.1:9/x") == "http://127.0.0.1:8009/x"
        with pytest.raises(ValueError, match="not on the gateway"):
            door.inside_url("http://127.0.0.1:10/x")
    with pytest.raises(ValueError, match="not a reins proxy URL"):
        GatewayDoor("http://127.0.0.1:9/v1/chat")


def test_a_command_reaches_the_proxy_through_the_door_and_nothing_else(
    tmp_path: Path, gateway: tuple[int, list[dict[str, Any]]]
) -> None:
    port, received = gateway
    base = f"http://127.0.0.1:{port}{ATTEMPT}/openai/v1"
    env = {"BASE": base, "TOKEN": "scoped"}
    with GatewayDoor(base) as door, Sandbox(tmp_path / "box", LIMITS, relays=door.relays) as box:
        done = box.run(
            'curl -sS -X POST -H "Authorization: Bearer $TOKEN" -d \'{"a": 1}\' '
            '"$BASE/chat/completions"',
            env=env,
        )
        assert done.exit_code == 0, done.output
        assert json.loads(done.output) == {
            "path": f"{ATTEMPT}/openai/v1/chat/completions",
            "body": '{"a": 1}',
            "auth": "Bearer scoped",
        }
        # A stream passes as it comes: each event is read before the next one is written.
        streamed = box.run(
            'curl -sSN -X POST -d x "$BASE/stream" | while read -r line; do '
            'if [ -n "$line" ]; then echo "$line $(date +%s.%N)"; fi; done',
            env=env,
        )
        assert streamed.exit_code == 0, streamed.output
        lines = [line.split() for line in streamed.output.splitlines()]
        assert [int(line[1]) for line in lines] == [0, 1, 2]
        arrived = [float(line[3]) for line in lines]
        assert arrived[2] - arrived[0] > 0.4  # not buffered to the end
        before = len(received)
        for command in (
            f'curl -sS -X POST -d x "http://127.0.0.1:{port}/api/rollouts/r1/attempt/2/events"',
            f'curl -sS "http://127.0.0.1:{port}/api/rollouts"',
        ):
            refused = box.run(command + ' -w " %{http_code}"')
            assert refused.output.endswith(" 403"), refused.output
            assert "refused by the sandbox's gateway door" in refused.output
        assert len(received) == before  # the refused requests never reached the gateway
        assert door.refused == [
            "POST /api/rollouts/r1/attempt/2/events",
            "GET /api/rollouts",
        ]
        other_port = box.run(f"curl -sS -m 5 http://127.0.0.1:{port + 1}/; echo exit $?")
        assert other_port.output.rstrip().endswith("exit 7"), other_port.output  # refused
        outside = box.run("curl -sS -m 5 https://example.com/; echo exit $?")
        assert outside.output.rstrip().endswith("exit 6"), outside.output  # no name resolution


def test_mounts_and_variables(tmp_path: Path) -> None:
    shown, home = tmp_path / "shown", tmp_path / "home"
    shown.mkdir()
    home.mkdir()
    (shown / "tool.sh").write_text("echo tool ran")
    mounts = [Mount(shown), Mount(home, "/home/agent", writable=True)]
    with Sandbox(tmp_path / "box", LIMITS, mounts=mounts) as box:
        done = box.run(
            f"bash {shown}/tool.sh && echo $GREETING > $HOME/note && cat /home/agent/note; "
            f"touch {shown}/new; echo exit $?",
            env={"GREETING": "hello", "HOME": "/home/agent"},
        )
        assert done.output.splitlines()[:2] == ["tool ran", "hello"]
        assert done.output.rstrip().endswith("exit 1")  # read-only
        assert "GREETING" not in box.run("env").output  # a run's variables are that run's
    assert (home / "note").read_text() == "hello\n"
    assert not (shown / "new").exists()
    with pytest.raises(Exception, match="does not exist"):
        Sandbox(tmp_path / "box2", LIMITS, mounts=[Mount(tmp_path / "absent")])


def test_every_refusal_is_403_and_recorded_within_bounds() -> None:
    """TRACE or PROPFIND were 405 and unrecorded; the record of refusals grew without bound (a
    command sending refused paths forever took the host's memory)."""
    with GatewayDoor(f"http://127.0.0.1:9/{ATTEMPT.lstrip('/')}/openai/v1") as door:
        transport = httpx.HTTPTransport(uds=str(door.socket_path))
        with httpx.Client(transport=transport, base_url="http://door") as client:
            for method in ("TRACE", "PROPFIND", "GET"):
                response = client.request(method, "/api/rollouts")
                assert response.status_code == 403, (method, response.text)
            for index in range(150):
                client.post(f"/api/{index}/" + "x" * 1000)
        assert door.refused[:3] == [
            "TRACE /api/rollouts",
            "PROPFIND /api/rollouts",
            "GET /api/rollouts",
        ]
        assert len(door.refused) == 100 and door.refused_count == 153
        assert max(len(entry) for entry in door.refused) == 300
