"""Model registry: register, list, update the weight version, delete."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Gateway
from tests.stub_engine import StubEngine

A = "http://127.0.0.1:8001/v1"
B = "http://127.0.0.1:8002/v1"


def test_register_one_endpoint_as_in_agent_lightning(gateway: Gateway) -> None:
    response = gateway.http.post("/api/models", json={"model": "policy", "endpoint": A})
    assert response.status_code == 200
    (model,) = response.json()
    assert model["model"] == "policy"
    assert model["endpoints"] == [A]
    assert model["weight_version"] == 0


def test_register_a_list_of_endpoints_for_one_model(gateway: Gateway) -> None:
    gateway.http.post(
        "/api/models", json=[{"model": "policy", "endpoint": A}, {"model": "policy", "endpoint": B}]
    )
    (model,) = gateway.http.get("/api/models").json()
    assert model["endpoints"] == [A, B]


def test_registering_again_updates_the_weight_version(gateway: Gateway) -> None:
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": A})
    gateway.http.post("/api/models", json={"model": "policy", "endpoint": A, "weight_version": 3})
    (model,) = gateway.http.get("/api/models").json()
    assert model["weight_version"] == 3
    assert model["endpoints"] == [A]


def test_delete_one_model_or_all(gateway: Gateway) -> None:
    gateway.http.post(
        "/api/models", json=[{"model": "a", "endpoint": A}, {"model": "b", "endpoint": B}]
    )
    assert gateway.http.delete("/api/models", params={"model": "a"}).json() == {"deleted": 1}
    assert [m["model"] for m in gateway.http.get("/api/models").json()] == ["b"]
    assert gateway.http.delete("/api/models").json() == {"deleted": 1}
    assert gateway.http.get("/api/models").json() == []


def test_an_endpoint_must_be_an_http_url(gateway: Gateway) -> None:
    response = gateway.http.post("/api/models", json={"model": "a", "endpoint": "ftp://x"})
    assert response.status_code == 422
    assert "endpoint" in response.json()["error"]


@pytest.mark.parametrize(
    "endpoint",
    ["http://127.0.0.1:99999/v1", "http://[::1/v1", "http://127.0.0.1:port/v1", "http:///v1"],
)
def test_an_endpoint_no_request_can_go_to_is_refused(gateway: Gateway, endpoint: str) -> None:
    """Registered, each made every call to its model fail (a 502 at best)."""
    response = gateway.http.post("/api/models", json={"model": "a", "endpoint": endpoint})
    assert response.status_code == 422, response.text
    assert "endpoint" in response.json()["error"]
    assert gateway.http.get("/api/models").json() == []
    ok = gateway.http.post("/api/models", json={"model": "a", "endpoint": "http://[::1]:8000/v1"})
    assert ok.status_code == 200


def test_a_name_the_proxy_does_not_know_goes_to_the_first_registered_model(
    gateway: Gateway, stub: StubEngine
) -> None:
    # Registered first but last by name: the default is the registration order, not the name's.
    gateway.http.post("/api/models", json={"model": "zeta", "endpoint": stub.base_url})
    gateway.http.post("/api/models", json={"model": "alpha", "endpoint": "http://127.0.0.1:9/v1"})
    assert [m["model"] for m in gateway.http.get("/api/models").json()] == ["zeta", "alpha"]
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    response = httpx.post(
        f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train/openai/v1/chat/completions",
        json={"model": "claude-sonnet", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {gateway.api_key}"},
    )
    assert response.status_code == 200
    (event,) = gateway.http.get("/api/rollouts/r/events").json()
    assert (event["data"]["model"], event["data"]["endpoint"]) == ("zeta", stub.base_url)
