"""Auth: the admin key, and scoped tokens that allow only their own attempt's proxy and events."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Gateway


@pytest.fixture
def token(gateway: Gateway) -> str:
    """The token of attempt 1 of rollout `mine`; rollout `other` exists too."""
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "mine"}, {"rollout_id": "other"}])
    gateway.http.post("/api/rollouts/other/attempts")
    return str(gateway.http.post("/api/rollouts/mine/attempts").json()["token"])


def test_healthz_needs_no_key(gateway: Gateway) -> None:
    assert gateway.client().get("/healthz").status_code == 200
    head = gateway.client().head("/healthz")  # uptime monitors and `curl -I` (it was 405)
    assert head.status_code == 200 and head.content == b""


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic abc", "Bearer"])
def test_admin_routes_refuse_a_missing_or_wrong_key(gateway: Gateway, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    response = gateway.client().get("/api/rollouts", headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"


def test_token_posts_events_to_its_own_attempt(gateway: Gateway, token: str) -> None:
    response = gateway.client(token).post(
        "/api/rollouts/mine/attempt/1/events", json={"type": "reward", "data": {"value": 1}}
    )
    assert response.status_code == 200


def test_token_cannot_post_events_to_another_rollout(gateway: Gateway, token: str) -> None:
    response = gateway.client(token).post(
        "/api/rollouts/other/attempt/1/events", json={"type": "x"}
    )
    assert response.status_code == 403


def test_token_cannot_post_events_to_another_attempt(gateway: Gateway, token: str) -> None:
    gateway.http.post("/api/rollouts/mine/attempts")
    response = gateway.client(token).post("/api/rollouts/mine/attempt/2/events", json={"type": "x"})
    assert response.status_code == 403


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/api/rollouts/mine", None),
        ("GET", "/api/rollouts/other", None),
        ("GET", "/api/rollouts/mine/events", None),
        ("GET", "/api/rollouts/other/events", None),
        ("GET", "/api/rollouts", None),
        ("POST", "/api/rollouts", [{"rollout_id": "new"}]),
        ("PATCH", "/api/rollouts/mine", {"status": {"state": "succeeded"}}),
        ("PATCH", "/api/rollouts/other", {"status": {"state": "failed"}}),
        ("POST", "/api/rollouts/mine/attempts", None),
        ("POST", "/api/models", {"model": "m", "endpoint": "http://127.0.0.1:9/v1"}),
        ("GET", "/api/models", None),
        ("DELETE", "/api/models", None),
    ],
)
def test_token_cannot_use_admin_routes(
    gateway: Gateway, token: str, method: str, path: str, body: object
) -> None:
    response = gateway.client(token).request(method, path, json=body)
    assert response.status_code == 403
    assert "admin key" in response.json()["error"]
    rollout = gateway.http.get("/api/rollouts/mine").json()["rollout"]
    assert rollout["status"]["state"] == "running"
    assert gateway.http.get("/api/models").json() == []


def test_tokens_survive_a_gateway_restart(gateway_settings: object, database_url: str) -> None:
    from reins.gateway import GatewaySettings
    from tests.conftest import serve

    settings = GatewaySettings(database_url=database_url, api_key="k")
    headers = {"Authorization": "Bearer k"}
    import httpx

    with serve(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        httpx.post(f"{url}/api/rollouts", json=[{"rollout_id": "r"}], headers=headers)
        token = httpx.post(f"{url}/api/rollouts/r/attempts", headers=headers).json()["token"]
    with serve(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        response = httpx.post(
            f"{url}/api/rollouts/r/attempt/1/events",
            json={"type": "x"},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert response.status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        "/api/rollouts/r/attempt/0/events",
        "/api/rollouts/r/attempt/abc/events",
        "/proxy/rollout/r/attempt/0/mode/train/openai/v1/chat/completions",
        "/proxy/rollout/r/attempt/1/mode/foo/openai/v1/chat/completions",
    ],
)
def test_a_caller_without_a_key_hears_of_the_key_before_the_path(
    gateway: Gateway, path: str
) -> None:
    """The fast endpoints checked the path first: no key, and a 422 (or 400) about the path."""
    answer = httpx.post(f"{gateway.url}{path}", json={"type": "t"})
    assert answer.status_code == 401, answer.text
    assert answer.headers.get("www-authenticate") == "Bearer"
    # Another attempt's scoped token: refused as the twins refuse it (403), not told the path.
    scoped = {"Authorization": "Bearer rk-at-another-attempts-token"}
    assert httpx.post(f"{gateway.url}{path}", json={"type": "t"}, headers=scoped).status_code == 403
