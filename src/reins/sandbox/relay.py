"""Runs inside a sandbox (standard library only, started by `Sandbox.run` before the command):
listens on the sandbox's own loopback at each PORT and relays every connection to a Unix socket
bound in from the host, whose other end decides what may pass (`reins.sandbox.gateway`).

    python3 relay.py PORT=SOCKET [PORT=SOCKET ...]

The parent returns once every port listens, so the command that follows can connect at once;
a child keeps relaying until the sandbox's PID namespace ends with the command. (`serve` is
also the tests' loopback bridge into a network namespace, tests/harness/netns.py.)
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from collections.abc import Callable


def pump(source: socket.socket, sink: socket.socket) -> None:
    """Copies `source` to `sink` until `source` ends, then half-closes both."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            with contextlib.suppress(OSError):
                sock.shutdown(how)


def relay(accepted: socket.socket, connect: Callable[[], socket.socket]) -> None:
    """Joins `accepted` to a new `connect()` both ways until both directions end."""
    try:
        upstream = connect()
    except OSError:
        accepted.close()
        return
    back = threading.Thread(target=pump, args=(upstream, accepted), daemon=True)
    back.start()
    pump(accepted, upstream)
    back.join()
    accepted.close()
    upstream.close()


def serve(listener: socket.socket, connect: Callable[[], socket.socket]) -> threading.Thread:
    """Relays every connection accepted on `listener` to a new `connect()`, until it is closed."""

    def loop() -> None:
        while True:
            try:
                accepted, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=relay, args=(accepted, connect), daemon=True).start()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def _unix(path: str) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        return sock

    return connect


def main(pairs: list[str]) -> int:
    listeners = []
    for pair in pairs:
        port, _, path = pair.partition("=")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(port)))
        listener.listen(64)
        listeners.append((listener, path))
    if os.fork() > 0:
        return 0  # listening: the command may start
    os.setsid()
    for stream in (0, 1, 2):  # hold no pipe of the command's: its output must end with it
        os.dup2(os.open(os.devnull, os.O_RDWR), stream)
    threads = [serve(listener, _unix(path)) for listener, path in listeners]
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
