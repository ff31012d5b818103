"""Bad input gets a clear 4xx naming the field and the rule, never a 500."""

from __future__ import annotations

import gzip
from pathlib import Path

import anthropic
import httpx
import pytest

from reins.gateway import GatewaySettings
from tests.conftest import ADMIN_KEY, Gateway, serve


def test_malformed_json_is_422(gateway: Gateway) -> None:
    response = gateway.http.post(
        "/api/rollouts", content=b"[{oops", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert "malformed JSON" in response.json()["error"]


def test_a_json_body_sent_as_another_content_type_is_415_saying_so(gateway: Gateway) -> None:
    """It was a 422 "body: Input should be a valid list" for the very list curl's `-d` sent."""
    listed = b'[{"rollout_id": "r"}]'
    for content_type in ("application/x-www-form-urlencoded", "text/plain", ""):
        response = gateway.http.post(
            "/api/rollouts", content=listed, headers={"content-type": content_type}
        )
        assert response.status_code == 415, response.text
        assert "Content-Type: application/json" in response.json()["error"]
    assert gateway.http.get("/api/rollouts").json()["items"] == []
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    patch = gateway.http.patch(
        "/api/rollouts/r", content=b'{"metadata": {"a": 1}}', headers={"content-type": "text/plain"}
    )
    assert patch.status_code == 415
    assert "as text/plain" in patch.json()["error"]
    assert gateway.http.get("/api/rollouts/r").json()["rollout"]["metadata"] == {}
    # A route whose body is optional still takes none, whatever the type.
    opened = gateway.http.post("/api/rollouts/r/attempts", headers={"content-type": "text/plain"})
    assert opened.status_code == 200
    # The event post, served by its own fast endpoint (`reins.gateway.fast`), answers as its
    # FastAPI twin: it stored the event.
    events = "/api/rollouts/r/attempt/1/events"
    for content_type in ("text/plain", ""):
        posted = gateway.http.post(
            events, content=b'{"type": "note", "data": {}}', headers={"content-type": content_type}
        )
        assert posted.status_code == 415, posted.text
        assert "Content-Type: application/json" in posted.json()["error"]
    assert gateway.http.get("/api/rollouts/r/events").json() == []
    posted = gateway.http.post(events, json={"type": "note", "data": {}})
    assert posted.status_code == 200, posted.text


def test_a_bad_field_is_422_naming_field_and_rule(gateway: Gateway) -> None:
    response = gateway.http.post("/api/rollouts", json=[{"mode": "test"}])
    assert response.status_code == 422
    assert response.json()["error"] == "body.0.mode: Input should be 'train' or 'val'"


def test_a_body_of_one_or_many_names_the_field_of_what_was_sent(gateway: Gateway) -> None:
    """Events and models take one object or a list: the error was both of pydantic's branches,
    `body.EventIn.data: Input should be a valid dictionary; body.list[EventIn]: Input should be
    a valid list`, naming a class the client never sent and a list it did not send."""
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    gateway.http.post("/api/rollouts/r/attempts")
    events = "/api/rollouts/r/attempt/1/events"
    cases = [
        (events, {"type": "note", "data": [1]}, "body.data", ["body", "data"]),
        (events, [{"type": "ok"}, {"type": "a b"}], "body.1.type", ["body", 1, "type"]),
        (events, [{"type": "ok"}] * 10_001, "body", ["body"]),
        ("/api/models", {"model": "m", "endpoint": "ftp:"}, "body.endpoint", ["body", "endpoint"]),
        ("/api/models", [{"model": "m"}], "body.0.endpoint", ["body", 0, "endpoint"]),
    ]
    for path, body, field, loc in cases:
        response = gateway.http.post(path, json=body)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error.startswith(f"{field}: ") and ";" not in error, error
        assert [e["loc"] for e in response.json()["detail"]] == [loc]
    # Neither an object nor a list: both shapes are named.
    neither = gateway.http.post(events, json="note")
    assert neither.status_code == 422
    assert "EventIn" in neither.json()["error"] and "list[EventIn]" in neither.json()["error"]
    assert gateway.http.get("/api/rollouts/r/events").json() == []


def test_a_path_or_method_no_route_has_is_named_in_the_error(gateway: Gateway) -> None:
    """Starlette's "Not Found" and "Method Not Allowed" named neither the path nor the method:
    a rollout id with a `/` (even escaped, %2F) read as if the rollout were missing."""
    slashed = gateway.http.get("/api/rollouts/a%2Fb")
    assert slashed.status_code == 404
    assert slashed.json()["error"].startswith("GET /api/rollouts/a/b: no such route")
    deleted = gateway.http.delete("/api/rollouts/r")
    assert deleted.status_code == 405
    assert deleted.json()["error"] == (
        "DELETE /api/rollouts/r: this path does not take DELETE (it takes GET, PATCH)"
    )
    call = gateway.http.get("/proxy/rollout/r/attempt/1/mode/train/openai/v1/chat/completions")
    assert call.status_code == 405
    assert "does not take GET (it takes POST)" in call.json()["error"]["message"]  # OpenAI's shape


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/api/rollouts", "GET, POST"),  # two routes: the list and the declaration
        ("PUT", "/healthz", "GET, HEAD"),
        ("DELETE", "/api/rollouts/r/attempt/1/events", "POST"),
        ("PUT", "/api/rollouts/r/events", "GET"),
    ],
)
def test_a_405_allows_every_method_of_its_path(
    gateway: Gateway, method: str, path: str, allowed: str
) -> None:
    """Starlette's `Allow` named the methods of the first route of the path only."""
    answer = gateway.http.request(method, path)
    assert answer.status_code == 405
    assert answer.headers["allow"] == allowed
    assert answer.json()["error"].endswith(f"(it takes {allowed})")


