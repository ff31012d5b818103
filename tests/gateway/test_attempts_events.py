"""Attempts and events: retries, per-attempt events, idempotent posts."""

from __future__ import annotations

from tests.conftest import Gateway


def start(gateway: Gateway, rollout_id: str = "r") -> str:
    gateway.http.post("/api/rollouts", json=[{"rollout_id": rollout_id}])
    response = gateway.http.post(f"/api/rollouts/{rollout_id}/attempts")
    assert response.status_code == 200, response.text
    return str(response.json()["token"])


def post(gateway: Gateway, path: str, body: object) -> dict[str, object]:
    response = gateway.http.post(path, json=body)
    assert response.status_code == 200, response.text
    return dict(response.json()) if isinstance(response.json(), dict) else {"list": response.json()}


def test_first_attempt_makes_the_rollout_running(gateway: Gateway) -> None:
    start(gateway)
    assert gateway.http.get("/api/rollouts/r").json()["rollout"]["status"]["state"] == "running"


def test_retry_opens_the_next_attempt_and_fails_the_previous(gateway: Gateway) -> None:
    start(gateway)
    second = gateway.http.post("/api/rollouts/r/attempts", json={"reason": "agent crashed"}).json()
    assert second["attempt_id"] == 2
    attempts = gateway.http.get("/api/rollouts/r").json()["attempts"]
    assert [(a["attempt_id"], a["state"], a["reason"]) for a in attempts] == [
        (1, "failed", "agent crashed"),
        (2, "running", None),
    ]


def test_naming_the_attempt_makes_opening_idempotent(gateway: Gateway) -> None:
    start(gateway)
    first = gateway.http.post("/api/rollouts/r/attempts", json={"attempt_id": 2}).json()
    again = gateway.http.post("/api/rollouts/r/attempts", json={"attempt_id": 2}).json()
    assert first == again
    assert gateway.http.get("/api/rollouts/r").json()["rollout"]["attempt_count"] == 2


def test_opening_a_later_attempt_out_of_order_is_409(gateway: Gateway) -> None:
    start(gateway)
    response = gateway.http.post("/api/rollouts/r/attempts", json={"attempt_id": 5})
    assert response.status_code == 409
    assert "next attempt of rollout r is 2" in response.json()["error"]


def test_no_attempt_opens_on_a_terminal_rollout(gateway: Gateway) -> None:
    start(gateway)
    gateway.http.patch("/api/rollouts/r", json={"status": {"state": "succeeded"}})
    response = gateway.http.post("/api/rollouts/r/attempts")
    assert response.status_code == 409


def test_events_read_back_in_order_from_the_latest_attempt(gateway: Gateway) -> None:
    start(gateway)
    post(gateway, "/api/rollouts/r/attempt/1/events", {"type": "note", "data": {"n": 1}})
    gateway.http.post("/api/rollouts/r/attempts")
    for n in (2, 3):
        post(gateway, "/api/rollouts/r/attempt/2/events", {"type": "note", "data": {"n": n}})
    latest = gateway.http.get("/api/rollouts/r/events").json()
    assert [e["data"]["n"] for e in latest] == [2, 3]
    assert all(e["attempt_id"] == 2 for e in latest)
    first = gateway.http.get("/api/rollouts/r/events", params={"attempt_id": 1}).json()
    assert [e["data"]["n"] for e in first] == [1]
    every = gateway.http.get("/api/rollouts/r/events", params={"all_attempts": True}).json()
    assert [e["data"]["n"] for e in every] == [1, 2, 3]


def test_events_filter_by_type(gateway: Gateway) -> None:
    start(gateway)
    post(
        gateway,
        "/api/rollouts/r/attempt/1/events",
        [{"type": "model_request", "data": {}}, {"type": "reward", "data": {"value": 1.0}}],
    )
    rewards = gateway.http.get("/api/rollouts/r/events", params={"type": "reward"}).json()
    assert [e["type"] for e in rewards] == ["reward"]


def test_retried_event_post_is_stored_once(gateway: Gateway) -> None:
    start(gateway)
    event = {"type": "reward", "data": {"value": 1.0}, "idempotency_key": "k1"}
    first = post(gateway, "/api/rollouts/r/attempt/1/events", event)
    again = post(gateway, "/api/rollouts/r/attempt/1/events", event)
    assert first == again
    assert len(gateway.http.get("/api/rollouts/r/events").json()) == 1


def test_idempotency_key_from_header(gateway: Gateway) -> None:
    start(gateway)
    for _ in range(2):
        response = gateway.http.post(
            "/api/rollouts/r/attempt/1/events",
            json={"type": "reward", "data": {"value": 1.0}},
            headers={"Idempotency-Key": "h1"},
        )
        assert response.status_code == 200
    assert len(gateway.http.get("/api/rollouts/r/events").json()) == 1


