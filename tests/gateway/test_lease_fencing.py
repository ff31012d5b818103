"""Writes under the `controller` lease (`/api/leases/{name}/rollouts/...`): refused once the
writer's lease lapsed, or changed hands, so two controllers never both act on one rollout."""

from __future__ import annotations

import asyncio
import time

import pytest

from reins.client import GatewayClient, GatewayError, LeaseFence, LeaseNotHeld
from reins.gateway.store.leases import token_of
from reins.gateway.store.sql import SqlStore
from reins.schemas import AGENT_LOG, Lease, RolloutSpec
from tests.conftest import Gateway


async def _wait_past(lease: Lease) -> None:
    """Until the lease's time is up on the gateway's clock (this process's)."""
    await asyncio.sleep(max(0.0, lease.expires_at - time.time()) + 0.05)


def _fence(lease: Lease) -> LeaseFence:
    fence = LeaseFence.of(lease)
    assert fence is not None, lease
    return fence


async def test_a_lapsed_holders_writes_are_refused_once_another_holds_the_lease(
    gateway: Gateway,
) -> None:
    """Controller a paused past its lease and b took it: a's late writes (its retry of the
    rollout, its report of the attempt's end, marking the rollout failed) were all stored
    beside b's, two controllers acting on one rollout."""
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        await client.create_rollouts([RolloutSpec(rollout_id="r", input={})])
        a = _fence(await client.claim_lease("controller", "a", ttl_s=0.5))
        first = await client.open_attempt_under(a, "r", 1)
        assert (first.attempt_id, first.state) == (1, "running") and first.token
        await _wait_past(await client.claim_lease("controller", "a", ttl_s=0.3))
        b = _fence(await client.claim_lease("controller", "b", ttl_s=60))
        assert b.token != a.token

        with pytest.raises(LeaseNotHeld, match="the controller lease is b's since") as refused:
            await client.open_attempt_under(a, "r", 2, reason="a's retry")
        assert refused.value.status_code == 409
        with pytest.raises(LeaseNotHeld):
            await client.set_status_under(a, "r", "failed", reason="a's report")
        with pytest.raises(LeaseNotHeld):
            await client.post_event_under(a, "r", 1, AGENT_LOG, {"outcome": "lost"}, AGENT_LOG)
        detail = await client.get_rollout("r")
        assert (detail.rollout.status.state, detail.rollout.attempt_count) == ("running", 1)
        assert await client.get_events("r", all_attempts=True) == []

        # b's own writes are stored.
        await client.post_event_under(b, "r", 1, AGENT_LOG, {"outcome": "crashed"}, AGENT_LOG)
        assert (await client.open_attempt_under(b, "r", 2, reason="b's retry")).attempt_id == 2
        done = await client.set_status_under(b, "r", "succeeded")
        assert (done.status.state, done.attempt_count) == ("succeeded", 2)
        logs = await client.get_events("r", all_attempts=True, types=[AGENT_LOG])
        assert [(e.attempt_id, e.data["outcome"]) for e in logs] == [(1, "crashed")]


async def test_a_holder_whose_lease_came_back_to_it_writes_only_under_its_new_token(
    gateway: Gateway,
) -> None:
    """a lapsed, b took the lease and gave it back, a took it again: a's writes under its first
    grant are refused (they were decided on what a read before b acted), and a stale release
    does not give up the new grant."""
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        await client.create_rollouts([RolloutSpec(rollout_id="r", input={})])
        old = _fence(await client.claim_lease("controller", "a", ttl_s=0.3))
        await _wait_past(await client.claim_lease("controller", "a", ttl_s=0.3))
        b = _fence(await client.claim_lease("controller", "b", ttl_s=60))
        assert await client.release_lease("controller", "b", b.token)
        new = _fence(await client.claim_lease("controller", "a", ttl_s=60))
        assert new.token != old.token

        with pytest.raises(LeaseNotHeld, match="under a grant it no longer holds"):
            await client.open_attempt_under(old, "r", 1)
        assert not await client.release_lease("controller", "a", old.token)
        assert (await client.open_attempt_under(new, "r", 1)).attempt_id == 1
        renewed = await client.claim_lease("controller", "a", ttl_s=60)
        assert LeaseFence.of(renewed) == new  # a renewal keeps the tenure and its token
        assert await client.release_lease("controller", "a", new.token)
        with pytest.raises(LeaseNotHeld, match="nobody holds the controller lease"):
            await client.set_status_under(new, "r", "succeeded")


async def test_a_lapsed_lease_nobody_took_is_refused_until_renewed(gateway: Gateway) -> None:
    """Past its time, a lease is not surely its holder's: another may take it at any moment,
    so its writes wait for the renewal, which (nobody having taken it) keeps its token."""
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        await client.create_rollouts([RolloutSpec(rollout_id="r", input={})])
        lease = await client.claim_lease("controller", "a", ttl_s=0.3)
        fence = _fence(lease)
        await _wait_past(lease)
        with pytest.raises(LeaseNotHeld, match="expired"):
            await client.open_attempt_under(fence, "r", 1)
        assert LeaseFence.of(await client.claim_lease("controller", "a", ttl_s=60)) == fence
        assert (await client.open_attempt_under(fence, "r", 1)).attempt_id == 1


async def test_writes_under_a_lease_keep_the_routes_checks(gateway: Gateway) -> None:
    """The twins answer what the rollout and event routes answer: the admin key, a known
    rollout, the transition table; a token that names no tenure is refused as not held."""
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        await client.create_rollouts([RolloutSpec(rollout_id="r", input={})])
        fence = _fence(await client.claim_lease("controller", "a", ttl_s=60))
        with pytest.raises(GatewayError) as missing:
            await client.open_attempt_under(fence, "nope", 1)
        assert missing.value.status_code == 404
        await client.set_status_under(fence, "r", "failed", reason="given up")
        with pytest.raises(GatewayError, match="it cannot become succeeded") as conflict:
            await client.set_status_under(fence, "r", "succeeded")
        assert not isinstance(conflict.value, LeaseNotHeld)
        forged = LeaseFence("controller", "a", "not-a-token")
        with pytest.raises(LeaseNotHeld):
            await client.set_status_under(forged, "r", "failed")
    path = "/api/leases/controller/rollouts/r"
    params = {"holder": "a", "token": fence.token}
    assert gateway.client().patch(path, params=params, json={}).status_code == 401
    assert gateway.http.patch(path, json={}).status_code == 422  # no holder, no token


async def test_the_lease_does_not_change_hands_while_a_write_under_it_is_being_stored(
    database_url: str,
) -> None:
    """A write checked while its lease held, and still being stored when the lease ran out
    (a slow commit), ended after another holder had taken the lease: both acted at once. A
    claim now waits for the writes under the lease to end."""
    store = SqlStore(database_url)
    await store.init()
    try:
        lease = await store.leases.claim("controller", "a", ttl_s=0.5)
        order: list[str] = []

        async def b_takes_it_once_it_lapses() -> None:
            for _ in range(3000):  # a standby controller's polls
                if (await store.leases.claim("controller", "b", ttl_s=60)).granted:
                    order.append("b took the lease")
                    return
                await asyncio.sleep(0.02)

        async with store.leases.holding("controller", "a", token_of(lease.since)):
            standby = asyncio.create_task(b_takes_it_once_it_lapses())
            while time.time() < lease.expires_at + 1.0:  # a's write outlasts its lease
                assert not standby.done()
                await asyncio.sleep(0.02)
            order.append("a's write stored")
        await asyncio.wait_for(standby, 30)
        assert order == ["a's write stored", "b took the lease"]
    finally:
        await store.close()