def test_a_body_sent_to_a_route_that_takes_none_is_422_not_ignored(gateway: Gateway) -> None:
    """FastAPI ignored it: `DELETE /api/models` with `{"model": "m"}` deleted every model."""
    for name in ("m", "n"):
        gateway.http.post("/api/models", json={"model": name, "endpoint": "http://127.0.0.1:1"})
    deleted = gateway.http.request("DELETE", "/api/models", json={"model": "m"})
    assert deleted.status_code == 422, deleted.text
    assert "takes no body" in deleted.json()["error"]
    assert "query string" in deleted.json()["error"]
    assert [m["model"] for m in gateway.http.get("/api/models").json()] == ["m", "n"]
    drained = gateway.http.post("/api/admission/drain", json={"timeout_s": 5})
    assert drained.status_code == 422
    listed = gateway.http.request("GET", "/api/rollouts", json={"status": "failed"})
    assert listed.status_code == 422
    # No body, or an empty one, is no body.
    assert gateway.http.delete("/api/models", params={"model": "m"}).json() == {"deleted": 1}
    empty = gateway.http.post("/api/admission/pause", content=b"")
    assert empty.status_code == 200


def test_a_query_parameter_the_route_does_not_take_is_422_not_ignored(gateway: Gateway) -> None:
    """FastAPI ignored it: `DELETE /api/models?name=m` deleted every model, and
    `GET /api/rollouts?state=failed` listed every state."""
    for name in ("m", "n"):
        gateway.http.post("/api/models", json={"model": name, "endpoint": "http://127.0.0.1:1"})
    deleted = gateway.http.delete("/api/models", params={"name": "m"})
    assert deleted.status_code == 422, deleted.text
    assert deleted.json()["detail"][0]["loc"] == ["query", "name"]
    assert "(it takes: model)" in deleted.json()["error"]
    assert [m["model"] for m in gateway.http.get("/api/models").json()] == ["m", "n"]
    listed = gateway.http.get("/api/rollouts", params={"state": "failed"})
    assert listed.status_code == 422
    assert "status" in listed.json()["error"]
    read = gateway.http.get("/api/rollouts/r/events", params={"types": "reward"})
    assert read.status_code == 422
    assert "type" in read.json()["error"]
    # The parameters each route declares, its dependencies' included, are taken.
    assert gateway.http.get("/api/rollouts", params={"status": "failed", "q": "x"}).is_success
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    events = gateway.http.get("/api/rollouts/r/events", params={"type": "a", "after": 0})
    assert events.is_success
    assert gateway.http.delete("/api/models", params={"model": "m"}).json() == {"deleted": 1}
    # The event post too (its fast endpoint): a key sent as a parameter was no key.
    gateway.http.post("/api/rollouts/r/attempts")
    keyed = gateway.http.post(
        "/api/rollouts/r/attempt/1/events",
        params={"idempotency_key": "k"},
        json={"type": "note"},
    )
    assert keyed.status_code == 422
    assert keyed.json()["detail"][0]["loc"] == ["query", "idempotency_key"]
    assert gateway.http.get("/api/rollouts/r/events").json() == []


