"""Network cuts between the parts, through a real TCP proxy (tests/faults/tcp_proxy.py): every
connection dropped (reset) while requests are in flight, and stalls (bytes held, then released).

- harness <-> gateway, event posts: `GatewayClient`s whose replies are lost after the gateway
  applied the post retry it with the same idempotency key: each event is stored exactly once and
  none acknowledged is lost (dedup holds).
- harness <-> gateway, proxied LLM calls: a call cut mid-flight is recorded `abandoned` and the
  `openai` SDK's retry is the one call the Sample Adapter keeps.
- gateway <-> engine: a cut engine connection is retried by the proxy; each harness call is
  answered once and recorded once; a stalled engine link delays calls but loses none.
- controller <-> gateway: a controller whose connection to the gateway is cut and stalled while
  it launches rollouts launches none twice (the `scale` agent records every launch).

Real: the `reins gateway` process (SQLite), the clients, the controller with `LocalReconciler`
and real agent processes. STUBBED: the engine's model (tests/stub_engine.py, in its own process).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from reins.client import GatewayClient
from reins.controller import Controller, LocalReconciler
from reins.samples.records import rollout_from_events
from reins.schemas import AGENT_LAUNCH, TERMINAL_STATES, Event, EventIn, RolloutSpec
from tests.faults.conftest import (
    ADMIN_KEY,
    ROOT,
    StubProcess,
    admin,
    model_requests,
    open_rollouts,
    proxy_url,
    wait_until,
)
from tests.faults.tcp_proxy import TcpProxy
from tests.stub_engine import DEFAULT_REPLY
from tests.support import GatewayProcess

pytestmark = pytest.mark.slow

CLIENTS = 8
DELAY_S = 2.0
"""How long a call that must be cut waits at the engine: ample for the cut to land while every
call is in flight, even on a loaded machine."""


async def _wait(condition: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (condition() if callable(condition) else condition):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        await asyncio.sleep(0.02)


async def test_event_posts_cut_and_stalled_are_stored_exactly_once(
    sqlite_gateway: GatewayProcess,
) -> None:
    async with GatewayClient(sqlite_gateway.url, ADMIN_KEY) as gateway_admin:
        ids = [f"cut-{i}" for i in range(CLIENTS)]
        await gateway_admin.create_rollouts([RolloutSpec(rollout_id=rid) for rid in ids])
        tokens = [(await gateway_admin.open_attempt(rid, attempt_id=1)).token for rid in ids]
    with TcpProxy(sqlite_gateway.port) as link:
        stop = asyncio.Event()
        acked: dict[str, list[str]] = {rid: [] for rid in ids}
        clients = [
            GatewayClient(
                link.url, str(token), timeout_s=1, max_retries=60, backoff_s=0.05, max_backoff_s=0.3
            )
            for token in tokens
        ]

        async def post_until(client: GatewayClient, rid: str) -> None:
            while not stop.is_set():
                key = uuid.uuid4().hex
                event = EventIn(type="note", data={"n": len(acked[rid])}, idempotency_key=key)
                await client.post_events(rid, 1, [event])
                acked[rid].append(key)

        async def progress(more: int) -> None:
            wanted = {rid: len(keys) + more for rid, keys in acked.items()}
            await _wait(
                lambda: all(len(acked[rid]) >= n for rid, n in wanted.items()),
                "every client getting acknowledgements",
            )

        writers = [
            asyncio.create_task(post_until(c, rid)) for c, rid in zip(clients, ids, strict=True)
        ]
        await progress(3)
        for _ in range(3):
            assert link.drop() > 0, "connections must be open when they are cut"
            await progress(3)
        # Replies lost after the gateway applied the posts: each client times out and retries.
        retried = sum(c.retries for c in clients)
        link.stall(downstream_only=True)
        # A reply held proves a post was applied by the gateway and its answer lost.
        await _wait(lambda: link.held > 0, "a reply being held")
        await _wait(
            lambda: (
                all(c.retries > 0 for c in clients)
                and sum(c.retries for c in clients) >= retried + CLIENTS
            ),
            "the clients timing out and retrying",
        )
        link.resume()
        await progress(3)
        # A full stall (requests held too), then released before the clients give up.
        held = link.held
        link.stall()
        await _wait(lambda: link.held > held, "a request being held")
        link.resume()
        await progress(3)
        stop.set()
        await asyncio.gather(*writers)
        for client in clients:
            await client.close()
        retries = sum(c.retries for c in clients)

    async with GatewayClient(sqlite_gateway.url, ADMIN_KEY) as gateway_admin:
        for rid in ids:
            stored = await gateway_admin.get_events(rid, attempt_id=1)
            counts = Counter(event.idempotency_key for event in stored)
            assert [k for k in acked[rid] if counts[k] == 0] == [], f"{rid}: acknowledged lost"
            assert max(counts.values()) == 1, f"{rid}: an event stored twice"
            assert set(counts) == set(acked[rid])
    print(
        f"harness<->gateway events: {sum(map(len, acked.values()))} acknowledged, {retries} "
        f"retries, {link.dropped} connections cut, 0 lost, 0 duplicated"
    )
    assert retries >= CLIENTS


def test_a_proxied_call_cut_midway_is_abandoned_and_its_retry_is_the_one_kept(
    sqlite_gateway: GatewayProcess, stub_process: StubProcess
) -> None:
    http = admin(sqlite_gateway.url)
    http.post("/api/models", json={"model": "policy", "endpoint": stub_process.base_url})
    ids = [f"call-cut-{i}" for i in range(4)]
    tokens = open_rollouts(http, ids)
    base = stub_process.received()
    with TcpProxy(sqlite_gateway.port) as link:

        def harness(rid: str) -> str | None:
            client = openai.OpenAI(
                base_url=proxy_url(link.url, rid), api_key=tokens[rid], max_retries=5
            )
            answer = client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": rid}],
                extra_body={"stub_delay_s": DELAY_S},
            )
            return answer.choices[0].message.content

        with ThreadPoolExecutor(len(ids)) as pool:
            answers = [pool.submit(harness, rid) for rid in ids]
            wait_until(
                lambda: stub_process.received() >= base + len(ids), "the calls reaching the engine"
            )
            assert link.drop() == len(ids)
            replies = [answer.result(timeout=60) for answer in answers]

    assert replies == [DEFAULT_REPLY] * len(ids)
    for rid in ids:
        events = http.get(f"/api/rollouts/{rid}/events").json()
        calls = [e["data"] for e in events if e["type"] == "model_request"]
        assert [(c["status"], c.get("abandoned")) for c in calls] == [(499, True), (200, False)]
        # (no agent reports a reward here; the test is about which calls are kept)
        record = rollout_from_events([Event.model_validate(e) for e in events], missing_reward=0.0)
        assert (len(record.calls), record.abandoned_calls) == (1, 1)
    print(f"harness<->gateway calls: {len(ids)} cut mid-call, each recorded abandoned + retried")


def test_cut_and_stalled_engine_links_answer_and_record_each_call_once(
    sqlite_gateway: GatewayProcess, stub_process: StubProcess
) -> None:
    http = admin(sqlite_gateway.url)
    ids = [f"engine-cut-{i}" for i in range(4)]
    tokens = open_rollouts(http, ids)
    base = stub_process.received()
    with TcpProxy(stub_process.port) as link:
        endpoint = f"{link.url}/v1"
        # Its own model name: the module's other test registered "policy" at the stub directly.
        http.post("/api/models", json={"model": "policy-link", "endpoint": endpoint})

        def harness(rid: str, n: int) -> str | None:
            # No retry of its own: whatever reaches this harness is the proxy's doing.
            url = proxy_url(sqlite_gateway.url, rid)
            client = openai.OpenAI(base_url=url, api_key=tokens[rid], max_retries=0)
            answer = client.chat.completions.create(
                model="policy-link",
                messages=[{"role": "user", "content": f"{rid} #{n}"}],
                extra_body={"stub_delay_s": DELAY_S if n == 0 else 0},
            )
            return answer.choices[0].message.content

        with ThreadPoolExecutor(len(ids)) as pool:
            # Dropped while every call waits at the engine: the proxy sends each again.
            answers = [pool.submit(harness, rid, 0) for rid in ids]
            wait_until(
                lambda: stub_process.received() >= base + len(ids), "the calls reaching the engine"
            )
            assert link.drop() > 0
            first = [answer.result(timeout=60) for answer in answers]
            # Stalled while the calls are sent: they wait, then complete.
            link.stall()
            answers = [pool.submit(harness, rid, 1) for rid in ids]
            wait_until(lambda: link.held >= 1, "a call being held on the engine link")
            link.resume()
            second = [answer.result(timeout=60) for answer in answers]

    assert first == second == [DEFAULT_REPLY] * len(ids)
    engine_requests = stub_process.received() - base
    assert engine_requests >= 3 * len(ids), "the cut calls must have been sent again"
    for rid in ids:
        calls = model_requests(http, rid)
        messages = [c["request"]["messages"][-1]["content"] for c in calls]  # type: ignore[index]
        assert messages == [f"{rid} #0", f"{rid} #1"], calls
        assert all(c["status"] == 200 for c in calls)
    print(
        f"gateway<->engine: {2 * len(ids)} calls, {link.dropped} engine connections cut, "
        f"{engine_requests} requests reached the engine, each call answered and recorded once"
    )


async def test_a_controller_cut_from_the_gateway_launches_no_rollout_twice(
    fresh_gateway: GatewayProcess, tmp_path: Path
) -> None:
    sqlite_gateway = fresh_gateway
    markers = tmp_path / "markers"
    markers.mkdir()
    ids = [f"ctl-cut-{i:02d}" for i in range(12)]
    task = {"markers": str(markers), "sleep": 0.3}
    async with GatewayClient(sqlite_gateway.url, ADMIN_KEY) as direct:
        await direct.create_rollouts([RolloutSpec(rollout_id=rid, input=task) for rid in ids])
        with TcpProxy(sqlite_gateway.port) as link:
            async with GatewayClient(
                link.url, ADMIN_KEY, timeout_s=1, max_retries=60, backoff_s=0.05, max_backoff_s=0.3
            ) as through_link:
                reconciler = LocalReconciler(
                    "tests.controller.agents:scale", 4, tmp_path / "logs", workdir=ROOT
                )
                # The agents report to the gateway directly: only the controller's link is cut.
                controller = Controller(
                    through_link, reconciler, gateway_url=sqlite_gateway.url, poll_interval_s=0.1
                )
                stop = asyncio.Event()
                running = asyncio.create_task(controller.run(stop))

                try:
                    for more in (2, 4, 6):
                        await _wait_async(lambda n=more: _count(markers) >= n, "launches")
                        link.drop()
                        link.stall(downstream_only=True)
                        before = through_link.retries
                        await _wait(lambda b=before: through_link.retries > b, "a controller retry")
                        link.resume()
                    await _wait_terminal(direct, ids)
                finally:
                    stop.set()
                    await asyncio.wait_for(running, 60)

        assert not (markers / "DUPLICATES").exists(), (markers / "DUPLICATES").read_text()
        for rid in ids:
            detail = await direct.get_rollout(rid)
            assert detail.rollout.status.state == "succeeded", detail
            assert detail.rollout.attempt_count == 1
            assert len(await direct.get_events(rid, types=[AGENT_LAUNCH])) == 1
    assert controller.stats.launched == len(ids)
    print(f"controller<->gateway: {len(ids)} rollouts, {link.dropped} connections cut, "
          f"{through_link.retries} retries, 0 launched twice")  # fmt: skip


def _count(markers: Path) -> int:
    return sum(1 for path in markers.iterdir() if path.name != "DUPLICATES")


async def _wait_async(condition: object, what: str) -> None:
    await _wait(condition, what, timeout_s=60)


async def _wait_terminal(client: GatewayClient, ids: list[str]) -> None:
    deadline = time.monotonic() + 90
    while True:
        states = [(await client.get_rollout(rid)).rollout.status.state for rid in ids]
        if all(state in TERMINAL_STATES for state in states):
            return
        assert time.monotonic() < deadline, f"rollouts not terminal: {states}"
        await asyncio.sleep(0.1)