def test_an_empty_idempotency_key_header_is_refused_as_an_empty_body_key_is(
    gateway: Gateway,
) -> None:
    """`Idempotency-Key: ` (a client whose key variable was empty) was read as no key: the
    gateway made one per try, and each retry of the post stored the event again."""
    start(gateway)
    for _ in range(2):
        response = gateway.http.post(
            "/api/rollouts/r/attempt/1/events",
            json={"type": "reward", "data": {"value": 1.0}},
            headers={"Idempotency-Key": ""},
        )
        assert response.status_code == 422, response.text
        assert response.json()["detail"][0]["loc"] == ["header", "idempotency-key"]
    assert gateway.http.get("/api/rollouts/r/events").json() == []


def test_a_header_key_sent_as_utf8_is_stored_as_written(gateway: Gateway) -> None:
    """HTTP reads a header's bytes as Latin-1: "clé-ü" sent as UTF-8 was stored as "clÃ©-Ã¼"."""
    start(gateway)
    for key in ("clé-ü", "clé-ü", "数"):
        response = gateway.http.post(
            "/api/rollouts/r/attempt/1/events",
            json={"type": "reward", "data": {"value": 1.0}},
            headers={"Idempotency-Key": key.encode()},
        )
        assert response.status_code == 200, response.text
        assert response.json()["idempotency_key"] == key
    latin1 = gateway.http.post(  # bytes that are not UTF-8 stay as read
        "/api/rollouts/r/attempt/1/events",
        json={"type": "reward", "data": {"value": 1.0}},
        headers={"Idempotency-Key": "clé".encode("latin-1")},
    )
    assert latin1.json()["idempotency_key"] == "clé"
    stored = gateway.http.get("/api/rollouts/r/events").json()
    assert [e["idempotency_key"] for e in stored] == ["clé-ü", "数", "clé"]


def test_a_list_retried_with_a_header_key_is_stored_once(gateway: Gateway) -> None:
    start(gateway)
    path = "/api/rollouts/r/attempt/1/events"
    events = [{"type": "a"}, {"type": "b", "idempotency_key": "own"}, {"type": "c"}]
    acks = [
        gateway.http.post(path, json=events, headers={"Idempotency-Key": "h2"}) for _ in range(2)
    ]
    assert [a.status_code for a in acks] == [200, 200]
    assert acks[0].json() == acks[1].json()
    stored = gateway.http.get("/api/rollouts/r/events").json()
    assert [(e["type"], e["idempotency_key"]) for e in stored] == [
        ("a", "h2:0"),
        ("b", "own"),
        ("c", "h2:2"),
    ]
    too_long = gateway.http.post(path, json=events, headers={"Idempotency-Key": "k" * 199})
    assert too_long.status_code == 422
    assert too_long.json()["detail"][0]["loc"] == ["header", "idempotency-key"]


def test_a_scoped_token_may_not_post_the_proxys_or_the_controllers_events(
    gateway: Gateway,
) -> None:
    token = start(gateway)
    forged_call = {"prompt_token_ids": [1, 2], "response_token_ids": [3], "status": 200}
    forged = [
        {"type": "model_request", "data": forged_call},
        {"type": "agent_log", "data": {"outcome": "succeeded"}, "idempotency_key": "agent_log"},
        [{"type": "note"}, {"type": "agent_launch", "data": {}, "idempotency_key": "launch"}],
    ]
    with gateway.client(token) as harness:
        for body in forged:
            response = harness.post("/api/rollouts/r/attempt/1/events", json=body)
            assert response.status_code == 403, body
            assert "scoped token may not post them" in response.json()["error"]
        assert harness.post("/api/rollouts/r/attempt/1/events", json={"type": "note"}).is_success
    # The controller's post under its fixed key is stored, not answered 409 by a forgery.
    controller = {
        "type": "agent_log",
        "data": {"outcome": "crashed"},
        "idempotency_key": "agent_log",
    }
    post(gateway, "/api/rollouts/r/attempt/1/events", controller)
    post(
        gateway, "/api/rollouts/r/attempt/1/events", {"type": "model_request", "data": forged_call}
    )
    stored = gateway.http.get("/api/rollouts/r/events").json()
    assert [(e["type"], e["data"]) for e in stored] == [
        ("note", {}),
        ("agent_log", {"outcome": "crashed"}),
        ("model_request", forged_call),
    ]


def test_reusing_a_key_for_another_event_is_409(gateway: Gateway) -> None:
    start(gateway)
    post(gateway, "/api/rollouts/r/attempt/1/events", {"type": "a", "idempotency_key": "k"})
    response = gateway.http.post(
        "/api/rollouts/r/attempt/1/events", json={"type": "b", "idempotency_key": "k"}
    )
    assert response.status_code == 409