def test_a_single_valued_query_parameter_given_twice_is_422(gateway: Gateway) -> None:
    """FastAPI kept the last value: `?attempt_id=1&attempt_id=2` read attempt 2 alone."""
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    twice = gateway.http.get(
        "/api/rollouts/r/events", params=[("attempt_id", 1), ("attempt_id", 2)]
    )
    assert twice.status_code == 422, twice.text
    assert twice.json()["detail"] == [
        {"loc": ["query", "attempt_id"], "msg": "given more than once", "type": "repeated"}
    ]
    # A parameter that takes a list takes it repeated.
    listed = gateway.http.get("/api/rollouts/r/events", params=[("type", "a"), ("type", "b")])
    assert listed.status_code == 200, listed.text


PROXY_GETS = [
    "/proxy/rollout/r/attempt/{attempt}/mode/train/openai/v1/models",
    "/proxy/rollout/r/attempt/{attempt}/mode/train/anthropic/v1/models",
    "/proxy/rollout/r/attempt/{attempt}/mode/train/anthropic/v1/models/m",
]


@pytest.mark.parametrize("path", PROXY_GETS)
def test_the_proxys_get_routes_check_the_caller_before_the_path(
    gateway: Gateway, path: str
) -> None:
    """They validated the path first: no key and attempt 0 was a 400 about the path (its
    message twice: the route and its auth dependency both declare `attempt_id`)."""
    with gateway.client() as anonymous:
        assert anonymous.get(path.format(attempt=0)).status_code == 401
        assert anonymous.get(path.format(attempt="x")).status_code == 401
    refused = gateway.http.get(path.format(attempt=0))
    assert refused.status_code == 400
    assert refused.text.count("greater than or equal to 1") == 1, refused.text


@pytest.mark.parametrize("attempt", ["1_0", "+10", "%2010"])
def test_an_attempt_id_is_read_in_decimal_digits_only(gateway: Gateway, attempt: str) -> None:
    """Pydantic read `1_0` as attempt 10 (and `+10`, ` 10`): another attempt than written."""
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    for _ in range(10):
        gateway.http.post("/api/rollouts/r/attempts")
    path = f"/proxy/rollout/r/attempt/{attempt}/mode/train/openai/v1/models"
    assert gateway.http.get(path).status_code == 400
    assert gateway.http.get(path.replace(attempt, "10")).status_code == 200


def test_an_unsafe_rollout_id_is_422(gateway: Gateway) -> None:
    response = gateway.http.post("/api/rollouts", json=[{"rollout_id": "a/b"}])
    assert response.status_code == 422
    assert "rollout_id" in response.json()["error"]


def test_a_bad_query_parameter_is_422(gateway: Gateway) -> None:
    response = gateway.http.get("/api/rollouts", params={"cursor": -1})
    assert response.status_code == 422
    assert "cursor" in response.json()["error"]


