"""`POST /api/leases/{name}`: one holder at a time of a role (the rollout controller's), renewed
by its holder, taken over once it expires, given up at once when released."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from reins.client import GatewayClient, GatewayError
from tests.conftest import Gateway


async def test_one_holder_at_a_time_until_its_lease_expires_or_is_released(
    gateway: Gateway,
) -> None:
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        first = await client.claim_lease("controller", "a", ttl_s=0.5)
        assert (first.holder, first.granted) == ("a", True)
        refused = await client.claim_lease("controller", "b", ttl_s=0.5)
        assert (refused.holder, refused.granted, refused.since) == ("a", False, first.since)
        renewed = await client.claim_lease("controller", "a", ttl_s=0.5)
        assert renewed.granted and renewed.since == first.since  # still held since then
        assert renewed.expires_at > first.expires_at
        assert (await client.claim_lease("other-role", "b", ttl_s=5)).granted  # names apart
        # Past the time of a's lease (a did not renew it), on the gateway's clock (this one's).
        await asyncio.sleep(max(0.0, renewed.expires_at - time.time()) + 0.05)
        taken = await client.claim_lease("controller", "b", ttl_s=60)
        assert (taken.holder, taken.granted) == ("b", True) and taken.since > first.since
        assert not (await client.claim_lease("controller", "a", ttl_s=60)).granted
        assert not await client.release_lease("controller", "a")  # not a's to give up
        assert await client.release_lease("controller", "b")
        assert (await client.claim_lease("controller", "a", ttl_s=60)).granted  # at once


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/leases/controller", {"holder": "", "ttl_s": 5}),
        ("/api/leases/controller", {"holder": "a", "ttl_s": 0}),
        ("/api/leases/controller", {"holder": "a", "ttl_s": 5, "extra": 1}),
        ("/api/leases/Not%20a%20name", {"holder": "a", "ttl_s": 5}),
    ],
)
def test_a_claim_that_names_no_holder_time_or_lease_is_422(
    gateway: Gateway, path: str, body: dict[str, object]
) -> None:
    assert gateway.http.post(path, json=body).status_code == 422


def test_a_holder_with_a_nul_is_refused_on_both_stores(gateway: Gateway) -> None:
    """PostgreSQL answered 500 (its text cannot hold a NUL) and dropped the connection; SQLite
    stored it: the two stores disagreed."""
    claimed = gateway.http.post("/api/leases/controller", json={"holder": "a\x00b", "ttl_s": 5})
    assert claimed.status_code == 422, claimed.text
    assert "holder" in claimed.text and "NUL" in claimed.text
    released = gateway.http.delete("/api/leases/controller", params={"holder": "a\x00b"})
    assert released.status_code == 200 and released.json() == {"released": False}
    assert gateway.http.post("/api/leases/controller", json={"holder": "a", "ttl_s": 5}).json()[
        "granted"
    ]


def test_leases_are_the_admins(gateway: Gateway) -> None:
    claim = {"holder": "a", "ttl_s": 5}
    assert httpx.post(f"{gateway.url}/api/leases/controller", json=claim).status_code == 401
    wrong = {"Authorization": "Bearer wrong-key"}
    answer = httpx.post(f"{gateway.url}/api/leases/controller", json=claim, headers=wrong)
    assert answer.status_code == 401


async def test_the_client_sends_a_lease_name_as_one_path_segment(gateway: Gateway) -> None:
    """`claim_lease("ctl#x")` went to `/api/leases/ctl` (`#x` read as a fragment): it claimed
    the lease `ctl`."""
    async with GatewayClient(gateway.url, gateway.api_key) as client:
        with pytest.raises(GatewayError) as refused:
            await client.claim_lease("ctl#x", "a", ttl_s=60)
        assert refused.value.status_code == 422
        assert (await client.claim_lease("ctl", "b", ttl_s=60)).granted  # not held by "a"
        with pytest.raises(ValueError, match="chunk must be at least 1 rollout, not 0"):
            await client.get_records(["r"], chunk=0)
