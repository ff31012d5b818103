"""Rollout routes: batch create, get, list with a cursor, status transitions."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from reins.gateway.store.sql import SqlStore
from reins.schemas import VALID_TRANSITIONS, RolloutSpec
from tests.conftest import Gateway


def create(gateway: Gateway, *specs: dict[str, object]) -> list[dict[str, object]]:
    response = gateway.http.post("/api/rollouts", json=list(specs))
    assert response.status_code == 200, response.text
    return list(response.json())


def test_create_returns_queuing_rollouts_with_client_ids(gateway: Gateway) -> None:
    (rollout,) = create(gateway, {"rollout_id": "r1", "input": {"q": "2+2"}, "group_id": "g"})
    assert rollout["rollout_id"] == "r1"
    assert rollout["status"] == {"state": "queuing", "reason": None}
    assert rollout["input"] == {"q": "2+2"}
    assert rollout["attempt_count"] == 0


def test_create_generates_ids_when_absent(gateway: Gateway) -> None:
    first, second = create(gateway, {"input": 1}, {"input": 2})
    assert first["rollout_id"] != second["rollout_id"]


def test_retried_create_with_same_body_returns_the_existing_rollout(gateway: Gateway) -> None:
    spec = {"rollout_id": "r1", "input": {"q": 1}, "metadata": {"step": 3}}
    (first,) = create(gateway, spec)
    (again,) = create(gateway, spec)
    assert again == first
    assert len(gateway.http.get("/api/rollouts").json()["items"]) == 1


def test_create_with_same_id_and_different_body_is_409(gateway: Gateway) -> None:
    create(gateway, {"rollout_id": "r1", "input": {"q": 1}})
    response = gateway.http.post("/api/rollouts", json=[{"rollout_id": "r1", "input": {"q": 2}}])
    assert response.status_code == 409
    assert "r1" in response.json()["error"]


def test_one_batch_with_one_id_twice_and_different_bodies_is_409(gateway: Gateway) -> None:
    response = gateway.http.post(
        "/api/rollouts", json=[{"rollout_id": "r1", "input": 1}, {"rollout_id": "r1", "input": 2}]
    )
    assert response.status_code == 409
    assert gateway.http.get("/api/rollouts").json()["items"] == []


def test_get_returns_rollout_and_attempts(gateway: Gateway) -> None:
    create(gateway, {"rollout_id": "r1"})
    gateway.http.post("/api/rollouts/r1/attempts")
    body = gateway.http.get("/api/rollouts/r1").json()
    assert body["rollout"]["rollout_id"] == "r1"
    assert [a["attempt_id"] for a in body["attempts"]] == [1]
    assert body["attempts"][0]["token"].startswith("rk-at-")


def test_get_unknown_rollout_is_404(gateway: Gateway) -> None:
    response = gateway.http.get("/api/rollouts/nope")
    assert response.status_code == 404
    assert "nope" in response.json()["error"]


def test_list_filters_by_status_mode_and_group(gateway: Gateway) -> None:
    create(
        gateway,
        {"rollout_id": "a", "mode": "train", "group_id": "g1"},
        {"rollout_id": "b", "mode": "val", "group_id": "g1"},
        {"rollout_id": "c", "mode": "train", "group_id": "g2"},
    )
    gateway.http.patch("/api/rollouts/c", json={"status": {"state": "failed"}})

    def ids(**params: object) -> list[str]:
        page = gateway.http.get("/api/rollouts", params=params).json()
        return sorted(item["rollout_id"] for item in page["items"])

    assert ids(mode="val") == ["b"]
    assert ids(group_id="g1") == ["a", "b"]
    assert ids(status="failed") == ["c"]
    assert ids(status=["queuing", "failed"], mode="train") == ["a", "c"]


def test_the_run_filter_matches_a_run_name_the_same_on_both_stores(gateway: Gateway) -> None:
    """Only a JSON string is a run name: SQLite read `true` as 1 and PostgreSQL as 'true', so
    `run=1` kept `"run": true` on SQLite alone, and `run=true` on PostgreSQL alone."""
    runs = {"text": "1", "number": 1, "yes": True, "word": "true", "list": [1], "none": None}
    create(gateway, *({"rollout_id": key, "metadata": {"run": run}} for key, run in runs.items()))

    def ids(run: str) -> list[str]:
        page = gateway.http.get("/api/rollouts", params={"run": run}).json()
        return sorted(item["rollout_id"] for item in page["items"])

    assert ids("1") == ["text"]
    assert ids("true") == ["word"]
    assert ids("[1]") == []
    assert ids("null") == []
    # A run folder's name may have 255 bytes: a filter was cut at 200 characters (a 422).
    long_name = "r" * 250
    create(gateway, {"rollout_id": "long", "metadata": {"run": long_name}})
    assert ids(long_name) == ["long"]


def test_cursor_streams_completions_in_terminal_order(gateway: Gateway) -> None:
    create(gateway, *({"rollout_id": f"r{i}"} for i in range(4)))
    terminal = {"status": ["succeeded", "failed"]}
    page = gateway.http.get("/api/rollouts", params=terminal).json()
    assert page["items"] == []
    cursor = page["next_cursor"]
    finish_order = ["r2", "r0", "r3"]
    for rollout_id in finish_order:
        gateway.http.post(f"/api/rollouts/{rollout_id}/attempts")
        gateway.http.patch(f"/api/rollouts/{rollout_id}", json={"status": {"state": "succeeded"}})
    seen: list[str] = []
    while True:
        page = gateway.http.get("/api/rollouts", params={**terminal, "cursor": cursor, "limit": 2})
        body = page.json()
        seen += [item["rollout_id"] for item in body["items"]]
        if not body["items"]:
            break
        cursor = body["next_cursor"]
    assert seen == finish_order
    gateway.http.post("/api/rollouts/r1/attempts")
    gateway.http.patch("/api/rollouts/r1", json={"status": {"state": "failed"}})
    body = gateway.http.get("/api/rollouts", params={**terminal, "cursor": cursor}).json()
    assert [item["rollout_id"] for item in body["items"]] == ["r1"]


async def test_a_page_names_its_database_the_same_across_restarts(
    database_url: str, tmp_path: Path
) -> None:
    # A cursor counts one database's changes: a follower tells a restart from another database.
    database_ids = []
    for url in (database_url, database_url, f"sqlite+aiosqlite:///{tmp_path / 'other.db'}"):
        store = SqlStore(url)
        await store.init()
        database_ids.append((await store.list_rollouts()).database_id)
        await store.close()
    first, restarted, other = database_ids
    assert first is not None and first == restarted != other


async def test_a_cursor_past_an_older_copy_of_the_database_gets_its_head_back(
    tmp_path: Path,
) -> None:
    """A gateway restored from a backup keeps its `database_id` and counts changes again from
    where the copy ends: a follower's cursor past that head gets the head (below the cursor:
    the sign a follower reads), and the page after it holds the changes made since."""
    live, backup = tmp_path / "live.db", tmp_path / "backup.db"
    store = SqlStore(f"sqlite+aiosqlite:///{live}")
    await store.init()
    await store.create_rollouts([RolloutSpec(rollout_id="early")])
    await store.close()
    shutil.copyfile(live, backup)  # closed: the WAL is checkpointed into the file
    store = SqlStore(f"sqlite+aiosqlite:///{live}")
    await store.init()
    await store.create_rollouts([RolloutSpec(rollout_id=f"late-{i}") for i in range(5)])
    cursor = (await store.list_rollouts(limit=1000)).next_cursor
    await store.close()

    restored = SqlStore(f"sqlite+aiosqlite:///{backup}")
    await restored.init()
    try:
        page = await restored.list_rollouts(cursor=cursor)
        assert (page.items, page.next_cursor) == ([], 1)
        assert page.database_id == store.database_id
        await restored.create_rollouts([RolloutSpec(rollout_id="after-restore")])
        after = await restored.list_rollouts(cursor=page.next_cursor)
        assert [r.rollout_id for r in after.items] == ["after-restore"]
    finally:
        await restored.close()


STATES = ["queuing", "running", "succeeded", "failed"]


def _bring_to(gateway: Gateway, rollout_id: str, state: str) -> None:
    create(gateway, {"rollout_id": rollout_id})
    path = {
        "queuing": [],
        "running": ["running"],
        "succeeded": ["running", "succeeded"],
        "failed": ["failed"],
    }[state]
    for step in path:
        response = gateway.http.patch(
            f"/api/rollouts/{rollout_id}", json={"status": {"state": step}}
        )
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(("current", "target"), list(itertools.product(STATES, STATES)))
def test_patch_follows_the_transition_table(gateway: Gateway, current: str, target: str) -> None:
    _bring_to(gateway, "r", current)
    response = gateway.http.patch("/api/rollouts/r", json={"status": {"state": target}})
    if target == current or target in VALID_TRANSITIONS[current]:
        assert response.status_code == 200, response.text
        assert response.json()["status"]["state"] == target
    else:
        assert response.status_code == 409
        assert f"is {current}; it cannot become {target}" in response.json()["error"]


def test_patch_to_the_current_state_changes_nothing(gateway: Gateway) -> None:
    _bring_to(gateway, "r", "running")
    before = gateway.http.get("/api/rollouts/r").json()["rollout"]
    after = gateway.http.patch("/api/rollouts/r", json={"status": {"state": "running"}}).json()
    assert after["change_seq"] == before["change_seq"]


def test_patch_running_opens_the_first_attempt(gateway: Gateway) -> None:
    _bring_to(gateway, "r", "running")
    attempts = gateway.http.get("/api/rollouts/r").json()["attempts"]
    assert [(a["attempt_id"], a["state"]) for a in attempts] == [(1, "running")]


def test_terminal_status_closes_the_latest_attempt(gateway: Gateway) -> None:
    _bring_to(gateway, "r", "running")
    gateway.http.patch("/api/rollouts/r", json={"status": {"state": "failed", "reason": "boom"}})
    body = gateway.http.get("/api/rollouts/r").json()
    assert body["rollout"]["status"] == {"state": "failed", "reason": "boom"}
    assert body["attempts"][0]["state"] == "failed"
    assert body["attempts"][0]["ended_at"] is not None


def test_patch_merges_metadata(gateway: Gateway) -> None:
    create(gateway, {"rollout_id": "r", "metadata": {"a": 1}})
    response = gateway.http.patch("/api/rollouts/r", json={"metadata": {"b": 2}})
    assert response.json()["metadata"] == {"a": 1, "b": 2}


def test_patch_stores_a_metadata_value_python_deems_equal(gateway: Gateway) -> None:
    """`true == 1 == 1.0` and `-0.0 == 0.0` in Python: such a PATCH was answered 200 and the
    old value kept. A PATCH of the same JSON changes nothing, its change not counted again."""
    create(gateway, {"rollout_id": "r", "metadata": {"done": 1, "w": 0.0, "n": {"b": 1}}})
    sent = {"done": True, "w": -0.0, "n": {"b": 1.0}}
    patched = gateway.http.patch("/api/rollouts/r", json={"metadata": sent})
    assert patched.status_code == 200, patched.text
    stored = gateway.http.get("/api/rollouts/r").json()["rollout"]
    assert json.dumps(stored["metadata"]) == json.dumps(sent)
    again = gateway.http.patch("/api/rollouts/r", json={"metadata": sent}).json()
    assert again["change_seq"] == patched.json()["change_seq"]


def test_patch_unknown_rollout_is_404(gateway: Gateway) -> None:
    response = gateway.http.patch("/api/rollouts/nope", json={"status": {"state": "running"}})
    assert response.status_code == 404


def test_a_create_that_reuses_several_ids_names_the_first_in_the_requests_order(
    gateway: Gateway,
) -> None:
    """Both stores name the same rollout: the first conflicting one of the list. SQLite named
    the one its index returned first and PostgreSQL whichever its scan found (a differential run
    of one request sequence on both stores answered `r1` on one and `r3` on the other)."""
    http = gateway.http
    assert http.post("/api/rollouts", json=[{"rollout_id": r} for r in ("r1", "r3")]).is_success
    for order in (["r3", "r1"], ["r1", "r3"]):
        changed = [{"rollout_id": r, "input": "other"} for r in order]
        refused = http.post("/api/rollouts", json=changed)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"].startswith(f"rollout {order[0]} already exists"), order
