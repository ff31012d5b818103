"""`GatewayClient`: the typed async client of the gateway.

Every call is retried with exponential backoff on transport errors and 5xx answers, for two
minutes by default (`reins.retry`, the agents' policy too: past a gateway restart). That is safe
because every write is idempotent: rollout ids and event idempotency keys are chosen here, before
the first try, so a retry of a post whose reply was lost cannot create a second object.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Final, Self, TypeVar
from urllib.parse import quote

import httpx
from pydantic import JsonValue, TypeAdapter

from reins import recordbatch
from reins.recordbatch import DecodedRollout
from reins.retry import RETRY_FOR_S, retry_delays
from reins.schemas import (
    LEASE_NOT_HELD,
    Attempt,
    AttemptCreate,
    Event,
    EventAck,
    EventIn,
    Lease,
    Mode,
    Model,
    ModelEndpointIn,
    PackedEvent,
    Rollout,
    RolloutDetail,
    RolloutPage,
    RolloutSpec,
    RolloutState,
    RolloutStats,
    RolloutStatus,
    RolloutUpdate,
)

_rollouts = TypeAdapter(list[Rollout])
_events = TypeAdapter(list[Event])
_packed_events = TypeAdapter(list[PackedEvent])
_Paged = TypeVar("_Paged", Event, PackedEvent)
_acks = TypeAdapter(list[EventAck])
_models = TypeAdapter(list[Model])
_stats = TypeAdapter(dict[str, RolloutStats])
DRAIN_PATH: Final = "/api/admission/drain"
DRAIN_DEFAULT_S: Final = 600.0
"""The drain's `timeout_s` when none is given (`gateway.routes.admission`)."""
_NEWER: Final = "allow"
"""How answers are read: fields this client does not know (a newer gateway's) are accepted and
kept aside unread (`model_extra`), so a gateway can add to its answers without breaking the
clients already deployed. Not "ignore": that would also drop the keys a rollout's `config` keeps
for custom runners. The gateway itself refuses unknown fields in what it is sent."""


class GatewayError(Exception):
    """The gateway refused a call (4xx), or kept failing after every retry."""

    def __init__(self, status_code: int, message: str) -> None:
        # 0: no answer at all (refused, unreachable, cut off): says so, not "answered 0".
        super().__init__(
            f"cannot reach the gateway at {message}"
            if status_code == 0
            else f"gateway answered {status_code}: {message}"
        )
        self.status_code = status_code
        self.message = message


class LeaseNotHeld(GatewayError):
    """A write under a lease was refused (409): the lease lapsed, or another holder took it
    (or took it and gave it back) since the writer's grant. The writer no longer holds it."""


@dataclass(frozen=True)
class LeaseFence:
    """What a lease's holder sends with its writes under it (`GatewayClient.*_under`)."""

    name: str
    holder: str
    token: str
    """The grant's `token`: it names the holder's tenure, so a write of an earlier one fails."""

    @classmethod
    def of(cls, lease: Lease) -> LeaseFence | None:
        """The fence of a granted lease; None when not granted, or from a gateway older than
        fenced writes (its answer has no token)."""
        if not lease.granted or lease.token is None:
            return None
        return cls(lease.name, lease.holder, lease.token)

    @property
    def path(self) -> str:
        return f"/api/leases/{quote(self.name, safe='')}"


class DatabaseChanged(Exception):
    """The gateway's database is not the one a change cursor was following: another database
    (a gateway restarted on a fresh SQLite file), or the same one gone back to an older copy
    (restored from a backup): the cursor's rollouts are not in it, or not as they were."""


def check_database(followed: str | None, cursor: int, page: RolloutPage) -> str | None:
    """The database a cursor follows after reading `page` at `cursor`: the page's, if it is the
    same one (or the first known); raises `DatabaseChanged` if it is another, or if its changes
    end before the cursor (the gateway answers a `next_cursor` below the cursor then)."""
    if followed is not None and page.database_id is not None and page.database_id != followed:
        raise DatabaseChanged(
            f"the gateway's database changed (was {followed}, now {page.database_id}): the "
            "rollouts followed are not in it; follow the new database from cursor 0"
        )
    if page.next_cursor < cursor:
        raise DatabaseChanged(
            f"the gateway's database went back: its changes end at {page.next_cursor}, before "
            f"this cursor ({cursor}), as when it is restored from an older copy; the rollouts "
            "followed may be gone or in earlier states: follow it again from cursor 0"
        )
    return page.database_id or followed


