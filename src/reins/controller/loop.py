"""The reconcile loop (paper appendix A.2) and the `Reconciler` protocol it drives.

The gateway is the ground truth. Each pass compares the active rollouts it holds (followed through
its change cursor) with the executions a reconciler knows (local processes, Kubernetes Jobs) and
acts on the difference: a queuing rollout gets attempt 1 and an agent, a finished agent is
reported (success, or a new attempt up to `max_attempts`, or failure), an agent whose rollout is
terminal or superseded is stopped. Everything it does is idempotent, so a restarted controller
converges to the same result:

- attempts are opened with an explicit id (`latest + 1`), so a retried open returns the same one;
- a reconciler never launches a second execution for an attempt it already knows (a pid file,
  a Job name derived from the attempt);
- every launch is recorded as an `agent_launch` event on its attempt, so an attempt whose
  execution vanished while no controller watched is reported lost instead of launched again;
- the `agent_log` and `agent_launch` events carry fixed idempotency keys, so a repeated report
  is stored once;
- an attempt a controller's shutdown stopped (its `agent_log` outcome `stopped`) is retried by
  the next controller and does not count against `max_attempts`: a graceful restart costs a
  rollout its running attempt's work, never its last chance.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import re
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from reins.client import GatewayClient, GatewayError, LeaseFence, LeaseNotHeld
from reins.schemas import AGENT_LAUNCH, AGENT_LOG, TERMINAL_STATES, Attempt, Lease, Rollout

log = logging.getLogger("reins.controller")

TAIL_BYTES = 4096
"""How much of the end of an agent's output the `agent_log` event carries."""
MAX_INPUT_BYTES = 128 * 1024 - len("REINS_INPUT=") - 1
"""The largest REINS_INPUT value: Linux limits one environment string, `NAME=VALUE` and its
terminating NUL, to 128 KiB (MAX_ARG_STRLEN)."""

Outcome = Literal["succeeded", "crashed", "timeout", "lost", "stopped"]
"""`stopped`: killed by a controller's own shutdown (SIGINT, SIGTERM); the attempt is retried
and, not being the agent's failure, not counted against `max_attempts`."""
Key = tuple[str, int]
"""An execution is named by its (rollout id, attempt id)."""

_MODULE_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_T = TypeVar("_T")


@dataclass(frozen=True)
class Launch:
    """What a reconciler needs to start one attempt's agent."""

    rollout_id: str
    attempt_id: int
    agent: str | None
    """`module:function` or a command line; None means the reconciler's default agent."""
    env: Mapping[str, str]
    """The agent's environment contract (OPENAI_*, ANTHROPIC_*, REINS_*)."""
    timeout_s: float | None
    """Wall-clock limit of this attempt; None for none."""
    incarnation: str
    """Tells this rollout from an older one with the same id (another gateway database, say),
    whose traces (files, Jobs) may still be around: its creation time at the gateway."""

    @property
    def key(self) -> Key:
        return (self.rollout_id, self.attempt_id)


@dataclass(frozen=True)
class Ended:
    """An execution that is over, as its reconciler saw it."""

    outcome: Outcome
    exit_code: int | None
    detail: str
    """One sentence for the failure reason: `exited with status 3`, `timed out after 30 s`."""


@dataclass(frozen=True)
class AgentLog:
    """Where an attempt's output is kept, and its last bytes."""

    path: str
    tail: str


RUNNING: Literal["running"] = "running"
State = Literal["running"] | Ended


class LaunchError(Exception):
    """The agent cannot be launched for this rollout, and retrying will not help."""


class KeyRefused(Exception):
    """The gateway answered 401 or 403 to the controller: no retry can help, the controller
    stops (a wrong or rotated admin key, or a gateway restarted with another one)."""


CONTROLLER_LEASE = "controller"
LEASE_TTL_S = 15.0
"""How long a controller that stopped renewing (killed) keeps another one waiting."""


class LeaseLost(RuntimeError):
    """Another controller holds the gateway's `controller` lease now: this one stops."""


class LeaseLapsed(Exception):
    """An action found this controller's lease past its end (the controller paused: a stopped
    process, a long collection), or changed hands since the action began: it does nothing, and
    the next pass, under a renewed lease and on a fresh read, decides again."""


_ACTION_LEASE_EPOCH: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "action_lease_epoch", default=None
)
"""In an action's task: the controller's `_lease_epoch` when the action was decided."""


