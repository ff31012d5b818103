"""A NUL character in an id or a text field: PostgreSQL's text cannot hold one (its driver fails
the statement), so every route answers the same on both stores: a lookup names no row (404, or
nothing matches), a write is refused with a 422 naming the field. Each was a 500 on PostgreSQL
(and a NUL idempotency key failed the whole group commit it shared), while SQLite stored it."""

from __future__ import annotations

from tests.conftest import Gateway


def test_a_rollout_id_with_a_nul_names_no_rollout(gateway: Gateway) -> None:
    http = gateway.http
    assert http.get("/api/rollouts/r%00").status_code == 404
    assert http.patch("/api/rollouts/r%00", json={"metadata": {"a": 1}}).status_code == 404
    running = {"status": {"state": "running"}}
    assert http.patch("/api/rollouts/r%00", json=running).status_code == 404
    assert http.post("/api/rollouts/r%00/attempts").status_code == 404
    posted = http.post("/api/rollouts/r%00/attempt/1/events", json={"type": "note"})
    assert posted.status_code == 404, posted.text
    assert "does not exist" in http.get("/api/rollouts/r%00").json()["error"]
    for key in ("group_id", "run", "q"):
        page = http.get("/api/rollouts", params={key: "g\x00"})
        assert page.status_code == 200 and page.json()["items"] == []
    assert http.delete("/api/models", params={"model": "m\x00"}).json() == {"deleted": 0}


def test_a_text_field_with_a_nul_is_422_naming_it_and_nothing_is_stored(
    gateway: Gateway,
) -> None:
    http = gateway.http
    http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    http.post("/api/rollouts/r/attempts")
    events = "/api/rollouts/r/attempt/1/events"

    keyed = http.post(events, json={"type": "note", "idempotency_key": "k\x00"})
    assert keyed.status_code == 422, keyed.text
    # Named where it is in the body (it was `["idempotency_key"]`, and "event 0 of the post"
    # for the second event of a list), as every other field's error is.
    assert keyed.json()["detail"][0]["loc"] == ["body", "idempotency_key"]
    assert "NUL" in keyed.json()["error"]
    listed = http.post(events, json=[{"type": "note"}, {"type": "note", "idempotency_key": "\x00"}])
    assert listed.status_code == 422, listed.text
    assert listed.json()["detail"][0]["loc"] == ["body", 1, "idempotency_key"]
    assert listed.json()["error"].startswith("body.1.idempotency_key: ")

    ended = http.patch("/api/rollouts/r", json={"status": {"state": "failed", "reason": "x\x00"}})
    assert ended.status_code == 422, ended.text
    assert ended.json()["detail"][0]["loc"] == ["body", "status", "reason"]
    retried = http.post("/api/rollouts/r/attempts", json={"reason": "x\x00"})
    assert retried.status_code == 422, retried.text
    assert retried.json()["detail"][0]["loc"] == ["body", "reason"]

    endpoint = {"model": "m", "endpoint": "http://127.0.0.1:1/v\x001"}
    assert http.post("/api/models", json=endpoint).status_code == 422
    engine = {"model": "m", "endpoint": "http://127.0.0.1:1/v1", "engine": "vllm\x00"}
    refused = http.post("/api/models", json=engine)
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "engine"]
    listed = http.post("/api/models", json=[{"model": "m", "endpoint": "http://a/v1"}, endpoint])
    assert listed.status_code == 422, listed.text
    assert listed.json()["detail"][0]["loc"] == ["body", 1, "endpoint"]

    detail = http.get("/api/rollouts/r").json()
    assert detail["rollout"]["status"] == {"state": "running", "reason": None}
    assert [a["attempt_id"] for a in detail["attempts"]] == [1]
    assert http.get("/api/rollouts/r/events").json() == []
    assert http.get("/api/models").json() == []
    # The gateway serves on: the same post without the NUL is stored.
    stored = http.post(events, json={"type": "note", "idempotency_key": "k"})
    assert stored.status_code == 200, stored.text
    assert [e["idempotency_key"] for e in http.get("/api/rollouts/r/events").json()] == ["k"]
