"""The loopback-only runner of the CLI tests (`netns.py`) can fail: inside it, the bridged port
reaches a server outside, and a DNS lookup or a connection to any other address is logged."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.harness import netns

PROBE = """
import socket, urllib.request
print(urllib.request.urlopen("http://127.0.0.1:%d/", timeout=10).read().decode())
try:
    socket.getaddrinfo("updates.example.com", 443)
except OSError as error:
    print("lookup failed:", type(error).__name__)
try:
    socket.create_connection(("203.0.113.7", 443), timeout=10).close()
except OSError as error:
    print("connect failed:", type(error).__name__)
"""


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"through the bridge")

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[int]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield int(httpd.server_address[1])
    httpd.shutdown()
    httpd.server_close()


def test_only_the_bridged_port_is_reachable_and_the_rest_is_logged(
    server: int, tmp_path: Path
) -> None:
    if not netns.available():
        pytest.skip("this machine does not allow network namespaces (`unshare --net`)")
    bridge = netns.LoopbackBridge(tmp_path / "gw.sock", server)
    log = tmp_path / "outbound.json"
    try:
        done = subprocess.run(
            netns.command(
                [sys.executable, "-c", PROBE % server],
                port=server,
                socket_path=tmp_path / "gw.sock",
                log=log,
                cwd=tmp_path,
                timeout_s=60,
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        bridge.close()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "through the bridge"
    assert "lookup failed" in done.stdout  # REFUSED, as a resolver without network would
    seen = json.loads(log.read_text())
    assert {"dns": "updates.example.com"} in seen
    assert {"connect": "203.0.113.7:443"} in seen
    assert {json.dumps(entry) for entry in seen} <= {
        json.dumps({"dns": "updates.example.com"}),
        json.dumps({"connect": "203.0.113.7:443"}),
    }


def test_a_command_past_its_limit_is_killed(server: int, tmp_path: Path) -> None:
    if not netns.available():
        pytest.skip("this machine does not allow network namespaces (`unshare --net`)")
    bridge = netns.LoopbackBridge(tmp_path / "gw.sock", server)
    try:
        done = subprocess.run(
            netns.command(
                ["sleep", "60"],
                port=server,
                socket_path=tmp_path / "gw.sock",
                log=tmp_path / "outbound.json",
                cwd=tmp_path,
                timeout_s=1,
            ),
            timeout=60,
        )
    finally:
        bridge.close()
    assert done.returncode == netns.TIMED_OUT