def _when(unix: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix))


class Reconciler(Protocol):
    """Runs agents somewhere (local processes, Kubernetes Jobs) for the controller.

    Every method is called from the controller's event loop. Executions are named by their
    (rollout id, attempt id); a reconciler keeps those it launched or adopted until `remove`.
    """

    runner: str
    """A short name for events and logs: `local`, `kubernetes`."""
    lease_holder: str
    """Who this reconciler is to the gateway's `controller` lease: the same after a restart
    (the log folder, the namespace), so a controller killed and started again takes its lease
    back at once, while another one waits."""

    async def start(self, on_change: Callable[[], None]) -> None:
        """Get ready (watch, adopt what a previous controller left running).

        `on_change` wakes the controller when an execution ends; it may be called from any thread.
        """

    async def close(self) -> None:
        """Stop watching; local agents are killed, Kubernetes Jobs are left to a next controller."""

    def free_slots(self) -> int:
        """How many more executions may start now."""

    def executions(self) -> Iterable[Key]:
        """Every execution it knows: running, or ended and not yet removed."""

    def state(self, key: Key) -> State | None:
        """What it knows of one execution, from memory: running, ended, or None (unknown)."""

    def incarnation(self, key: Key) -> str | None:
        """The `Launch.incarnation` of a known execution (None when it cannot tell)."""

    async def find(self, key: Key, incarnation: str) -> State | None:
        """Like `state`, but also looks for durable traces (a pid file, a Job) left by a previous
        controller for this incarnation; a live execution found so is adopted and watched."""

    async def launch(self, launch: Launch) -> str:
        """Start the agent; returns where it runs (for the `agent_launch` event).

        Never starts a second execution for a key it knows. Raises `LaunchError` when the launch
        can never work (a malformed template, an input too large).
        """

    async def agent_log(self, key: Key) -> AgentLog:
        """Where the output of an ended execution is kept, and its tail."""

    async def remove(self, key: Key) -> None:
        """Stop the execution if it runs (kill the process group, delete the Job) and forget it."""


def agent_command(agent: str, python: str) -> list[str]:
    """The argv that runs `agent`: `module:function` through `reins.controller.run_agent` in a
    fresh interpreter, anything else as a shell command line."""
    if _MODULE_FUNCTION.match(agent):
        return [python, "-m", "reins.controller.run_agent", agent]
    return ["/bin/sh", "-c", agent]


def proxy_base_url(
    gateway_url: str, rollout_id: str, attempt_id: int, mode: str, api: str = "openai/v1"
) -> str:
    """The proxy's base URL for one attempt: `api` is `openai/v1` (OpenAI clients) or
    `anthropic` (Anthropic clients, which append `/v1/messages`)."""
    return (
        f"{gateway_url.rstrip('/')}/proxy/rollout/{rollout_id}/attempt/{attempt_id}"
        f"/mode/{mode}/{api}"
    )


def agent_env(gateway_url: str, rollout: Rollout, attempt: Attempt) -> dict[str, str]:
    """The environment every agent gets (docs/controller.md, "The agent's environment")."""
    if not attempt.token:
        raise LaunchError(f"the gateway returned attempt {attempt.attempt_id} without its token")
    encoded = json.dumps(rollout.input, separators=(",", ":"))
    if len(encoded.encode()) > MAX_INPUT_BYTES:
        raise LaunchError(
            f"rollout input is {len(encoded.encode())} bytes of JSON; agents receive it in "
            f"REINS_INPUT, and Linux limits that variable's value to {MAX_INPUT_BYTES} bytes: "
            "store large inputs elsewhere and pass a reference"
        )
    return {
        "OPENAI_BASE_URL": proxy_base_url(
            gateway_url, rollout.rollout_id, attempt.attempt_id, rollout.mode
        ),
        "OPENAI_API_KEY": attempt.token,
        # Claude Code and other Anthropic clients: the same proxy, the same token (sent as
        # `Authorization: Bearer` from the first, as `x-api-key` from the second).
        "ANTHROPIC_BASE_URL": proxy_base_url(
            gateway_url, rollout.rollout_id, attempt.attempt_id, rollout.mode, api="anthropic"
        ),
        "ANTHROPIC_AUTH_TOKEN": attempt.token,
        "ANTHROPIC_API_KEY": attempt.token,
        "REINS_GATEWAY_URL": gateway_url.rstrip("/"),
        "REINS_ROLLOUT_ID": rollout.rollout_id,
        "REINS_ATTEMPT_ID": str(attempt.attempt_id),
        "REINS_MODE": rollout.mode,
        "REINS_INPUT": encoded,
    }


