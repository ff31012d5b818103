"""Run a command with only loopback reachable, the gateway's port bridged in, and every DNS lookup
and web connection it tries logged: the check that a harness makes no call beyond the proxy.

`unshare -n` (root, or a kernel that allows unprivileged user namespaces with `-r`) gives the
command a network namespace of its own: a loopback interface and nothing else. Inside, this file
runs as a script (standard library only) and
- brings `lo` up and routes every address to it (`ip route add local 0.0.0.0/0 dev lo`), so a
  DNS query or a connection to any host lands on this machine's own sockets instead of failing
  before anyone sees it;
- answers DNS queries on port 53 with REFUSED and accepts connections on ports 80 and 443,
  closing them at once, logging each (name, or address and port);
- listens on 127.0.0.1:PORT, the gateway's port, and relays each connection through a Unix socket
  (a file: visible from both namespaces) to the gateway in the test process;
- runs the command with a time limit (its process group is killed at the limit: exit 124), and
  writes what it logged as JSON to `--log`.

`LoopbackBridge` is the other end, in the test process: it accepts on the Unix socket and
connects to the gateway.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from reins.sandbox.relay import serve

TIMED_OUT = 124
WATCHED_TCP_PORTS = (80, 443)


class LoopbackBridge:
    """In the test process: a Unix socket whose connections are relayed to 127.0.0.1:`port`."""

    def __init__(self, path: Path, port: int) -> None:
        self.path, self.port = path, port
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(64)
        serve(self.listener, lambda: socket.create_connection(("127.0.0.1", port)))

    def close(self) -> None:
        self.listener.close()
        self.path.unlink(missing_ok=True)


def _question(query: bytes) -> tuple[str, int]:
    """The first question's name, and where the question ends (after its type and class)."""
    labels, position = [], 12
    while position < len(query) and query[position]:
        length = query[position]
        labels.append(query[position + 1 : position + 1 + length].decode(errors="replace"))
        position += 1 + length
    return ".".join(labels), position + 5


def _dns_refused(query: bytes, question_end: int) -> bytes:
    """A REFUSED answer to `query`: its id and first question, no records."""
    flags = 0x8000 | (query[2] & 0x79) << 8 | 0x0080 | 5  # QR, opcode and RD kept, RA, REFUSED
    return query[:2] + flags.to_bytes(2, "big") + b"\x00\x01" + bytes(6) + query[12:question_end]


def _watch(seen: list[dict[str, Any]]) -> list[socket.socket]:
    """DNS (UDP 53) and web (TCP 80, 443) sockets on every address, logging into `seen`."""
    sockets: list[socket.socket] = []
    lock = threading.Lock()

    def record(entry: dict[str, Any]) -> None:
        with lock:
            seen.append(entry)

    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dns.bind(("0.0.0.0", 53))
    sockets.append(dns)

    def answer_dns() -> None:
        while True:
            try:
                query, peer = dns.recvfrom(4096)
            except OSError:
                return
            if len(query) < 12:
                continue
            name, end = _question(query)
            record({"dns": name})
            dns.sendto(_dns_refused(query, end), peer)

    threading.Thread(target=answer_dns, daemon=True).start()
    for port in WATCHED_TCP_PORTS:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", port))
        listener.listen(16)
        sockets.append(listener)

        def refuse(listener: socket.socket = listener) -> None:
            while True:
                try:
                    accepted, _ = listener.accept()
                except OSError:
                    return
                host, port = accepted.getsockname()[:2]
                record({"connect": f"{host}:{port}"})
                accepted.close()

        threading.Thread(target=refuse, daemon=True).start()
    return sockets


def _ip() -> str:
    """iproute2's `ip` (in /usr/sbin, which a non-root PATH may lack)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = shutil.which("ip", path=path)
    if found is None:
        raise FileNotFoundError("`ip` (iproute2) is not installed")
    return found


def _inside(args: argparse.Namespace) -> int:
    """The namespace's side: set up, run the command, log."""
    subprocess.run([_ip(), "link", "set", "lo", "up"], check=True)
    subprocess.run([_ip(), "route", "add", "local", "0.0.0.0/0", "dev", "lo"], check=True)
    seen: list[dict[str, Any]] = []
    watchers = _watch(seen)
    bridge = socket.socket()
    bridge.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    bridge.bind(("127.0.0.1", args.port))
    bridge.listen(64)

    def to_gateway() -> socket.socket:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(args.socket)
        return upstream

    serve(bridge, to_gateway)
    process = subprocess.Popen(args.command, cwd=args.cwd, start_new_session=True)
    try:
        code = process.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        code = TIMED_OUT
    for sock in [bridge, *watchers]:
        sock.close()
    Path(args.log).write_text(json.dumps(seen))
    return code


def command(
    argv: list[str], *, port: int, socket_path: Path, log: Path, cwd: Path, timeout_s: float
) -> list[str]:
    """The argv that runs `argv` in a new network namespace through this file."""
    return [
        "unshare",
        "--net",
        sys.executable,
        str(Path(__file__).resolve()),
        "--port",
        str(port),
        "--socket",
        str(socket_path),
        "--log",
        str(log),
        "--cwd",
        str(cwd),
        "--timeout",
        str(timeout_s),
        "--",
        *argv,
    ]


@functools.cache
def available() -> bool:
    """Whether this machine lets us make a network namespace and set up its loopback."""
    try:
        ip = _ip()
        probe = subprocess.run(
            ["unshare", "--net", ip, "link", "set", "lo", "up"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--cwd", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("command", nargs="+")
    return _inside(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
