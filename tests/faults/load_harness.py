"""One harness process of the load test: chat calls through the gateway's proxy, back to back.

`python -m tests.faults.load_harness BASE_URL TOKEN SECONDS OUT` calls `BASE_URL/chat/completions`
(the proxy URL of its attempt) until SECONDS have passed, each call with a unique user message
(`<pid>-<n>`), so the test can match every answered call to exactly one recorded event. It
creates OUT + ".ready" once imported and waits for OUT + ".go", so all processes start together.
Writes {"start", "end" (CLOCK_MONOTONIC, shared by every process), "calls": [[message, latency_s,
status], ...]} to OUT. The standard library's `http.client` (one keep-alive connection), as a
light harness: 64 of them must start and run on 2 cores beside the gateway.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit


def main(base_url: str, token: str, seconds: float, out: Path) -> None:
    Path(f"{out}.ready").touch()
    go = Path(f"{out}.go")
    deadline = time.monotonic() + 300
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit("the load test never said go")
        time.sleep(0.01)
    url = urlsplit(base_url)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    calls: list[tuple[str, float, int]] = []
    start = time.monotonic()
    while time.monotonic() < start + seconds:
        message = f"{os.getpid()}-{len(calls)}"
        body = {"model": "policy", "messages": [{"role": "user", "content": message}]}
        started = time.perf_counter()
        try:
            connection.request("POST", f"{url.path}/chat/completions", json.dumps(body), headers)
            answer = connection.getresponse()
            answer.read()
            status = answer.status
        except (OSError, http.client.HTTPException):
            connection.close()  # reconnects on the next request
            status = 0
        calls.append((message, time.perf_counter() - started, status))
    end = time.monotonic()
    out.write_text(json.dumps({"start": start, "end": end, "calls": calls}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), Path(sys.argv[4]))
