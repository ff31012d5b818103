"""GatewayClient against a real gateway; faults are injected by a transport wrapper (stubbed)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from reins.client import GatewayClient, GatewayError
from reins.schemas import EventIn, ModelEndpointIn, RolloutSpec
from tests.conftest import Gateway
from tests.support import free_port, http_server


class Flaky(httpx.AsyncBaseTransport):
    """Stub fault injector: fails the first `failures` requests, then forwards for real.

    `after_send=True` forwards the request first and then drops the reply, as when the
    connection breaks after the gateway committed: the retry must not store twice.
    """

    def __init__(
        self,
        failures: int,
        *,
        status: int | None = None,
        after_send: bool = False,
        method: str | None = None,
    ):
        self.failures = failures
        self.status = status
        self.after_send = after_send
        self.method = method
        """Only requests of this method fail (all when None)."""
        self.real = httpx.AsyncHTTPTransport()
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.method is not None and request.method != self.method:
            return await self.real.handle_async_request(request)
        self.calls += 1
        if self.calls <= self.failures:
            if self.after_send:
                response = await self.real.handle_async_request(request)
                await response.aread()
                raise httpx.ReadError("connection lost after the request was sent")
            if self.status is not None:
                return httpx.Response(self.status, json={"error": "injected"})
            raise httpx.ConnectError("injected connection failure")
        return await self.real.handle_async_request(request)


def client(gateway: Gateway, transport: httpx.AsyncBaseTransport | None = None) -> GatewayClient:
    return GatewayClient(gateway.url, gateway.api_key, backoff_s=0.01, transport=transport)


async def test_a_full_rollout_round_trip(gateway: Gateway) -> None:
    async with client(gateway) as gw:
        (rollout,) = await gw.create_rollouts([RolloutSpec(input={"q": 1}, group_id="g")])
        attempt = await gw.open_attempt(rollout.rollout_id, attempt_id=1)
        assert attempt.token
        await gw.post_event(rollout.rollout_id, 1, "reward", {"value": 1.0})
        done = await gw.set_status(rollout.rollout_id, "succeeded")
        assert done.status.state == "succeeded"
        events = await gw.get_events(rollout.rollout_id, types=["reward"])
        assert [e.data["value"] for e in events] == [1.0]
        page = await gw.list_rollouts(states=["succeeded"])
        assert [r.rollout_id for r in page.items] == [rollout.rollout_id]


class Newer(httpx.AsyncBaseTransport):
    """Stub of a newer gateway: forwards for real, then adds a field this client does not know
    to every JSON object of the answer (the page, each rollout, attempt, event, ack, model)."""

    def __init__(self) -> None:
        self.real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.real.handle_async_request(request)
        body = await response.aread()
        if not response.headers.get("content-type", "").startswith("application/json"):
            return httpx.Response(response.status_code, headers=response.headers, content=body)

        def grow(value: object) -> object:
            if isinstance(value, dict):
                return {**{k: grow(v) for k, v in value.items()}, "added_later": {"x": 1}}
            if isinstance(value, list):
                return [grow(v) for v in value]
            return value

        answer = json.loads(body)
        return httpx.Response(
            response.status_code, json=answer if response.status_code >= 400 else grow(answer)
        )


async def test_answers_with_fields_from_a_newer_gateway_are_read(gateway: Gateway) -> None:
    """A gateway may add fields to its answers without breaking the clients already deployed
    (an older client refused `database_id` when it came)."""
    async with client(gateway, Newer()) as gw:
        spec = RolloutSpec(input={"q": 1}, group_id="g", config={"runner_key": "kept"})
        (rollout,) = await gw.create_rollouts([spec])
        assert rollout.config.model_extra == {"runner_key": "kept", "added_later": {"x": 1}}
        # Free-form JSON (a rollout's input, an event's data) is kept as the gateway sent it.
        assert rollout.input == {"q": 1, "added_later": {"x": 1}}
        attempt = await gw.open_attempt(rollout.rollout_id)
        assert attempt.attempt_id == 1
        (ack,) = await gw.post_events(
            rollout.rollout_id, 1, [EventIn(type="reward", data={"value": 1.0})]
        )
        assert ack.seq > 0
        done = await gw.set_status(rollout.rollout_id, "succeeded")
        assert done.status.state == "succeeded"
        (event,) = await gw.get_events(rollout.rollout_id, types=["reward"])
        assert event.data["value"] == 1.0
        assert len(await gw.get_packed_events(rollout.rollout_id)) == 1
        page = await gw.list_rollouts(states=["succeeded"])
        assert [r.rollout_id for r in page.items] == [rollout.rollout_id]
        detail = await gw.get_rollout(rollout.rollout_id)
        assert [a.state for a in detail.attempts] == ["succeeded"]
        (model,) = await gw.register_models(
            [ModelEndpointIn(model="m", endpoint="http://127.0.0.1:9/v1")]
        )
        assert [m.model for m in await gw.list_models()] == [model.model]


async def test_transport_errors_are_retried(gateway: Gateway) -> None:
    flaky = Flaky(failures=3)
    async with client(gateway, flaky) as gw:
        await gw.create_rollouts([RolloutSpec(rollout_id="r")])
        assert gw.retries == 3


async def test_5xx_answers_are_retried(gateway: Gateway) -> None:
    async with client(gateway, Flaky(failures=2, status=503)) as gw:
        models = await gw.register_models(
            [ModelEndpointIn(model="m", endpoint="http://127.0.0.1:9/v1")]
        )
        assert [m.model for m in models] == ["m"]


async def test_a_lost_reply_is_retried_without_storing_twice(gateway: Gateway) -> None:
    async with client(gateway) as admin:
        await admin.create_rollouts([RolloutSpec(rollout_id="r")])
        await admin.open_attempt("r", attempt_id=1)
    async with client(gateway, Flaky(failures=1, after_send=True)) as gw:
        await gw.post_events("r", 1, [EventIn(type="reward", data={"value": 1.0})])
    async with client(gateway, Flaky(failures=1, after_send=True)) as gw:
        (rollout,) = await gw.create_rollouts([RolloutSpec(input="generated id")])
    async with client(gateway) as admin:
        assert len(await admin.get_events("r")) == 1
        page = await admin.list_rollouts()
        assert sorted(r.rollout_id for r in page.items) == sorted(["r", rollout.rollout_id])


async def test_opening_the_next_attempt_is_safe_to_retry_after_a_lost_reply(
    gateway: Gateway,
) -> None:
    async with client(gateway) as admin:
        await admin.create_rollouts([RolloutSpec(rollout_id="r")])
    # The first two tries' replies are lost after the gateway opened attempt 1: the retries
    # find it.
    flaky = Flaky(failures=2, after_send=True, method="POST")
    async with client(gateway, flaky) as gw:
        attempt = await gw.open_attempt("r")
    assert flaky.calls == 3
    async with client(gateway) as admin:
        detail = await admin.get_rollout("r")
    assert attempt.attempt_id == 1
    assert [(a.attempt_id, a.state) for a in detail.attempts] == [(1, "running")]


async def test_a_rollout_id_is_escaped_in_paths(gateway: Gateway) -> None:
    async with client(gateway) as admin:
        await admin.create_rollouts([RolloutSpec(rollout_id="a")])
        await admin.open_attempt("a", attempt_id=1)
        await admin.post_event("a", 1, "reward", {"value": 1.0})
        assert len(await admin.get_events("a")) == 1
        with pytest.raises(GatewayError) as raised:
            await admin.get_events("a?types=reward")
        assert raised.value.status_code == 404


async def test_a_dot_segment_rollout_id_names_no_other_resource(gateway: Gateway) -> None:
    """`.` and `..` are dot segments, which the URL's normalization removed: `get_rollout(".")`
    read the list of rollouts (and failed to parse it as a rollout), `..` reached `/api`."""
    async with client(gateway) as admin:
        for rollout_id in (".", ".."):
            with pytest.raises(GatewayError) as raised:
                await admin.get_rollout(rollout_id)
            assert raised.value.status_code == 404
            assert f"rollout {rollout_id} does not exist" in raised.value.message
        with pytest.raises(ValueError, match="not empty"):
            await admin.get_rollout("")


async def test_an_empty_name_filters_rather_than_naming_everything(gateway: Gateway) -> None:
    """`delete_models("")` dropped the parameter and deleted every model; `group_id=""` listed
    every group. The gateway reads both as a name that matches nothing."""
    async with client(gateway) as admin:
        await admin.register_models([ModelEndpointIn(model="m", endpoint="http://127.0.0.1:1/v1")])
        await admin.create_rollouts([RolloutSpec(rollout_id="r", group_id="g")])
        assert await admin.delete_models("") == 0
        assert [m.model for m in await admin.list_models()] == ["m"]
        assert (await admin.list_rollouts(group_id="")).items == []
        assert [r.rollout_id for r in (await admin.list_rollouts(group_id="g")).items] == ["r"]


async def test_4xx_is_raised_at_once_with_the_gateways_message(gateway: Gateway) -> None:
    flaky = Flaky(failures=0)
    async with client(gateway, flaky) as gw:
        with pytest.raises(GatewayError) as raised:
            await gw.get_rollout("missing")
    assert raised.value.status_code == 404
    assert "missing does not exist" in raised.value.message
    assert flaky.calls == 1


async def test_a_redirect_is_raised_naming_where_it_leads() -> None:
    """A gateway behind an ingress that redirects http to https: the client read the redirect's
    empty body as JSON and raised a bare JSONDecodeError."""

    class Redirecting(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(301)
            self.send_header("Location", "https://gateway.example" + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    with http_server(Redirecting) as port:
        async with GatewayClient(f"http://127.0.0.1:{port}", "k", retry_for_s=1) as gw:
            with pytest.raises(GatewayError) as raised:
                await gw.list_models()
    assert raised.value.status_code == 301
    assert "redirected to https://gateway.example/api/models" in raised.value.message


async def test_giving_up_after_max_retries(gateway: Gateway) -> None:
    gw = GatewayClient(
        gateway.url, gateway.api_key, backoff_s=0.001, max_retries=2, transport=Flaky(failures=99)
    )
    async with gw:
        with pytest.raises(GatewayError):
            await gw.list_models()
    assert gw.retries == 2


async def test_no_gateway_at_the_address_is_said_as_such() -> None:
    """No answer at all read "gateway answered 0: GET ... ConnectError(...)"."""
    url = f"http://127.0.0.1:{free_port()}"
    async with GatewayClient(url, "k", backoff_s=0.001, max_retries=0) as gw:
        with pytest.raises(GatewayError) as raised:
            await gw.list_models()
    assert raised.value.status_code == 0
    assert str(raised.value).startswith(f"cannot reach the gateway at {url} (GET /api/models: ")
    assert str(raised.value).endswith("is it running?")


async def test_calls_are_retried_for_a_time_not_a_count(gateway: Gateway) -> None:
    # As many failures as a gateway restart gives at the shortest backoff: still retried.
    gw = GatewayClient(
        gateway.url, gateway.api_key, backoff_s=0.001, max_backoff_s=0.001, transport=Flaky(40)
    )
    async with gw:
        assert await gw.list_models() == []
    assert gw.retries == 40
    quick = GatewayClient(
        gateway.url,
        gateway.api_key,
        backoff_s=0.01,
        retry_for_s=0.1,
        transport=Flaky(99, status=503),
    )
    async with quick:
        with pytest.raises(GatewayError) as raised:
            await quick.list_models()
    assert raised.value.status_code == 503 and 2 <= quick.retries < 20


async def test_follow_rollouts_yields_completions_in_order(gateway: Gateway) -> None:
    async with client(gateway) as gw:
        await gw.create_rollouts([RolloutSpec(rollout_id=f"r{i}") for i in range(3)])
        for rid in ("r1", "r2", "r0"):
            await gw.set_status(rid, "running")
            await gw.set_status(rid, "succeeded")
        seen = []
        async for rollout in gw.follow_rollouts(states=["succeeded"], poll_s=0.01):
            seen.append(rollout.rollout_id)
            if len(seen) == 3:
                break
        assert seen == ["r1", "r2", "r0"]
