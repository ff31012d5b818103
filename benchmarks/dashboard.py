"""The dashboard's rollout list at scale: one page of `/ui` (its count and its 50 rows,
`SqlStore.query_rollouts`) for each order and filter, on PostgreSQL and SQLite.

Rollouts are written through `SqlStore` as the gateway stores them (`--base` of them: one
attempt, `--calls` packed `model_request` events and a `reward` each; every 7th has no reward,
every 5th a second attempt with a reward of its own; a third succeeded, a third failed, the
rest running), then copied in SQL up to `--rollouts` (ids `<id>-<k>`, each copy's rewards
drawn again so that the orders are not ties). The database is analyzed, then each query runs
`--reps` times, the queries interleaved; the median and the best are printed, in ms, and each
median as a ratio to the default page's (newest first) of the same store in the same run.

PostgreSQL is Debian's `postgresql`, started as the tests start it (`tests.support.PostgresServer`).

Run: ``python benchmarks/dashboard.py [--rollouts 12000] [--stores postgresql,sqlite]``. Last
line: ``dashboard_sort_reward_over_default: VALUE ratio`` (the reward-sorted page's median over
the default page's, PostgreSQL's, or the first store's).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reins.gateway.store import RolloutQuery  # noqa: E402
from reins.gateway.store.sql import SqlStore  # noqa: E402
from reins.schemas import (  # noqa: E402
    AttemptCreate,
    EventIn,
    RolloutSpec,
    RolloutStatus,
    RolloutUpdate,
)
from tests.monitor.factory import chat_call  # noqa: E402
from tests.support import PostgresServer  # noqa: E402

QUERIES: dict[str, RolloutQuery] = {
    "created (default)": RolloutQuery(),
    "sort reward desc": RolloutQuery(sort="reward"),
    "sort reward asc": RolloutQuery(sort="reward", descending=False),
    "sort reward, page 100": RolloutQuery(sort="reward", offset=99 * 50),
    "sort duration desc": RolloutQuery(sort="duration"),
    "sort duration asc": RolloutQuery(sort="duration", descending=False),
    "search": RolloutQuery(search="TASK R0009"),
    "search, sort reward": RolloutQuery(search="task", sort="reward"),
    "run filter, sort reward": RolloutQuery(run="run1", sort="reward"),
    "state filter": RolloutQuery(states=["succeeded"]),
}


async def fill(store: SqlStore, base: int, calls: int) -> None:
    rng = random.Random(7)
    ids = [f"r{i:05d}" for i in range(base)]
    for start in range(0, base, 500):
        chunk = ids[start : start + 500]
        specs = [
            RolloutSpec(
                rollout_id=rid,
                input={"task": f"Task {rid}: " + "fix the failing test " * 10},
                metadata={"run": f"run{int(rid[1:]) % 3}", "step": int(rid[1:]) // 50},
            )
            for rid in chunk
        ]
        await store.create_rollouts(specs)
    for number, rid in enumerate(ids):
        await store.open_attempt(rid, AttemptCreate())
        turns = [
            EventIn(**chat_call([{"role": "user", "content": f"{rid} turn {turn}"}], "ok"))
            for turn in range(calls)
        ]
        if number % 7:
            turns.append(EventIn(type="reward", data={"value": round(rng.random(), 3)}))
        await store.append_events(rid, 1, turns)
        if number % 5 == 0:
            await store.open_attempt(rid, AttemptCreate(reason="crashed"))
            again = [EventIn(type="reward", data={"value": round(rng.random(), 3)})]
            await store.append_events(rid, 2, again)
        if number % 3 == 0:
            state = RolloutStatus(state="succeeded")
            await store.update_rollout(rid, RolloutUpdate(status=state))
        elif number % 3 == 1:
            state = RolloutStatus(state="failed", reason="crashed")
            await store.update_rollout(rid, RolloutUpdate(status=state))
    await store._settle()


def copy_statements(sqlite: bool, k: int) -> list[str]:
    """SQL that copies the base rollouts (ids without '-') once more, as copy `k`."""
    draw = "(abs(random()) % 1000) / 1000.0" if sqlite else "round(random()::numeric, 3)"
    reward = f"json_object('value', {draw})" if sqlite else f"json_build_object('value', {draw})"
    base = "rollout_id NOT LIKE '%-%'"
    return [
        "INSERT INTO rollouts (rollout_id, input, group_id, mode, metadata, config, state,"
        " reason, attempt_count, change_seq, spec_digest, created_at, updated_at)"
        f" SELECT rollout_id || '-{k}', input, group_id, mode, metadata, config, state, reason,"
        f" attempt_count, change_seq + {k} * 1000000, spec_digest, created_at + {k},"
        f" updated_at + {k} FROM rollouts WHERE {base}",
        "INSERT INTO attempts (rollout_id, attempt_id, state, reason, created_at, ended_at)"
        f" SELECT rollout_id || '-{k}', attempt_id, state, reason, created_at + {k},"
        f" ended_at + {k} FROM attempts WHERE {base}",
        "INSERT INTO events (rollout_id, attempt_id, type, data, idempotency_key, created_at,"
        " packed, prompt_tokens, response_tokens, packed_head)"
        f" SELECT rollout_id || '-{k}', attempt_id, type,"
        f" CASE WHEN type = 'reward' THEN {reward} ELSE data END, idempotency_key,"
        f" created_at + {k}, packed, prompt_tokens, response_tokens, packed_head"
        f" FROM events WHERE {base} ORDER BY seq",
    ]


async def build(store: SqlStore, rollouts: int, base: int, calls: int) -> None:
    base = min(base, rollouts)
    started = time.perf_counter()
    await fill(store, base, calls)
    filled = time.perf_counter() - started
    copies = -(-rollouts // base) - 1
    async with store.engine.begin() as conn:
        for k in range(1, copies + 1):
            for statement in copy_statements(store.is_sqlite, k):
                await conn.execute(sa.text(statement))
    async with store.engine.begin() as conn:
        await conn.execute(sa.text("ANALYZE"))
    async with store.engine.connect() as conn:
        count = await conn.scalar(sa.text("SELECT count(*) FROM rollouts"))
        event_count = await conn.scalar(sa.text("SELECT count(*) FROM events"))
    print(
        f"  {count} rollouts, {event_count} events ({base} written through the store in "
        f"{filled:.0f} s, then copied)",
        flush=True,
    )


async def measure(url: str, args: argparse.Namespace) -> dict[str, float]:
    store = SqlStore(url)
    await store.init()
    try:
        await build(store, args.rollouts, args.base, args.calls)
        times: dict[str, list[float]] = {name: [] for name in QUERIES}
        for query in QUERIES.values():  # warm: the first run of each plans and caches
            await store.query_rollouts(query)
        for _ in range(args.reps):
            for name, query in QUERIES.items():
                started = time.perf_counter()
                await store.query_rollouts(query)
                times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(runs) * 1000 for name, runs in times.items()}
        default = medians["created (default)"]
        for name, runs in times.items():
            print(
                f"  {name:26s} median {medians[name]:7.1f} ms   best {min(runs) * 1000:7.1f} ms"
                f"   {medians[name] / default:5.2f}x the default page",
                flush=True,
            )
        return medians
    finally:
        await store.close()


@contextmanager
def database(kind: str, workdir: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite+aiosqlite:///{workdir / 'dashboard.db'}"
        return
    if kind != "postgresql":
        raise SystemExit(f"unknown store {kind!r} (postgresql, sqlite)")
    server = PostgresServer.start()
    try:
        yield server.create_database("dashboard")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=12_000)
    parser.add_argument("--base", type=int, default=600, help="rollouts written by the store")
    parser.add_argument("--calls", type=int, default=6, help="model_request events a rollout")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--stores", default="postgresql,sqlite")
    args = parser.parse_args()
    headline = None
    for kind in args.stores.split(","):
        print(f"{kind}:", flush=True)
        with tempfile.TemporaryDirectory() as workdir, database(kind, Path(workdir)) as url:
            medians = asyncio.run(measure(url, args))
        if headline is None:
            headline = medians["sort reward desc"] / medians["created (default)"]
    print(f"dashboard_sort_reward_over_default: {headline:.2f} ratio")


if __name__ == "__main__":
    main()
