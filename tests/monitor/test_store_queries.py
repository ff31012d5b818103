"""The store's dashboard reads on SQLite and PostgreSQL: filters, orders, per-rollout stats."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa

from reins.gateway.store import RolloutQuery
from reins.gateway.store.sql import SqlStore
from reins.gateway.store.tables import attempts
from reins.schemas import AttemptCreate, EventIn, RolloutSpec, RolloutStatus, RolloutUpdate
from tests.conftest import Gateway
from tests.monitor.factory import chat_call, many_rollouts


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[SqlStore]:
    store = SqlStore(database_url)
    await store.init()
    yield store
    await store.close()


async def rollout(store: SqlStore, rid: str, reward: float | None, **spec: object) -> None:
    await store.create_rollouts([RolloutSpec(rollout_id=rid, **spec)])  # type: ignore[arg-type]
    await store.open_attempt(rid, AttemptCreate())
    events = [EventIn(**chat_call([{"role": "user", "content": rid}], "ok"))]
    if reward is not None:
        events.append(EventIn(type="reward", data={"value": reward}))
    await store.append_events(rid, 1, events)


async def test_stats_count_the_latest_attempt_only(store: SqlStore) -> None:
    await rollout(store, "r", 0.0)
    await store.open_attempt("r", AttemptCreate(reason="crashed"))
    call = chat_call([{"role": "user", "content": "again"}], "yes", version=7)
    await store.append_events(
        "r", 2, [EventIn(**call), EventIn(**call), EventIn(type="reward", data={"value": 2.5})]
    )
    stats = (await store.rollout_stats(["r", "missing"]))["r"]
    assert stats.calls == 2
    assert stats.prompt_tokens == 2 * len(call["data"]["prompt_token_ids"])
    assert stats.response_tokens == 6
    assert (stats.min_version, stats.max_version) == (7, 7)
    assert stats.reward == 2.5
    assert stats.events == 5 and stats.last_seq > 0
    assert stats.started_at is not None and stats.ended_at is None


async def test_stats_versions_are_those_of_the_calls_the_trainer_trains(store: SqlStore) -> None:
    """A failed, abandoned or empty call's version does not count: an async trainer gives up a
    group whose versions are too old, and these calls are not trained."""
    await rollout(store, "r", None)  # one call served by version 3
    abandoned = chat_call([{"role": "user", "content": "left"}], "x", version=1)
    abandoned["data"]["abandoned"] = True
    empty = chat_call([{"role": "user", "content": "cut"}], "x", version=2)
    empty["data"]["response_token_ids"] = []
    empty["data"]["response_logprobs"] = []
    failed = chat_call([{"role": "user", "content": "down"}], "x", version=0, status=500)
    later = chat_call([{"role": "user", "content": "next"}], "y", version=6)
    # As ModelRequest reads them: `abandoned: 1` or "yes" is abandoned, token IDs that are not
    # int32 are no tokens (both stored whole), a missing status is 200.
    one = chat_call([{"role": "user", "content": "one"}], "x", version=1)
    one["data"]["abandoned"] = 1
    yes = chat_call([{"role": "user", "content": "yes"}], "x", version=1)
    yes["data"]["abandoned"] = "Yes"
    wide = chat_call([{"role": "user", "content": "wide"}], "x", version=2)
    wide["data"]["prompt_token_ids"] = [2**31, 2]
    floats = chat_call([{"role": "user", "content": "floats"}], "x", version=2)
    floats["data"]["response_token_ids"] = [4.0]
    floats["data"]["response_logprobs"] = [-0.5]
    unsaid = chat_call([{"role": "user", "content": "unsaid"}], "z", version=7)
    del unsaid["data"]["status"]
    calls = (abandoned, empty, failed, later, one, yes, wide, floats, unsaid)
    await store.append_events("r", 1, [EventIn(**call) for call in calls])
    stats = (await store.rollout_stats(["r"]))["r"]
    assert (stats.calls, stats.failed_calls) == (10, 1)
    assert (stats.min_version, stats.max_version) == (3, 7)


async def test_stats_survive_events_that_are_not_what_the_proxy_writes(store: SqlStore) -> None:
    await store.create_rollouts([RolloutSpec(rollout_id="odd")])
    await store.open_attempt("odd", AttemptCreate())
    junk = {"prompt_token_ids": "abc", "model_version": "v9", "status": "ok"}
    await store.append_events(
        "odd",
        1,
        [
            EventIn(type="model_request", data=junk),
            EventIn(type="model_request", data={}),
            EventIn(type="reward", data={"value": "high"}),
        ],
    )
    stats = (await store.rollout_stats(["odd"]))["odd"]
    assert (stats.calls, stats.prompt_tokens, stats.failed_calls) == (2, 0, 0)
    assert stats.min_version is None and stats.reward is None


async def test_failed_calls_are_counted(store: SqlStore) -> None:
    await rollout(store, "r", 1.0)
    failed = chat_call([{"role": "user", "content": "x"}], "", status=502, error="down")
    await store.append_events("r", 1, [EventIn(**failed)])
    stats = (await store.rollout_stats(["r"]))["r"]
    assert (stats.calls, stats.failed_calls) == (2, 1)


async def test_sort_by_reward_puts_rollouts_without_one_last(store: SqlStore) -> None:
    for rid, reward in (("a", 0.5), ("b", None), ("c", 1.0), ("d", -1.0)):
        await rollout(store, rid, reward)
    down, total = await store.query_rollouts(RolloutQuery(sort="reward"))
    up, _ = await store.query_rollouts(RolloutQuery(sort="reward", descending=False))
    assert total == 4
    assert [r.rollout_id for r in down] == ["c", "a", "d", "b"]
    assert [r.rollout_id for r in up] == ["d", "a", "c", "b"]


async def started_and_ended(store: SqlStore, rid: str, started: float, ended: float | None) -> None:
    """Sets the rollout's first attempt's times (the store takes them from its clock)."""
    where = (attempts.c.rollout_id == rid, attempts.c.attempt_id == 1)
    async with store.engine.begin() as conn:
        await conn.execute(sa.update(attempts).where(*where).values(created_at=started))
        await conn.execute(sa.update(attempts).where(*where).values(ended_at=ended))


async def test_sort_by_duration_counts_running_rollouts_up_to_now_and_pages(
    store: SqlStore,
) -> None:
    """As the table shows them: a rollout still running has run until now."""
    for rid in ("a", "b", "c"):
        await rollout(store, rid, 1.0)
    for rid in ("c", "a"):
        await store.update_rollout(rid, RolloutUpdate(status=RolloutStatus(state="succeeded")))
    now = time.time()
    await started_and_ended(store, "a", now - 1000, now - 400)  # ran 600 s
    await started_and_ended(store, "b", now - 300, None)  # runs: 300 s so far
    await started_and_ended(store, "c", now - 1000, now - 900)  # ran 100 s
    longest, total = await store.query_rollouts(RolloutQuery(sort="duration", limit=2))
    assert total == 3
    assert [r.rollout_id for r in longest] == ["a", "b"]
    rest, _ = await store.query_rollouts(RolloutQuery(sort="duration", offset=2, limit=2))
    assert [r.rollout_id for r in rest] == ["c"]
    shortest, _ = await store.query_rollouts(RolloutQuery(sort="duration", descending=False))
    assert [r.rollout_id for r in shortest] == ["c", "b", "a"]


async def test_search_folds_case_one_character_for_one(store: SqlStore) -> None:
    """As PostgreSQL's lower() maps them: Python's own lower() makes "İ" two characters, so
    "istanbul" found "İstanbul" on PostgreSQL and not on SQLite."""
    await rollout(store, "t1", None, input={"city": "İstanbul"})
    await rollout(store, "t2", None, input={"city": "Ankara"})
    for search in ("istanbul", "İSTANBUL", "İstanbul"):
        items, _ = await store.query_rollouts(RolloutQuery(search=search))
        assert [r.rollout_id for r in items] == ["t1"], search


async def test_filters_combine(store: SqlStore) -> None:
    await rollout(store, "a1", 1.0, metadata={"run": "a"}, mode="val", input={"q": "Café au lait"})
    await rollout(store, "a2", 1.0, metadata={"run": "a"}, group_id="g", input={"q": "50% off"})
    await rollout(store, "b1", 1.0, metadata={"run": "b"}, input={"q": "café"})

    async def ids(**query: object) -> list[str]:
        items, _ = await store.query_rollouts(RolloutQuery(sort="id", descending=False, **query))  # type: ignore[arg-type]
        return [r.rollout_id for r in items]

    assert await ids(run="a") == ["a1", "a2"]
    assert await ids(run="a", mode="val") == ["a1"]
    assert await ids(group_id="g") == ["a2"]
    # The input's JSON text keeps non-ASCII characters: their case is folded on both databases
    # (SQLite's own lower() folded ASCII letters only: "CAFÉ" found nothing there).
    assert await ids(search="CAFÉ") == ["a1", "b1"]
    assert await ids(search="CAFÉ AU") == ["a1"]
    assert await ids(search="café") == ["a1", "b1"]
    assert await ids(search="50%") == ["a2"]
    assert await ids(search="%") == ["a2"]
    assert await ids(search="B1") == ["b1"]
    assert await ids(states=["running"], run="b") == ["b1"]
    assert await store.count_rollouts() == {("running", "train"): 2, ("running", "val"): 1}


def test_rollout_list_api_filters_by_run_and_text(gateway: Gateway) -> None:
    many_rollouts(gateway, 6, run="one")
    many_rollouts(gateway, 2, run="two")
    page = gateway.http.get("/api/rollouts", params={"run": "two"}).json()
    assert [r["rollout_id"] for r in page["items"]] == ["two-s1-r000", "two-s1-r001"]
    found = gateway.http.get("/api/rollouts", params={"q": "what is 5 +"}).json()["items"]
    assert [r["rollout_id"] for r in found] == ["one-s1-r005"]


async def test_filters_and_stats_survive_nul_characters(store: SqlStore) -> None:
    # PostgreSQL's json keeps "\u0000" but cannot unescape it into text: found by fuzzing.
    await rollout(store, "nul", None, metadata={"run": "b", "note": "\x00"}, input="\x00")
    await store.append_events("nul", 1, [EventIn(type="reward", data={"value": "\x00"})])
    await rollout(store, "plain", 1.0, metadata={"run": "a"})
    for query in (RolloutQuery(run="a"), RolloutQuery(run="a", sort="reward")):
        items, total = await store.query_rollouts(query)
        assert [r.rollout_id for r in items] == ["plain"] and total == 1
    assert (await store.query_rollouts(RolloutQuery(run="a\x00b")))[1] == 0
    # The search finds a NUL where an input holds one (it found nothing whatever it held).
    found, total = await store.query_rollouts(RolloutQuery(search="\x00"))
    assert ([r.rollout_id for r in found], total) == (["nul"], 1)
    await rollout(store, "nul-inside", None, input={"q": "a\x00B c"})
    found, _ = await store.query_rollouts(RolloutQuery(search="A\x00b"))
    assert [r.rollout_id for r in found] == ["nul-inside"]
    assert (await store.query_rollouts(RolloutQuery(search="a\x00c")))[1] == 0
    page = await store.list_rollouts(run="a")
    assert [r.rollout_id for r in page.items] == ["plain"]
    assert (await store.rollout_stats(["nul"]))["nul"].reward is None  # "\x00": no number


async def test_a_document_holding_nul_characters_is_filtered_and_counted(store: SqlStore) -> None:
    """On PostgreSQL such a document was left out of run filters and stats (its JSON cannot be
    read there), and so was text holding a backslash before "u0000", which is no NUL."""
    nul, escaped = "x\x00\x00\x00y", "C:\\u0000dir"
    await rollout(store, "nul", None, metadata={"run": "a", "note": nul})
    reward = {"value": 0.75, "reason": nul}
    await store.append_events("nul", 1, [EventIn(type="reward", data=reward)])
    await rollout(store, "escaped", None, metadata={"run": "a", "path": escaped})
    reward = {"value": 0.5, "reason": escaped}
    await store.append_events("escaped", 1, [EventIn(type="reward", data=reward)])
    await rollout(store, "other", 1.0, metadata={"run": "b\x00"})
    items, total = await store.query_rollouts(RolloutQuery(run="a", sort="reward"))
    assert [r.rollout_id for r in items] == ["nul", "escaped"] and total == 2
    # A call stored whole (a token ID past int32 is not packed) with a NUL in its request.
    failed = chat_call([{"role": "user", "content": nul}], "no", version=5, status=500)
    failed["data"]["prompt_token_ids"] = [2**31, 7]
    # Stored whole too (integer logprobs are not packed), and trained: its version counts.
    whole = chat_call([{"role": "user", "content": nul}], "no", version=4)
    whole["data"]["prompt_token_ids"] = [9, 7]
    whole["data"]["response_logprobs"] = [0, 0]
    await store.append_events("nul", 1, [EventIn(**failed), EventIn(**whole)])
    stats = await store.rollout_stats(["nul", "escaped"])
    assert (stats["nul"].reward, stats["escaped"].reward) == (0.75, 0.5)
    assert stats["escaped"].calls == 1
    assert (stats["nul"].calls, stats["nul"].failed_calls, stats["nul"].prompt_tokens) == (
        3,
        1,
        # The failed call's token IDs past int32 count none: they are no tokens.
        len(chat_call([{"role": "user", "content": "nul"}], "ok")["data"]["prompt_token_ids"]) + 2,
    )
    assert (stats["nul"].min_version, stats["nul"].max_version) == (3, 4)
