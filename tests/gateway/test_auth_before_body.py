"""The caller is authenticated before the request body is read, on every route that takes a body:
a client without a key (or with a token of another attempt) is answered while its body is still
unsent, so a large unauthenticated body costs the gateway nothing.

Each test opens a raw connection, declares a 1 MB body, sends 1 KB of it, and waits (bounded) for
the answer. A gateway that reads the body first never answers: it waits for the rest.
"""

from __future__ import annotations

import socket
import time

import pytest

from tests.conftest import Gateway

DECLARED = 1_000_000
SENT = b"[" + b" " * 1023


def _answer_before_body(port: int, method: str, path: str, authorization: str | None) -> int:
    """The status of the answer to a request whose body is mostly unsent; fails after 10 s."""
    head = [
        f"{method} {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {DECLARED}",
    ]
    if authorization is not None:
        head.append(f"Authorization: {authorization}")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + SENT)
        received = b""
        deadline = time.monotonic() + 5
        while b"\r\n" not in received:
            assert time.monotonic() < deadline, "no answer while the body was unsent"
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                pytest.fail(f"{method} {path}: no answer while the body was unsent")
            if not chunk:
                break
            received += chunk
    status_line = received.split(b"\r\n", 1)[0].decode()
    assert status_line.startswith("HTTP/1.1 "), status_line
    return int(status_line.split()[1])


BODY_ROUTES = [
    ("POST", "/api/rollouts"),
    ("PATCH", "/api/rollouts/r"),
    ("POST", "/api/rollouts/r/attempts"),
    ("POST", "/api/rollouts/r/attempt/1/events"),
    ("POST", "/api/models"),
    ("POST", "/proxy/rollout/r/attempt/1/mode/train/openai/v1/chat/completions"),
    ("POST", "/proxy/rollout/r/attempt/1/mode/train/openai/v1/completions"),
    ("POST", "/api/records"),
    ("POST", "/api/rollouts/stats"),
    ("POST", "/api/leases/controller"),
    ("POST", "/api/leases/controller/rollouts/r/attempts"),
    ("PATCH", "/api/leases/controller/rollouts/r"),
    ("POST", "/api/leases/controller/rollouts/r/attempt/1/events"),
]


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key"])
def test_a_caller_without_a_key_is_refused_before_the_body_is_read(
    gateway: Gateway, method: str, path: str, authorization: str | None
) -> None:
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    gateway.http.post("/api/rollouts/r/attempts")
    port = int(gateway.url.rsplit(":", 1)[1])
    assert _answer_before_body(port, method, path, authorization) == 401


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES[:3] + BODY_ROUTES[4:5] + BODY_ROUTES[7:])
def test_a_scoped_token_on_an_admin_route_is_refused_before_the_body_is_read(
    gateway: Gateway, method: str, path: str
) -> None:
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    token = gateway.http.post("/api/rollouts/r/attempts").json()["token"]
    port = int(gateway.url.rsplit(":", 1)[1])
    assert _answer_before_body(port, method, path, f"Bearer {token}") == 403


def test_a_token_of_another_attempt_is_refused_before_the_event_body_is_read(
    gateway: Gateway,
) -> None:
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}, {"rollout_id": "s"}])
    gateway.http.post("/api/rollouts/r/attempts")
    other = gateway.http.post("/api/rollouts/s/attempts").json()["token"]
    port = int(gateway.url.rsplit(":", 1)[1])
    status = _answer_before_body(
        port, "POST", "/api/rollouts/r/attempt/1/events", f"Bearer {other}"
    )
    assert status == 403


def test_every_route_that_takes_a_body_is_in_this_file(gateway: Gateway) -> None:
    """A new route with a body must be added to BODY_ROUTES (or the wire routes' own test)."""
    schema = gateway.http.get("/openapi.json").json()
    with_body = {
        (method.upper(), path)
        for path, operations in schema["paths"].items()
        for method, operation in operations.items()
        if "requestBody" in operation
    }
    known = {
        (m, p.replace("/r/", "/{rollout_id}/").replace("/1/", "/{attempt_id}/"))
        for m, p in BODY_ROUTES
    }
    known = {(m, p.replace("/rollouts/r", "/rollouts/{rollout_id}")) for m, p in known}
    known = {(m, p.replace("/mode/train/", "/mode/{mode}/")) for m, p in known}
    known = {(m, p.replace("/leases/controller", "/leases/{name}")) for m, p in known}
    missing = {(m, p) for m, p in with_body if "/proxy/" not in p} - known
    assert not missing, missing
