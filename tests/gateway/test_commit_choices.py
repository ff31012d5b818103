"""Which post's event a group commit stores when posts of the same commit share an idempotency
key, and one of them is not to be stored: a list post refused for reusing another key, or a
harness's post to its attempt that closed. The key's event is the first among the posts that
are stored, and every post is answered as its own fate says (`appends.chosen_rows`).

Each test hands the store one batch, as its group commit takes the posts queued meanwhile (the
race that puts them in one commit over HTTP depends on timing), on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from reins.gateway.store import Conflict
from reins.gateway.store.appends import PendingAppend
from reins.gateway.store.sql import SqlStore
from reins.schemas import AttemptCreate, Event, EventIn, RolloutSpec


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[SqlStore]:
    sql_store = SqlStore(database_url)
    await sql_store.init()
    await sql_store.create_rollouts([RolloutSpec(rollout_id="r"), RolloutSpec(rollout_id="o")])
    await sql_store.open_attempt("r", AttemptCreate())
    await sql_store.open_attempt("o", AttemptCreate())
    yield sql_store
    await sql_store.close()


def _post(
    store: SqlStore, rollout_id: str, attempt_id: int, *events: tuple[str, Any], harness: bool
) -> PendingAppend:
    rows = store._rows_of(
        rollout_id,
        attempt_id,
        [EventIn(type="note", data=data, idempotency_key=key) for key, data in events],
    )
    done = asyncio.get_running_loop().create_future()
    return PendingAppend(rollout_id, attempt_id, rows, done, from_harness=harness)


async def _outcome(post: PendingAppend) -> list[Any] | str:
    try:
        events: list[Event] = await post.done
    except Conflict as refused:
        return f"409: {refused}"
    return [event.data for event in events]


async def _stored(store: SqlStore, rollout_id: str, attempt_id: int) -> dict[str, Any]:
    events = await store.get_events(rollout_id, attempt_id=attempt_id)
    return {event.idempotency_key: event.data for event in events}


async def test_a_refused_lists_event_gives_way_to_the_post_that_stores_its_key(
    store: SqlStore,
) -> None:
    await store.append_events("r", 1, [EventIn(type="note", data={"v": "X"}, idempotency_key="k1")])
    refused = _post(store, "r", 1, ("k1", {"v": "Y"}), ("k2", {"v": "A"}), harness=False)
    second = _post(store, "r", 1, ("k2", {"v": "B"}), harness=False)
    await store._commit_appends([refused, second])
    outcome = await _outcome(refused)
    assert isinstance(outcome, str) and outcome.startswith("409: ") and "k1" in outcome
    assert await _outcome(second) == [{"v": "B"}]
    assert await _stored(store, "r", 1) == {"k1": {"v": "X"}, "k2": {"v": "B"}}


@pytest.mark.parametrize("admin_first", [False, True], ids=["harness first", "admin first"])
async def test_a_harness_post_to_a_closed_attempt_leaves_its_key_to_the_admins_post(
    store: SqlStore, admin_first: bool
) -> None:
    await store.open_attempt("r", AttemptCreate())  # attempt 1 is superseded: closed
    harness = _post(store, "r", 1, ("k", {"by": "harness"}), harness=True)
    admin = _post(store, "r", 1, ("k", {"by": "admin"}), harness=False)
    other = _post(store, "o", 1, ("x", {"x": 1}), harness=False)
    first, second = (admin, harness) if admin_first else (harness, admin)
    await store._commit_appends([first, second, other])
    assert (await _outcome(harness)).startswith("409: ")  # type: ignore[union-attr]
    assert await _outcome(admin) == [{"by": "admin"}]
    assert await _outcome(other) == [{"x": 1}]
    assert await _stored(store, "r", 1) == {"k": {"by": "admin"}}
    assert await _stored(store, "o", 1) == {"x": {"x": 1}}


async def test_of_two_stored_posts_of_one_key_the_first_is_kept_and_the_other_refused(
    store: SqlStore,
) -> None:
    first = _post(store, "r", 1, ("k", {"v": "A"}), harness=False)
    again = _post(store, "r", 1, ("k", {"v": "A"}), harness=False)
    other = _post(store, "r", 1, ("k", {"v": "B"}), harness=False)
    await store._commit_appends([first, again, other])
    assert await _outcome(first) == [{"v": "A"}]
    assert await _outcome(again) == [{"v": "A"}]  # the same event: a retry
    assert (await _outcome(other)).startswith("409: ")  # type: ignore[union-attr]
    assert await _stored(store, "r", 1) == {"k": {"v": "A"}}