def _gateway_url(url: str) -> str:
    """`url` without its trailing slash; ValueError when it cannot be a gateway's: no
    http(s) scheme or host, or a port out of range (`notaurl` was retried for two minutes as
    an outage, `:99999` and `:abc` were tracebacks)."""
    try:
        parsed = httpx.URL(url)
        port = parsed.port
    except (httpx.InvalidURL, ValueError) as error:
        raise ValueError(f"{url!r} is not a gateway URL ({error})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not a gateway URL: write http://HOST:PORT")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"{url!r} is not a gateway URL: its port is not 1-65535")
    return url.rstrip("/")


def _check_key(key: str) -> None:
    """The gateway refuses these keys (`GatewaySettings.api_key`); sent, an empty one read as an
    unreachable gateway, retried for two minutes, and a non-ASCII one was a traceback."""
    if not key.strip():
        raise ValueError("the admin key is empty: pass --api-key or set REINS_API_KEY")
    if key != key.strip() or not key.isascii() or not key.isprintable():
        raise ValueError("the admin key must be printable ASCII without outer spaces")


class GatewayClient:
    """Async client; use as `async with GatewayClient(url, api_key) as gateway: ...`."""

    @staticmethod
    def check(base_url: str, api_key: str) -> str:
        """The URL as the client keeps it; ValueError for a URL or a key no gateway takes."""
        _check_key(api_key)
        return _gateway_url(base_url)

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout_s: float = 30.0,
        retry_for_s: float = RETRY_FOR_S,
        max_retries: int | None = None,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 16,
    ) -> None:
        self.base_url = self.check(base_url, api_key)
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        """How long one call is retried from its first try (`reins.retry`)."""
        self.max_retries = max_retries
        """At most this many retries of one call as well (None: as many as `retry_for_s` has)."""
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.retries = 0
        """Calls retried so far (transport errors and 5xx), for diagnostics."""
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout_s,
            transport=transport,
            # Small on purpose: httpcore checks every pooled connection's socket on each request
            # (a few syscalls each); with the controller's bursts the pool grew to ~64
            # connections and those checks took a quarter of its thread's time (py-spy).
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One call with retries; returns the decoded JSON body."""
        return (await self._send(method, path, **kwargs)).json()

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One call with retries; returns the successful response."""
        delays = retry_delays(self.retry_for_s, first_s=self.backoff_s, max_s=self.max_backoff_s)
        if path == DRAIN_PATH and "timeout" not in kwargs:
            kwargs["timeout"] = self._drain_timeout(kwargs.get("params"))
        for tried in itertools.count():
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.TransportError as error:
                where = self._http.base_url
                failure = GatewayError(0, f"{where} ({method} {path}: {error!r}); is it running?")
                failure.__cause__ = error
            else:
                if response.status_code < 500:
                    if response.status_code >= 400:
                        raise GatewayError(response.status_code, _message(response))
                    if response.status_code >= 300:
                        # Not followed (a 301 or 302 would resend a POST as a GET), and not an
                        # answer: read as one, its empty body was a bare JSONDecodeError.
                        raise GatewayError(
                            response.status_code,
                            f"{method} {path} was redirected to "
                            f"{response.headers.get('location', 'another URL')}: give the client "
                            "the gateway's own URL",
                        )
                    return response
                failure = GatewayError(response.status_code, _message(response))
            out_of_tries = self.max_retries is not None and tried >= self.max_retries
            delay = None if out_of_tries else next(delays, None)
            if delay is None:
                raise failure
            self.retries += 1
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _drain_timeout(self, params: Any) -> httpx.Timeout:
        """A drain answers once the calls in flight end, up to its `timeout_s` (the gateway's
        default: 600 s): its answer may take that long. With the client's own timeout (30 s),
        a drain that waited for a long call was cut off, retried, and after `retry_for_s` failed
        as "cannot reach the gateway" instead of answering `drained: false`."""
        waits_s = DRAIN_DEFAULT_S
        if isinstance(params, dict) and params.get("timeout_s") is not None:
            with contextlib.suppress(TypeError, ValueError):
                waits_s = float(params["timeout_s"])
        return httpx.Timeout(self.timeout_s, read=waits_s + self.timeout_s)

    # -- rollouts -------------------------------------------------------------------------

    async def create_rollouts(self, specs: Sequence[RolloutSpec]) -> list[Rollout]:
        """Declares rollouts; ids are chosen here when absent so that a retry is harmless."""
        body = [
            (
                spec if spec.rollout_id else spec.model_copy(update={"rollout_id": _new_id()})
            ).model_dump(mode="json")
            for spec in specs
        ]
        return _rollouts.validate_python(
            await self.request("POST", "/api/rollouts", json=body), extra=_NEWER
        )

    async def list_rollouts(
        self,
        *,
        states: Sequence[RolloutState] = (),
        mode: Mode | None = None,
        group_id: str | None = None,
        cursor: int = 0,
        limit: int = 100,
    ) -> RolloutPage:
        params: dict[str, Any] = {"cursor": cursor, "limit": limit}
        if states:
            params["status"] = list(states)
        # `is not None`: an empty name is a filter too (no rollout has it), not "any".
        if mode is not None:
            params["mode"] = mode
        if group_id is not None:
            params["group_id"] = group_id
        return RolloutPage.model_validate(
            await self.request("GET", "/api/rollouts", params=params), extra=_NEWER
        )

    async def follow_rollouts(
        self,
        *,
        states: Sequence[RolloutState] = (),
        mode: Mode | None = None,
        group_id: str | None = None,
        cursor: int = 0,
        poll_s: float = 0.2,
    ) -> AsyncIterator[Rollout]:
        """Yields rollouts as they change (or reach `states`), in order, forever; raises
        `DatabaseChanged` if the gateway comes back on another database."""
        database: str | None = None
        while True:
            page = await self.list_rollouts(
                states=states, mode=mode, group_id=group_id, cursor=cursor, limit=1000
            )
            database = check_database(database, cursor, page)
            for rollout in page.items:
                yield rollout
            cursor = page.next_cursor
            if not page.items:
                await asyncio.sleep(poll_s)

    async def get_rollout(self, rollout_id: str) -> RolloutDetail:
        return RolloutDetail.model_validate(
            await self.request("GET", _rollout_path(rollout_id)), extra=_NEWER
        )

    async def update_rollout(self, rollout_id: str, update: RolloutUpdate) -> Rollout:
        return Rollout.model_validate(
            await self.request(
                "PATCH",
                _rollout_path(rollout_id),
                json=update.model_dump(mode="json", exclude_none=True),
            ),
            extra=_NEWER,
        )

    async def set_status(
        self, rollout_id: str, state: RolloutState, reason: str | None = None
    ) -> Rollout:
        return await self.update_rollout(
            rollout_id, RolloutUpdate(status=RolloutStatus(state=state, reason=reason))
        )

    async def open_attempt(
        self, rollout_id: str, attempt_id: int | None = None, reason: str | None = None
    ) -> Attempt:
        """Opens attempt `attempt_id`, by default the rollout's next one (read first, so that a
        retry of a post whose reply was lost finds the attempt it opened instead of opening, and
        superseding it with, another). An attempt opened meanwhile by someone else is a 409."""
        if attempt_id is None:
            attempt_id = len((await self.get_rollout(rollout_id)).attempts) + 1
        body = AttemptCreate(attempt_id=attempt_id, reason=reason).model_dump(exclude_none=True)
        return Attempt.model_validate(
            await self.request("POST", f"{_rollout_path(rollout_id)}/attempts", json=body),
            extra=_NEWER,
        )

    # -- events ---------------------------------------------------------------------------

    async def post_events(
        self, rollout_id: str, attempt_id: int, events: Sequence[EventIn]
    ) -> list[EventAck]:
        body = [
            (
                event
                if event.idempotency_key
                else event.model_copy(update={"idempotency_key": _new_id()})
            ).model_dump(mode="json")
            for event in events
        ]
        return _acks.validate_python(
            await self.request(
                "POST", f"{_rollout_path(rollout_id)}/attempt/{attempt_id}/events", json=body
            ),
            extra=_NEWER,
        )

    async def post_event(
        self,
        rollout_id: str,
        attempt_id: int,
        type: str,
        data: dict[str, JsonValue],
        idempotency_key: str | None = None,
    ) -> EventAck:
        event = EventIn(type=type, data=data, idempotency_key=idempotency_key)
        (stored,) = await self.post_events(rollout_id, attempt_id, [event])
        return stored

    async def get_events(
        self,
        rollout_id: str,
        *,
        attempt_id: int | None = None,
        all_attempts: bool = False,
        types: Sequence[str] = (),
    ) -> list[Event]:
        """Every matching event, paging through the gateway's limit."""
        params: dict[str, Any] = {}
        if attempt_id is not None:
            params["attempt_id"] = attempt_id
        if all_attempts:
            params["all_attempts"] = True
        if types:
            params["type"] = list(types)
        return await self._pages(f"{_rollout_path(rollout_id)}/events", params, _events)

    async def get_packed_events(
        self, rollout_id: str, *, attempt_id: int | None = None, all_attempts: bool = False
    ) -> list[PackedEvent]:
        """An attempt's events (every attempt's with `all_attempts`) as the store keeps them
        (`reins.packed.unpack_events` restores them), paging through the gateway's limit."""
        params: dict[str, Any] = {} if attempt_id is None else {"attempt_id": attempt_id}
        if all_attempts:
            params["all_attempts"] = True
        return await self._pages(
            f"{_rollout_path(rollout_id)}/events/packed", params, _packed_events
        )

    async def _pages(
        self, path: str, params: dict[str, Any], adapter: TypeAdapter[list[_Paged]]
    ) -> list[_Paged]:
        """Every page of an events route, `after` the last seq of the one before."""
        out: list[_Paged] = []
        after = 0
        while True:
            page = adapter.validate_python(
                await self.request("GET", path, params={**params, "after": after, "limit": 10_000}),
                extra=_NEWER,
            )
            out.extend(page)
            if len(page) < 10_000:
                return out
            after = page[-1].seq

    async def rollout_stats(
        self, rollout_ids: Sequence[str], *, model: str | None = None, chunk: int = 10_000
    ) -> dict[str, RolloutStats]:
        """Each rollout's latest attempt in figures (calls, tokens, the versions that served
        them, last reward), computed by the gateway without sending the events. With `model`
        (the policy's registered name), the versions of calls another model served are left
        out."""
        ids = list(dict.fromkeys(rollout_ids))
        out: dict[str, RolloutStats] = {}
        for start in range(0, len(ids), chunk):
            body: dict[str, Any] = {"rollout_ids": ids[start : start + chunk]}
            if model is not None:
                body["model"] = model
            answer = await self.request("POST", "/api/rollouts/stats", json=body)
            out.update(_stats.validate_python(answer, extra=_NEWER))
        return out

    async def get_records(
        self, rollout_ids: Sequence[str], *, model: str | None = None, chunk: int = 32
    ) -> list[DecodedRollout]:
        """The calls and last reward of each rollout's latest attempt, as arrays: the trainer's
        read (`reins.recordbatch`; `record_of` makes each a `RolloutRecord`). `chunk` rollouts
        per request. With `model` (the policy's registered name), the calls another model
        served are left out (`DecodedRollout.other_model_calls` counts them)."""
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1 rollout, not {chunk}")
        ids = list(rollout_ids)
        chunks = [ids[start : start + chunk] for start in range(0, len(ids), chunk)]
        loop = asyncio.get_running_loop()
        decoded: list[asyncio.Future[list[DecodedRollout]]] = []
        # The previous chunk decodes in a thread while the gateway reads this one. One thread,
        # chunks in turn: decoding is many short GIL-releasing steps (zlib, numpy copies), and two
        # threads decoding at once hand the GIL back and forth at each of them, which took 1.5-2x
        # the time of decoding the same chunks one after the other (512 rollouts x 32k).
        with futures.ThreadPoolExecutor(1, thread_name_prefix="reins-records") as decoder:
            for part in chunks:
                body: dict[str, Any] = {"rollout_ids": part}
                if model is not None:
                    body["model"] = model
                response = await self._send("POST", "/api/records", json=body)
                decoded.append(loop.run_in_executor(decoder, recordbatch.decode, response.content))
            out: list[DecodedRollout] = []
            for future in decoded:
                out.extend(await future)
        return out

    # -- models ---------------------------------------------------------------------------

    async def register_models(self, endpoints: Sequence[ModelEndpointIn]) -> list[Model]:
        body = [endpoint.model_dump(mode="json") for endpoint in endpoints]
        return _models.validate_python(
            await self.request("POST", "/api/models", json=body), extra=_NEWER
        )

    async def list_models(self) -> list[Model]:
        return _models.validate_python(await self.request("GET", "/api/models"), extra=_NEWER)

    async def delete_models(self, model: str | None = None) -> int:
        """How many endpoints it deleted (a retry after a lost reply counts those it found left)."""
        # `is not None`: "" names no model; dropped, it would delete every model.
        params = {"model": model} if model is not None else {}
        answer = await self.request("DELETE", "/api/models", params=params)
        return int(answer["deleted"])

    # -- leases ----------------------------------------------------------------------------

    async def claim_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        """Takes or renews lease `name` (`gateway.store.leases`); `granted` says whether this
        holder has it, and `LeaseFence.of` what its writes under it carry. A `GatewayError` 404
        from a gateway older than leases."""
        body = {"holder": holder, "ttl_s": ttl_s}
        answer = await self.request("POST", f"/api/leases/{quote(name, safe='')}", json=body)
        return Lease.model_validate(answer, extra=_NEWER)

    async def release_lease(self, name: str, holder: str, token: str | None = None) -> bool:
        """Gives lease `name` up if `holder` holds it (under `token`, when given: not a tenure
        the holder took again since)."""
        params = {"holder": holder} if token is None else {"holder": holder, "token": token}
        answer = await self.request("DELETE", f"/api/leases/{quote(name, safe='')}", params=params)
        return bool(answer["released"])

    async def open_attempt_under(
        self, fence: LeaseFence, rollout_id: str, attempt_id: int, reason: str | None = None
    ) -> Attempt:
        """`open_attempt`, by a lease's holder: `LeaseNotHeld` once the lease is not its own."""
        body = AttemptCreate(attempt_id=attempt_id, reason=reason).model_dump(exclude_none=True)
        path = f"{fence.path}{_rollout_path(rollout_id)[len('/api') :]}/attempts"
        answer = await self._fenced("POST", path, fence, json=body)
        return Attempt.model_validate(answer, extra=_NEWER)

    async def set_status_under(
        self, fence: LeaseFence, rollout_id: str, state: RolloutState, reason: str | None = None
    ) -> Rollout:
        """`set_status`, by a lease's holder: `LeaseNotHeld` once the lease is not its own."""
        update = RolloutUpdate(status=RolloutStatus(state=state, reason=reason))
        path = f"{fence.path}{_rollout_path(rollout_id)[len('/api') :]}"
        body = update.model_dump(mode="json", exclude_none=True)
        answer = await self._fenced("PATCH", path, fence, json=body)
        return Rollout.model_validate(answer, extra=_NEWER)

    async def post_event_under(
        self,
        fence: LeaseFence,
        rollout_id: str,
        attempt_id: int,
        type: str,
        data: dict[str, JsonValue],
        idempotency_key: str | None = None,
    ) -> EventAck:
        """`post_event`, by a lease's holder: `LeaseNotHeld` once the lease is not its own."""
        event = EventIn(type=type, data=data, idempotency_key=idempotency_key or _new_id())
        path = f"{fence.path}{_rollout_path(rollout_id)[len('/api') :]}/attempt/{attempt_id}/events"
        answer = await self._fenced("POST", path, fence, json=event.model_dump(mode="json"))
        return EventAck.model_validate(answer, extra=_NEWER)

    async def _fenced(self, method: str, path: str, fence: LeaseFence, **kwargs: Any) -> Any:
        try:
            return await self.request(
                method, path, params={"holder": fence.holder, "token": fence.token}, **kwargs
            )
        except GatewayError as error:
            if error.status_code == 409 and error.message.startswith(LEASE_NOT_HELD):
                raise LeaseNotHeld(error.status_code, error.message) from None
            raise

    async def healthz(self) -> bool:
        try:
            response = await self._http.get("/healthz")
        except httpx.TransportError:
            return False
        return response.status_code == 200


def _rollout_path(rollout_id: str) -> str:
    """A rollout's path, its id escaped: an id with `/` or `?` names no other resource, nor
    does `.` or `..` (a dot segment, which the URL's normalization would remove: `get_rollout(".")`
    read the list of rollouts). No path names an empty id."""
    if not rollout_id:
        raise ValueError("a rollout id is not empty")
    escaped = quote(rollout_id, safe="")
    if escaped in (".", ".."):
        escaped = escaped.replace(".", "%2E")
    return f"/api/rollouts/{escaped}"


def _new_id() -> str:
    return uuid.uuid4().hex


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return str(body)[:500]