def test_a_list_that_reuses_a_key_for_another_event_is_409_and_stores_nothing(
    gateway: Gateway,
) -> None:
    """A list post is stored whole or not at all: its new events were stored while the post
    was answered 409, and a client that gave up on it still had them read by the trainer."""
    start(gateway)
    path = "/api/rollouts/r/attempt/1/events"
    post(gateway, path, {"type": "a", "data": {"v": 1}, "idempotency_key": "k"})
    reused = [
        {"type": "b", "idempotency_key": "new"},
        {"type": "a", "data": {"v": 2}, "idempotency_key": "k"},
    ]
    response = gateway.http.post(path, json=reused)
    assert response.status_code == 409
    assert "idempotency key k of rollout r attempt 1" in response.json()["error"]
    assert "nothing of this post was stored" in response.json()["error"]
    stored = gateway.http.get("/api/rollouts/r/events").json()
    assert [(e["idempotency_key"], e["data"]) for e in stored] == [("k", {"v": 1})]
    # The same list with the stored event as it was: the new one is stored, the old replayed.
    replayed = [reused[0], {"type": "a", "data": {"v": 1}, "idempotency_key": "k"}]
    acks = post(gateway, path, replayed)["list"]
    assert [a["idempotency_key"] for a in acks] == ["new", "k"]
    assert acks[1]["seq"] == stored[0]["seq"]
    stored = gateway.http.get("/api/rollouts/r/events").json()
    assert [e["idempotency_key"] for e in stored] == ["k", "new"]


def test_events_for_an_unknown_attempt_are_404(gateway: Gateway) -> None:
    start(gateway)
    response = gateway.http.post("/api/rollouts/r/attempt/2/events", json={"type": "a"})
    assert response.status_code == 404
    assert "no attempt 2" in response.json()["error"]
    response = gateway.http.post("/api/rollouts/nope/attempt/1/events", json={"type": "a"})
    assert response.status_code == 404


def test_reading_events_of_an_unknown_attempt_is_404(gateway: Gateway) -> None:
    start(gateway)
    assert gateway.http.get("/api/rollouts/r/events", params={"attempt_id": 3}).status_code == 404


def test_event_pages_follow_after(gateway: Gateway) -> None:
    start(gateway)
    post(
        gateway,
        "/api/rollouts/r/attempt/1/events",
        [{"type": "n", "data": {"i": i}} for i in range(5)],
    )
    page = gateway.http.get("/api/rollouts/r/events", params={"limit": 2}).json()
    rest = gateway.http.get("/api/rollouts/r/events", params={"after": page[-1]["seq"]}).json()
    assert [e["data"]["i"] for e in page + rest] == [0, 1, 2, 3, 4]


def test_a_nul_in_an_event_filter_matches_nothing(gateway: Gateway) -> None:
    """PostgreSQL text cannot hold NUL, so no stored type or rollout id has one (was a 500)."""
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    gateway.http.post("/api/rollouts/r/attempts")
    gateway.http.post("/api/rollouts/r/attempt/1/events", json={"type": "note", "data": {}})
    for path in ("/api/rollouts/r/events", "/api/rollouts/r/events/packed"):
        both = gateway.http.get(path, params={"type": ["note", "no\x00te"]})
        assert both.status_code == 200 and [e["type"] for e in both.json()] == ["note"]
        assert gateway.http.get(path, params={"type": "no\x00te"}).json() == []
    assert gateway.http.get("/api/rollouts/r%00/events").status_code == 404


def test_a_reward_event_without_a_finite_number_value_is_422_and_not_stored(
    gateway: Gateway,
) -> None:
    start(gateway)
    path = "/api/rollouts/r/attempt/1/events"
    refused = [
        {"value": "high"},
        {"score": 1},
        {"value": None},
        {"value": [1]},
        {"value": True},
        {"value": 1e308},
    ]
    for data in refused:
        single = gateway.http.post(path, json={"type": "reward", "data": data})
        assert single.status_code == 422, data
        assert single.json()["detail"][0]["loc"] == ["body", "data", "value"]
        # In a list: the whole post is refused, the field named by its place in the list.
        listed = [{"type": "note", "data": {}}, {"type": "reward", "data": data}]
        response = gateway.http.post(path, json=listed)
        assert response.status_code == 422, data
        assert response.json()["detail"][0]["loc"] == ["body", 1, "data", "value"]
    nan = b'{"type": "reward", "data": {"value": NaN}}'
    not_finite = gateway.http.post(path, content=nan, headers={"content-type": "application/json"})
    assert not_finite.status_code == 422
    assert gateway.http.get("/api/rollouts/r/events").json() == []
    post(gateway, path, {"type": "reward", "data": {"value": 1}})
    assert [e["data"] for e in gateway.http.get("/api/rollouts/r/events").json()] == [{"value": 1}]