@dataclass
class ControllerStats:
    """Counters since start, for logs, tests and benchmarks."""

    launched: int = 0
    adopted: int = 0
    """Executions a previous controller left, taken over (found at start or on recovery)."""
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    removed: int = 0
    passes: int = 0
    errors: int = 0
    launch_latency_s: list[float] = field(default_factory=list)
    """Seconds from a rollout's creation at the gateway to its attempt 1 being launched."""


class Controller:
    """Drives a reconciler until the gateway's active rollouts are all executed.

    `run()` loops until `stop` is set; `reconcile_once()` is one pass. Actions (open an attempt
    and launch, report an end) run as tasks, one at a time per rollout, so a slow HTTP call or a
    rate-limited Job creation never holds up the others.
    """

    def __init__(
        self,
        client: GatewayClient,
        reconciler: Reconciler,
        *,
        gateway_url: str,
        max_attempts: int = 3,
        default_timeout_s: float | None = None,
        poll_interval_s: float = 0.25,
        lease_ttl_s: float = LEASE_TTL_S,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {max_attempts}")
        self.client = client
        self.reconciler = reconciler
        self.gateway_url = gateway_url.rstrip("/")
        """The gateway as agents reach it (it may differ from the client's URL in a cluster)."""
        self.max_attempts = max_attempts
        self.default_timeout_s = default_timeout_s
        self.poll_interval_s = poll_interval_s
        self.stats = ControllerStats()
        self._active: dict[str, Rollout] = {}
        self._cursor: int | None = None
        self._database_id: str | None = None
        """The gateway's database `_cursor` counts the changes of (None: a gateway older than
        database ids)."""
        self._opened: dict[str, int] = {}
        self._recorded: set[Key] = set()
        """Attempts whose `agent_launch` event this controller posted."""
        self._busy: dict[str, asyncio.Task[None]] = {}
        self._reserved = 0
        self._backoff: dict[str, tuple[float, float]] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self.lease_ttl_s = lease_ttl_s
        self._lease_renewed: float | None = None
        """When the `controller` lease was last renewed (monotonic); None: not held."""
        self._lease_until: float | None = None
        """Until when (monotonic) the lease is surely this controller's: the TTL from before
        the renewal was sent. None: no lease held (a gateway older than leases, or one pass at
        a time without `run()`)."""
        self._lease_since: float | None = None
        """The `since` of the lease this controller holds: another one, at a renewal, means
        another controller held the lease in between (and ran rollouts)."""
        self._lease_epoch = 0
        """How many times the lease changed hands under this controller: an action decided
        before a change acts on a stale read, so it stops at its next lease check."""
        self._lease_fence: LeaseFence | None = None
        """What this controller's writes carry, so that the gateway refuses them once the
        lease is not its own (None: a gateway older than fenced writes, or no lease held)."""
        self._fence_refused = False
        """Whether the gateway refused a write under the lease since it was last renewed
        (said once)."""

    # -- running ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the reconciler (watches, adoption); `run()` calls it."""
        if not self._started:
            self._loop = asyncio.get_running_loop()
            await self.reconciler.start(self._wake_threadsafe)
            self._started = True
            # What a previous controller left running, taken over by the reconciler at start.
            self.stats.adopted += sum(1 for _ in self.reconciler.executions())

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Reconciles until `stop` is set; then stops its actions and closes the reconciler."""
        stop = stop or asyncio.Event()
        waker = asyncio.create_task(self._wake_on(stop))
        try:
            await self.start()  # first: a reconciler that cannot start says so at once
            if not await self._take_lease(stop):
                return
            failures = 0
            while not stop.is_set():
                self._wake.clear()
                try:
                    await self._renew_lease()
                    await self.reconcile_once()
                    failures = 0
                except GatewayError as error:
                    if error.status_code in (401, 403):
                        raise KeyRefused(
                            f"the gateway refuses this controller's key ({error.message}): "
                            "give the controller the gateway's admin key (--api-key or "
                            "REINS_API_KEY); its agents are stopped"
                        ) from error
                    # The gateway is down or failing: keep what runs, try again with backoff.
                    failures += 1
                    self.stats.errors += 1
                    log.warning("reconcile pass failed (%s); retrying", error)
                    await asyncio.sleep(min(5.0, self.poll_interval_s * 2**failures))
                await self._idle(stop)
                # Ends often come in bursts: let them land in one pass.
                await asyncio.sleep(0.01)
        finally:
            waker.cancel()
            await self.close()
            await self._release_lease()

    # -- the gateway's `controller` lease ---------------------------------------------------

    async def _take_lease(self, stop: asyncio.Event) -> bool:
        """Waits until this controller holds the gateway's `controller` lease (False: `stop`
        came first). Two controllers following one gateway both launched every rollout."""
        said = 0.0
        while not stop.is_set():
            try:
                lease = await self._claim()
            except GatewayError as error:
                if error.status_code in (401, 403):
                    raise KeyRefused(
                        f"the gateway refuses this controller's key ({error.message}): give the "
                        "controller the gateway's admin key (--api-key or REINS_API_KEY)"
                    ) from error
                log.warning("cannot take the controller lease (%s); retrying", error)
                await self._pause(stop, 2.0)
                continue
            if lease is None or lease.granted:  # None: a gateway older than leases
                if said:
                    log.warning("this controller now holds the gateway's controller lease")
                return True
            if time.monotonic() - said > 60:
                said = time.monotonic()
                log.warning(
                    "another controller follows this gateway (%s, since %s, its lease until "
                    "%s): this one waits until that lease ends (one controller per gateway: two "
                    "would launch every rollout twice)",
                    lease.holder, _when(lease.since), _when(lease.expires_at),
                )  # fmt: skip
            await self._pause(stop, min(5.0, self.lease_ttl_s / 3))
        return False

    async def _idle(self, stop: asyncio.Event) -> None:
        """Waits for a wake-up or `poll_interval_s`, renewing the lease meanwhile: a poll
        interval longer than the lease's TTL let the lease lapse between two passes."""
        deadline = time.monotonic() + self.poll_interval_s
        while not self._wake.is_set() and not stop.is_set():
            wait = deadline - time.monotonic()
            if self._lease_renewed is not None:
                wait = min(wait, self._lease_renewed + self.lease_ttl_s / 3 - time.monotonic())
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
            if time.monotonic() >= deadline:
                return
            try:
                await self._renew_lease()
            except GatewayError:
                return  # the pass says so, and retries with backoff

    async def _pause(self, stop: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)

    async def _claim(self) -> Lease | None:
        """The lease as claimed; None from a gateway older than leases (nothing to hold)."""
        sent = time.monotonic()
        try:
            lease = await self.client.claim_lease(
                CONTROLLER_LEASE, self.reconciler.lease_holder, self.lease_ttl_s
            )
        except GatewayError as error:
            if error.status_code in (404, 405):
                self._lease_renewed = self._lease_until = self._lease_since = None
                self._lease_fence = None
                return None
            raise
        if lease.granted:
            if self._lease_since is not None and lease.since != self._lease_since:
                self._lease_changed_hands(lease)
            self._lease_renewed = time.monotonic()
            self._lease_until = sent + self.lease_ttl_s
            self._lease_since = lease.since
            self._lease_fence = LeaseFence.of(lease)
            self._fence_refused = False
        return lease

    def _lease_changed_hands(self, lease: Lease) -> None:
        """The lease lapsed unnoticed (this controller paused) and another controller held it
        meanwhile: what this one knew of the rollouts may be stale, so it reads them all again
        before acting (its agents are then kept, adopted or stopped as they stand)."""
        log.warning(
            "this controller's lease lapsed unnoticed (held since %s, again since %s): another "
            "controller may have run rollouts meanwhile, so this one reads every rollout again "
            "before it acts",
            _when(self._lease_since or 0.0), _when(lease.since),
        )  # fmt: skip
        self._lease_epoch += 1
        self._forget_view()
        self._wake.set()

    def _check_lease(self) -> None:
        """Raises `LeaseLapsed` when the lease may have ended, or changed hands since the
        action was decided: the action then does nothing more."""
        if self._lease_until is not None and time.monotonic() >= self._lease_until:
            self._wake.set()  # the next pass renews the lease (or stops), then looks again
            raise LeaseLapsed("this controller's lease lapsed: waiting for its renewal")
        epoch = _ACTION_LEASE_EPOCH.get()
        if epoch is not None and epoch != self._lease_epoch:
            raise LeaseLapsed("the lease changed hands since this action was decided")

    async def _renew_lease(self) -> None:
        renewed = self._lease_renewed
        if renewed is None:
            return
        now = time.monotonic()
        lapsed = self._lease_until is not None and now >= self._lease_until
        if now - renewed < self.lease_ttl_s / 3 and not lapsed:
            return
        lease = await self._claim()
        if lease is not None and not lease.granted:
            self._lease_until = 0.0  # lapsed: in-flight actions do nothing as it stops
            raise LeaseLost(
                f"another controller ({lease.holder}) took the gateway's controller lease: this "
                f"one did not renew it within {self.lease_ttl_s:g} s; it stops (its agents too)"
            )

    async def _release_lease(self) -> None:
        if self._lease_renewed is None:
            return
        fence = self._lease_fence
        self._lease_renewed = self._lease_until = self._lease_since = self._lease_fence = None
        with contextlib.suppress(GatewayError):
            await self.client.release_lease(
                CONTROLLER_LEASE, self.reconciler.lease_holder, fence.token if fence else None
            )

    # -- writes, under the lease ------------------------------------------------------------

    async def _under_lease(self, fence: LeaseFence, write: Coroutine[Any, Any, _T]) -> _T:
        """`write`, made under `fence`, which the gateway refuses (`LeaseNotHeld`) once the
        lease is not this controller's: it lapsed, or changed hands, since the grant. The
        controller then acts no more until it has renewed the lease (and stops, if another
        controller holds it)."""
        try:
            return await write
        except LeaseNotHeld as error:
            if fence == self._lease_fence:  # not a write under a grant renewed since
                if not self._fence_refused:
                    self._fence_refused = True
                    log.warning(
                        "the gateway refused this controller's write: %s; it acts no more "
                        "until it has renewed its lease",
                        error.message,
                    )
                self._lease_until = 0.0  # every action stops at its next lease check
                self._wake.set()  # the next pass renews the lease first
            raise LeaseLapsed(error.message) from None

    async def _open_attempt(
        self, rollout_id: str, attempt_id: int, reason: str | None = None
    ) -> Attempt:
        fence = self._lease_fence
        if fence is None:
            return await self.client.open_attempt(rollout_id, attempt_id=attempt_id, reason=reason)
        return await self._under_lease(
            fence, self.client.open_attempt_under(fence, rollout_id, attempt_id, reason)
        )

    async def _set_status(
        self, rollout_id: str, state: Literal["succeeded", "failed"], reason: str | None = None
    ) -> Rollout:
        fence = self._lease_fence
        if fence is None:
            return await self.client.set_status(rollout_id, state, reason=reason)
        return await self._under_lease(
            fence, self.client.set_status_under(fence, rollout_id, state, reason)
        )

    async def _post_event(
        self, rollout_id: str, attempt_id: int, type: str, data: dict[str, Any]
    ) -> None:
        """The attempt's `agent_launch` or `agent_log` (one each: its type is its key)."""
        fence = self._lease_fence
        if fence is None:
            await self.client.post_event(rollout_id, attempt_id, type, data, idempotency_key=type)
        else:
            await self._under_lease(
                fence, self.client.post_event_under(fence, rollout_id, attempt_id, type, data, type)
            )

    async def close(self, drain_s: float = 10.0) -> None:
        """Lets in-flight actions finish (up to `drain_s`, so a launch is not left without its
        `agent_launch` event), then closes the reconciler (local agents are killed)."""
        tasks = list(self._busy.values())
        if tasks:
            await asyncio.wait(tasks, timeout=drain_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._busy.clear()
        if self._started:
            self._started = False
            await self.reconciler.close()

    async def _wake_on(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._wake.set()

    def _wake_threadsafe(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    # -- one pass ---------------------------------------------------------------------------

    async def reconcile_once(self) -> None:
        """Reads the gateway's changes, then schedules what each rollout needs."""
        await self.start()
        await self._refresh()
        self.stats.passes += 1
        if self._lease_until is not None and time.monotonic() >= self._lease_until:
            # The read outlasted the lease: renew it before acting on the read, which is
            # forgotten (and the pass ends) if the lease changed hands meanwhile.
            await self._renew_lease()
            if self._cursor is None:
                return
        now = time.monotonic()

        # Executions the gateway no longer wants: their rollout is terminal, or a later attempt
        # superseded them.
        for key in list(self.reconciler.executions()):
            rollout_id, attempt_id = key
            if rollout_id in self._busy:
                continue
            rollout = self._active.get(rollout_id)
            if (
                rollout is None
                or attempt_id < self._attempt_of(rollout)
                or self.reconciler.incarnation(key) not in (None, _incarnation(rollout))
            ):
                self._spawn(rollout_id, self._remove(key), slot=False)

        running = [r for r in self._active.values() if self._attempt_of(r) > 0]
        queuing = [r for r in self._active.values() if self._attempt_of(r) == 0]
        for rollout in sorted(running, key=lambda r: r.change_seq):
            rollout_id = rollout.rollout_id
            if rollout_id in self._busy or self._backing_off(rollout_id, now):
                continue
            key = (rollout_id, self._attempt_of(rollout))
            state = self.reconciler.state(key)
            if state == RUNNING:
                continue
            if isinstance(state, Ended):
                retry = state.outcome == "stopped" or (
                    state.outcome != "succeeded" and key[1] < self._max_attempts(rollout)
                )
                if retry and not self._slot_free():
                    continue
                self._spawn(rollout_id, self._finish(rollout, key[1], state), slot=retry)
            else:
                # Unknown here: launched by a previous controller, or opened and never launched.
                if not self._slot_free():
                    continue
                self._spawn(rollout_id, self._recover(rollout, key[1]), slot=True)

        for rollout in sorted(queuing, key=lambda r: r.change_seq):
            if not self._slot_free():
                break
            rollout_id = rollout.rollout_id
            if rollout_id in self._busy or self._backing_off(rollout_id, now):
                continue
            self._spawn(rollout_id, self._start(rollout), slot=True)

    async def wait_idle(self) -> None:
        """Waits until no action is in flight (tests, benchmarks)."""
        while self._busy:
            await asyncio.gather(*list(self._busy.values()), return_exceptions=True)

    @property
    def active(self) -> Mapping[str, Rollout]:
        """Queuing and running rollouts, as last read from the gateway."""
        return self._active

    async def _refresh(self) -> None:
        # Without a cursor (the first pass, or the gateway's database changed): every active
        # rollout, then every change after the head it was read at.
        reading_active = self._cursor is None
        cursor = self._cursor or 0
        while True:
            page = await self.client.list_rollouts(
                states=("queuing", "running") if reading_active else (), cursor=cursor, limit=1000
            )
            went_back = page.next_cursor < cursor  # an older copy of the same database
            if page.database_id != self._database_id or went_back:
                self._forget_database(page.database_id, went_back)
                if not (reading_active and cursor == 0):
                    # The cursor counts the old database's changes: read the new one from 0.
                    reading_active, cursor = True, 0
                    continue
            for rollout in page.items:
                self._observe(rollout)
            cursor = page.next_cursor
            if not reading_active:
                self._cursor = cursor
            if len(page.items) < 1000:
                self._cursor = cursor
                return

    def _forget_database(self, database_id: str | None, went_back: bool = False) -> None:
        """What this controller knows of the gateway's rollouts holds for one database as it
        is: another one (a gateway restarted on a fresh SQLite file) may reuse rollout ids and
        counts its changes from 1, and an older copy of it (restored from a backup) has its
        rollouts in earlier states and counts its changes again from where the copy ends."""
        if went_back:
            log.warning(
                "the gateway's database went back to an older copy (its changes end before the "
                "controller's cursor): reading its rollouts from the start"
            )
        elif self._database_id is not None:
            log.warning(
                "the gateway's database changed (%s, was %s): reading its rollouts from the start",
                database_id,
                self._database_id,
            )
        self._database_id = database_id
        self._forget_view()

    def _forget_view(self) -> None:
        """Forgets what was read of the gateway's rollouts: the next pass reads them all."""
        self._cursor = None
        self._active.clear()
        self._opened.clear()
        self._recorded.clear()
        self._backoff.clear()

    def _observe(self, rollout: Rollout) -> None:
        known = self._active.get(rollout.rollout_id)
        if known is not None and known.change_seq > rollout.change_seq:
            return  # an older read than what an action already saw
        if rollout.status.state in TERMINAL_STATES:
            self._active.pop(rollout.rollout_id, None)
            self._opened.pop(rollout.rollout_id, None)
            self._backoff.pop(rollout.rollout_id, None)
        else:
            self._active[rollout.rollout_id] = rollout

    def _attempt_of(self, rollout: Rollout) -> int:
        """The rollout's live attempt; an attempt this controller opened counts before the
        cursor has brought the change back."""
        return max(rollout.attempt_count, self._opened.get(rollout.rollout_id, 0))

    def _max_attempts(self, rollout: Rollout) -> int:
        return rollout.config.max_attempts or self.max_attempts

    def _slot_free(self) -> bool:
        return self.reconciler.free_slots() - self._reserved > 0

    def _backing_off(self, rollout_id: str, now: float) -> bool:
        until = self._backoff.get(rollout_id)
        return until is not None and now < until[0]

    def _spawn(self, rollout_id: str, action: Coroutine[Any, Any, None], *, slot: bool) -> None:
        if slot:
            self._reserved += 1
        task = asyncio.create_task(
            self._guard(rollout_id, action, slot=slot, lease_epoch=self._lease_epoch)
        )
        self._busy[rollout_id] = task

    async def _guard(
        self,
        rollout_id: str,
        action: Coroutine[Any, Any, None],
        *,
        slot: bool,
        lease_epoch: int,
    ) -> None:
        _ACTION_LEASE_EPOCH.set(lease_epoch)  # this task's own context
        try:
            await action
            self._backoff.pop(rollout_id, None)
        except asyncio.CancelledError:
            raise
        except LeaseLapsed:
            pass  # no fault of the rollout's: the next pass, under a renewed lease, decides
        except Exception as error:
            # The next pass looks at this rollout again; back off so a persistent error (the
            # gateway refusing, the cluster down) is not retried in a tight loop.
            self.stats.errors += 1
            delay = min(30.0, 2 * self._backoff.get(rollout_id, (0.0, 0.5))[1])
            self._backoff[rollout_id] = (time.monotonic() + delay, delay)
            if isinstance(error, GatewayError) and error.status_code == 409:
                log.info("rollout %s changed meanwhile: %s", rollout_id, error.message)
            else:
                log.warning("rollout %s: %s; retrying in %.1f s", rollout_id, error, delay)
            self._wake.set()  # its reserved slot is free again
        finally:
            if slot:
                self._reserved -= 1
            self._busy.pop(rollout_id, None)

    # -- actions ----------------------------------------------------------------------------

    async def _start(self, rollout: Rollout) -> None:
        """Opens the rollout's first attempt and launches its agent."""
        self._check_lease()
        attempt = await self._open_attempt(rollout.rollout_id, rollout.attempt_count + 1)
        self._opened[rollout.rollout_id] = attempt.attempt_id
        if self.reconciler.state((rollout.rollout_id, attempt.attempt_id)) is not None:
            return  # a stale read: this attempt is launched already
        if attempt.state != "running":
            return  # the cursor will bring the rollout's real state
        await self._launch(rollout, attempt)
        if attempt.attempt_id == 1:
            self.stats.launch_latency_s.append(
                max(0.0, time.time() - rollout.created_at.timestamp())
            )

    async def _recover(self, rollout: Rollout, attempt_id: int) -> None:
        """A running rollout whose live attempt this controller does not know."""
        self._check_lease()
        key = (rollout.rollout_id, attempt_id)
        found = await self.reconciler.find(key, _incarnation(rollout))
        if found == RUNNING:
            self.stats.adopted += 1
            log.info("adopted the agent of rollout %s attempt %d", *key)
            return
        if isinstance(found, Ended):
            await self._finish(rollout, attempt_id, found)
            return
        launches = await self.client.get_events(
            rollout.rollout_id, attempt_id=attempt_id, types=[AGENT_LAUNCH]
        )
        if launches:
            where = launches[-1].data.get("where", "?")
            ended = Ended("lost", None, f"is gone without a trace (it ran as {where})")
            self._recorded.add(key)
            await self._finish(rollout, attempt_id, ended)
            return
        # Opened but never launched (a controller stopped in between): launch it now.
        detail = await self.client.get_rollout(rollout.rollout_id)
        attempt = next((a for a in detail.attempts if a.attempt_id == attempt_id), None)
        if attempt is None or attempt.state != "running":
            return
        await self._launch(detail.rollout, attempt)

    async def _finish(self, rollout: Rollout, attempt_id: int, ended: Ended) -> None:
        """Reports an ended attempt: its log, then success, a new attempt, or failure."""
        self._check_lease()
        rollout_id = rollout.rollout_id
        key = (rollout_id, attempt_id)
        agent_log = await self.reconciler.agent_log(key)
        if key not in self._recorded:
            # Launched by a controller that stopped before it could record the launch, maybe.
            await self._record_launch(rollout, attempt_id, f"adopted; log {agent_log.path}")
        try:
            await self._post_event(
                rollout_id,
                attempt_id,
                AGENT_LOG,
                {
                    "outcome": ended.outcome,
                    "exit_code": ended.exit_code,
                    "path": agent_log.path,
                    "tail": agent_log.tail,
                },
            )
        except GatewayError as error:
            if error.status_code != 409:  # 409: an earlier report of this end stored it already
                raise
        max_attempts = self._max_attempts(rollout)
        if ended.outcome == "succeeded":
            self._observe(await self._set_status(rollout_id, "succeeded"))
            self.stats.succeeded += 1
        else:
            if ended.outcome == "lost":
                self.stats.lost += 1
            if attempt_id >= max_attempts:
                max_attempts += await self._stopped_attempts(rollout_id)
            reason = f"attempt {attempt_id} of {max_attempts}: the agent {ended.detail}"
            if agent_log.path:
                reason += f" (log: {agent_log.path})"
            if attempt_id < max_attempts:
                attempt = await self._open_attempt(rollout_id, attempt_id + 1, reason=reason)
                self._opened[rollout_id] = attempt.attempt_id
                self.stats.retried += 1
                log.info("rollout %s: %s; retrying", rollout_id, reason)
                await self.reconciler.remove(key)
                if attempt.state == "running":
                    await self._launch(rollout, attempt)
                return
            self._observe(await self._set_status(rollout_id, "failed", reason=reason))
            self.stats.failed += 1
            log.info("rollout %s failed: %s", rollout_id, reason)
        await self.reconciler.remove(key)

    async def _stopped_attempts(self, rollout_id: str) -> int:
        """How many of the rollout's attempts a controller's shutdown stopped (read only when
        the budget of attempts is spent: not on every failure)."""
        reports = await self.client.get_events(rollout_id, all_attempts=True, types=[AGENT_LOG])
        return len({e.attempt_id for e in reports if e.data.get("outcome") == "stopped"})

    async def _launch(self, rollout: Rollout, attempt: Attempt) -> None:
        # Again here: the action's gateway calls before may have outlasted the lease (a gateway
        # down, retried for minutes), and a second agent in one attempt is what it guards.
        self._check_lease()
        timeout_s = rollout.config.timeout_s or self.default_timeout_s
        try:
            launch = Launch(
                rollout_id=rollout.rollout_id,
                attempt_id=attempt.attempt_id,
                agent=rollout.config.agent,
                env=agent_env(self.gateway_url, rollout, attempt),
                timeout_s=timeout_s,
                incarnation=_incarnation(rollout),
            )
            where = await self.reconciler.launch(launch)
        except LaunchError as error:
            reason = f"cannot launch the agent of attempt {attempt.attempt_id}: {error}"
            log.warning("rollout %s failed: %s", rollout.rollout_id, reason)
            self._observe(await self._set_status(rollout.rollout_id, "failed", reason=reason))
            self.stats.failed += 1
            return
        self.stats.launched += 1
        await self._record_launch(rollout, attempt.attempt_id, where)

    async def _record_launch(self, rollout: Rollout, attempt_id: int, where: str) -> None:
        """The attempt's `agent_launch` event; one per attempt (a fixed idempotency key)."""
        try:
            await self._post_event(
                rollout.rollout_id,
                attempt_id,
                AGENT_LAUNCH,
                {
                    "runner": self.reconciler.runner,
                    "where": where,
                    "timeout_s": rollout.config.timeout_s or self.default_timeout_s,
                },
            )
        except GatewayError as error:
            if error.status_code != 409:  # 409: recorded already, by the controller that launched
                raise
        self._recorded.add((rollout.rollout_id, attempt_id))

    async def _remove(self, key: Key) -> None:
        self._check_lease()
        await self.reconciler.remove(key)
        self.stats.removed += 1


def _incarnation(rollout: Rollout) -> str:
    return rollout.created_at.isoformat()