def test_an_oversize_body_is_413_naming_the_limit(tmp_path: Path) -> None:
    settings = GatewaySettings(
        database_url=str(tmp_path / "g.db"), api_key=ADMIN_KEY, max_body_bytes=4096
    )
    with serve(settings) as server:
        response = httpx.post(
            f"http://127.0.0.1:{server.port}/api/rollouts",
            json=[{"input": "x" * 5000}],
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
    assert response.status_code == 413
    assert "4096 bytes" in response.json()["error"]


def test_an_oversize_chunked_body_is_413(tmp_path: Path) -> None:
    settings = GatewaySettings(
        database_url=str(tmp_path / "g.db"), api_key=ADMIN_KEY, max_body_bytes=4096
    )

    def chunks() -> object:
        yield b'[{"input": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]'

    with serve(settings) as server:
        response = httpx.post(
            f"http://127.0.0.1:{server.port}/api/rollouts",
            content=chunks(),  # type: ignore[arg-type]
            headers={"Authorization": f"Bearer {ADMIN_KEY}", "content-type": "application/json"},
        )
    assert response.status_code == 413


def test_an_oversize_body_on_the_proxy_is_413_in_the_harness_apis_shape(tmp_path: Path) -> None:
    """The SDKs send a Content-Length, which the limit answers before any route: Anthropic's
    SDK reads `request_too_large`, the OpenAI one `error.message`, from their own shapes only."""
    settings = GatewaySettings(
        database_url=str(tmp_path / "g.db"), api_key=ADMIN_KEY, max_body_bytes=4096
    )
    limit = (
        "the request body is larger than the limit of 4096 bytes "
        "(the gateway's REINS_MAX_BODY_BYTES)"
    )
    messages = [{"role": "user", "content": "x" * 5000}]
    with serve(settings) as server:
        base = f"http://127.0.0.1:{server.port}/proxy/rollout/r/attempt/1/mode/train"
        sdk = anthropic.Anthropic(base_url=f"{base}/anthropic", api_key=ADMIN_KEY, max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as raised:
            sdk.messages.create(model="m", max_tokens=8, messages=messages)  # type: ignore[arg-type]
        openai_answer = httpx.post(
            f"{base}/openai/v1/chat/completions",
            json={"model": "m", "messages": messages},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
    assert raised.value.status_code == 413
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "request_too_large", "message": limit},
    }
    assert openai_answer.status_code == 413
    assert openai_answer.json()["error"]["message"] == limit


def test_a_compressed_body_is_415_saying_to_send_it_uncompressed(gateway: Gateway) -> None:
    """It was read as JSON: "malformed JSON ... str is not valid UTF-8", which hid the cause."""
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    gateway.http.post("/api/rollouts/r/attempts")
    gzipped = {"content-type": "application/json", "content-encoding": "gzip"}
    for path, body in [
        ("/api/rollouts", b'[{"rollout_id": "s"}]'),
        ("/api/rollouts/r/attempt/1/events", b'{"type": "note"}'),
    ]:
        response = gateway.http.post(path, content=gzip.compress(body), headers=gzipped)
        assert response.status_code == 415, response.text
        assert "encoded (gzip)" in response.json()["error"]
        assert "send it uncompressed" in response.json()["error"]
    call = gateway.http.post(
        "/proxy/rollout/r/attempt/1/mode/train/openai/v1/chat/completions",
        content=gzip.compress(b'{"model": "m", "messages": []}'),
        headers=gzipped,
    )
    assert call.status_code == 415
    assert "encoded (gzip)" in call.json()["error"]["message"]  # the OpenAI API's shape
    assert [r["rollout_id"] for r in gateway.http.get("/api/rollouts").json()["items"]] == ["r"]
    assert gateway.http.get("/api/rollouts/r/events").json() == []
    # No body, nothing to decode: a GET that names an encoding is served.
    assert gateway.http.get("/api/rollouts/r", headers={"content-encoding": "gzip"}).is_success


def test_the_openapi_schema_needs_the_admin_key(gateway: Gateway) -> None:
    anonymous = gateway.client().get("/openapi.json")
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"] == "Bearer"
    schema = gateway.http.get("/openapi.json")
    assert schema.status_code == 200
    assert "/api/rollouts" in schema.json()["paths"]


def test_no_docs_page_that_needs_a_cdn_is_served(gateway: Gateway) -> None:
    """FastAPI's /docs and /redoc load their scripts from a CDN, which fails offline."""
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert gateway.client().get(path).status_code == 404, path
        assert gateway.http.get(path).status_code == 404, path


def test_a_huge_dashboard_page_number_is_the_last_page(gateway: Gateway) -> None:
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    for page in (str(10**18), str(10**30), "-5"):
        response = gateway.http.get("/ui", params={"page": page})
        assert response.status_code == 200, (page, response.text[:300])
        assert 'href="/ui/rollouts/r"' in response.text
        assert gateway.http.get("/ui/rows", params={"page": page}).status_code == 200


def test_a_huge_event_seq_is_404(gateway: Gateway) -> None:
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    for seq in (2**63, 10**30, 0, -1):
        response = gateway.http.get(f"/ui/rollouts/r/events/{seq}")
        assert response.status_code == 404, (seq, response.text[:300])
        assert "no event with seq" in response.json()["error"]


def test_the_dashboard_links_the_schema_it_serves(gateway: Gateway) -> None:
    page = gateway.http.get("/ui").text
    assert 'href="/docs"' not in page
    assert 'href="/ui/openapi.json"' in page
    assert "/api/rollouts" in gateway.http.get("/ui/openapi.json").json()["paths"]
    assert gateway.client().get("/ui/openapi.json", follow_redirects=False).status_code == 303
