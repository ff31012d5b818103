"""The Customized Trainer's loop (paper 3, 3.1, appendix A.3): declare rollouts, wait for them,
read their events, build samples with `reins.samples`, update the policy, publish the weights.

- `sync`: each step declares `tasks_per_step` groups and waits for all of them.
- `async` (collocated): groups are kept running; as soon as `tasks_per_step` whole groups have
  finished, the gateway is paused and drained, the policy updated and published, and the gateway
  resumed. Rollouts still running go on under the new weights; each call records the version that
  served it, and a group with a call older than `max_staleness` versions is dropped.

The trainer talks to the gateway only through `GatewayClient` (HTTP). Completions are read in the
order the gateway reached them (its change cursor).

A step is committed in this order: the update (the version to be served is recorded in
`versions.json` first), the checkpoint when due (it holds the step's metrics record), then the
metrics line. Staleness is counted along the run's weight lineage, so a call served by weights a
crash discarded is never trained on (see `reins.trainer.resume`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from reins.client import DatabaseChanged, GatewayClient, GatewayError, check_database
from reins.recordbatch import DecodedRollout, record_of
from reins.samples.batch import AdapterConfig, Batch, build_batch
from reins.samples.records import MissingRewardError, RolloutRecord
from reins.schemas import Identifier, Mode, Rollout, RolloutConfig, RolloutSpec, RolloutState
from reins.trainer import checkpoint
from reins.trainer.backend import Backend, StepStats
from reins.trainer.config import TrainConfig
from reins.trainer.data import Task, TaskStream
from reins.trainer.memory import peak_gpu_mb, peak_rss_mb
from reins.trainer.metrics import MetricsLog
from reins.trainer.publish import WeightPublisher
from reins.trainer.resume import VersionLedger, setup_of
from reins.trainer.staleness import (
    certain_drop,
    rollout_staleness,
    spans_update,
    version_lags,
)

log = logging.getLogger(__name__)

TERMINAL: tuple[RolloutState, ...] = ("succeeded", "failed")

ID_LIMIT: int = typing.get_args(Identifier)[1].max_length
"""The longest rollout or group id the gateway takes."""


def fitted_id(head: str, task_id: str, tail: str = "", *, reserve: int = 0) -> str:
    """`head + task_id + tail`, with room for `reserve` more characters under `ID_LIMIT`: a
    task id too long for that is cut, and a digest of the whole id is put in its place's end,
    so that ids stay distinct and the same for the same task (a retried declare). Task ids
    may be any length: a long one made every declare of the run fail, after the model had
    loaded, or only once a resume added its incarnation to the ids."""
    whole = head + task_id + tail
    if len(whole) + reserve <= ID_LIMIT:
        return whole
    digest = "-" + hashlib.sha256(task_id.encode()).hexdigest()[:16]
    room = max(ID_LIMIT - reserve - len(head) - len(tail) - len(digest), 0)
    return head + task_id[:room] + digest + tail


def _moved_weights(stats: StepStats) -> bool:
    """A step with no optimizer step changed no weight: no new version (`StepStats`)."""
    return stats.optimizer_steps > 0


class Reporter(Protocol):
    """What the console (or a test) is told as the run goes."""

    def phase(self, step: int, name: str) -> None: ...

    def rollouts(self, done: int, total: int) -> None: ...

    def step_done(self, record: dict[str, Any]) -> None: ...


class QuietReporter:
    def phase(self, step: int, name: str) -> None:
        log.info("step %d: %s", step, name)

    def rollouts(self, done: int, total: int) -> None:
        pass

    def step_done(self, record: dict[str, Any]) -> None:
        log.info("step %s: %s", record.get("step"), record)


class CompletionWatch:
    """Follows the gateway's change cursor and remembers the rollouts that reached a terminal
    state, in the order they reached it."""

    def __init__(self, client: GatewayClient, poll_s: float = 0.2) -> None:
        self.client = client
        self.poll_s = poll_s
        self.finished: dict[str, Rollout] = {}
        self.order: list[str] = []
        self.seen_at: dict[str, float] = {}
        """When (monotonic) each rollout was first seen finished: its finishing time, to the
        cursor's polling (a page follows another at once; an empty one waits `poll_s`)."""
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lost: DatabaseChanged | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self) -> None:
        cursor, database = 0, None
        while True:
            try:
                page = await self.client.list_rollouts(states=TERMINAL, cursor=cursor, limit=1000)
            except GatewayError as error:
                log.warning("cannot follow rollouts (%s); retrying", error)
                await asyncio.sleep(1.0)
                continue
            try:
                database = check_database(database, cursor, page)
            except DatabaseChanged as error:
                # The run's rollouts are gone with the old database: waiting for them would
                # never end. `changed` raises it in the run.
                self._lost = error
                self._changed.set()
                return
            now = time.monotonic()
            for rollout in page.items:
                if rollout.rollout_id not in self.finished:
                    self.order.append(rollout.rollout_id)
                    self.seen_at[rollout.rollout_id] = now
                self.finished[rollout.rollout_id] = rollout
            cursor = page.next_cursor
            if page.items:
                self._changed.set()
            else:
                await asyncio.sleep(self.poll_s)

    async def changed(self, timeout_s: float) -> None:
        """Returns when something finished, or after `timeout_s`; raises `DatabaseChanged` once
        the gateway is on another database."""
        if self._lost is not None:
            raise self._lost
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        if self._lost is not None:
            raise self._lost


def rollout_tail(finished_at: Sequence[float]) -> float:
    """Seconds from the median rollout finishing to the last: what a sync step waits on its
    slowest rollouts while the engine has less and less to do, about what collocated async
    (which updates once enough groups are done) can save a step."""
    if len(finished_at) < 2:
        return 0.0
    return float(max(finished_at) - np.median(finished_at))


@dataclass
class Group:
    """One task's rollouts, declared together."""

    group_id: str
    task: Task
    rollout_ids: list[str]
    declared_version: int
    position: int = -1
    """The task's position in the training stream (-1 for validation)."""
    declared_at: float = field(default_factory=time.monotonic)


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        client: GatewayClient,
        backend: Backend,
        publisher: WeightPublisher,
        *,
        train_tasks: TaskStream,
        val_tasks: Sequence[Task] = (),
        decode: Callable[[Any], str] | None = None,
        reporter: Reporter | None = None,
        metrics: MetricsLog | None = None,
        on_update: Callable[[], Any] | None = None,
        on_publish: Callable[[int], Awaitable[Any]] | None = None,
        incarnation: int = 0,
        lineage: Sequence[int] = (),
        pending: Sequence[int] = (),
        versions: VersionLedger | None = None,
        policy_model: str | None = None,
    ) -> None:
        self.config = config
        self.policy_model = policy_model
        """The name the policy is registered under at the gateway: the calls another model
        served (a judge the harness calls on its own engine) are not read as the policy's
        (None: every call is)."""
        self.client = client
        self.backend = backend
        self.publisher = publisher
        self.train_tasks = train_tasks
        self.val_tasks = list(val_tasks)
        self.decode = decode
        self.reporter = reporter or QuietReporter()
        self.metrics = metrics or MetricsLog(config.run_dir, tensorboard=config.tensorboard)
        self.on_update = on_update
        self.on_publish = on_publish
        """Awaited with the new version once every engine serves it, before calls resume (the
        runtime registers it at the gateway, which records it for engines that do not say)."""
        self.adapter = AdapterConfig(
            estimator=config.estimator,
            normalize_std=config.normalize_std,
            advantage_level=config.advantage_level,
            loss_aggregation=config.loss_aggregation,
            num_minibatches=config.num_minibatches,
            max_tokens_per_microbatch=config.max_tokens_per_microbatch,
            dp_size=getattr(backend, "world_size", 1),
        )
        self.watch = CompletionWatch(client)
        self.last_val: float | None = None
        self.last_val_metrics: dict[str, float] = {}
        """The agents' own metrics of the last validation, as `val/agent/<name>` means."""
        self.incarnation = incarnation
        """How many times this run was resumed: it is part of every rollout id it declares, so a
        resumed run never picks up a rollout an earlier incarnation declared."""
        self.lineage = list(lineage) or [publisher.version]
        """The weight versions this run's weights went through, in order."""
        self.pending = list(pending)
        """Stream positions of groups an earlier incarnation declared and did not train."""
        self.versions = versions
        self._generated = self._trained = 0
        """Rollouts finished and read by this process's updates, and those trained: their ratio
        is the work async drops (stale or failed groups)."""
        self._running: list[Group] = []
        self._checked_version: int | None = None
        """The weight version at which the running groups' staleness was last checked."""
        self._cancelled: set[str] = set()
        """Rollouts this trainer failed because their group could no longer be trained."""
        self._given_up = _GivenUp()
        self._agent_ran = False
        """Whether a rollout of this process's has succeeded (its agent can run)."""

    # -- the run ---------------------------------------------------------------------------

    async def run(
        self, start_step: int = 0, *, final_validation: bool = True
    ) -> list[dict[str, Any]]:
        """Makes steps `start_step .. config.steps - 1`, then validates the final weights (unless
        `final_validation` is False: done already); returns the steps' metrics records."""
        self.watch.start()
        # The gate is this trainer's: a trainer that died during an update left it paused.
        await self.client.request("POST", "/api/admission/resume")
        records: list[dict[str, Any]] = []
        try:
            if self.config.mode == "sync":
                records = await self._run_sync(start_step)
            else:
                records = await self._run_async(start_step)
            if final_validation:
                await self._final_validation()
        finally:
            await self.watch.stop()
        return records

    async def _run_sync(self, start_step: int) -> list[dict[str, Any]]:
        records = []
        for step in range(start_step, self.config.steps):
            val = await self._maybe_validate(step)
            started = time.monotonic()
            self.reporter.phase(step, "rollouts")
            # Tasks an async incarnation declared and never trained come first (a run may be
            # resumed in the other mode); the checkpoint keeps those not declared yet.
            count = self.config.tasks_per_step
            left, self.pending = self.pending[:count], self.pending[count:]
            tasks = self.train_tasks.at(left) + self.train_tasks.take(count - len(left))
            groups = await self._declare(tasks)
            finished = await self._wait_groups(groups, need=len(groups))
            rollout_s = time.monotonic() - started
            record = await self._update(step, finished, val, timings={"time/rollout": rollout_s})
            record["time/step"] = time.monotonic() - started
            records.append(self._finish_step(step, record))
        return records

    async def _run_async(self, start_step: int) -> list[dict[str, Any]]:
        records = []
        # Groups an earlier incarnation declared and never trained: declared again, first.
        running = self._running = (
            await self._declare(self.train_tasks.at(self.pending)) if self.pending else []
        )
        self.pending = []
        for step in range(start_step, self.config.steps):
            val = await self._maybe_validate(step)
            started = time.monotonic()
            self.reporter.phase(step, "rollouts")
            running = self._running = running + await self._declare_room(running, step)

            async def prune(groups: list[Group], step: int = step) -> list[Group]:
                return await self._prune(groups, step)

            ready = await self._wait_groups(running, need=self.config.tasks_per_step, prune=prune)
            running = self._running = [g for g in self._running if g not in ready]
            rollout_s = time.monotonic() - started
            self.reporter.phase(step, "drain")
            drained_at = time.monotonic()
            await self.client.request("POST", "/api/admission/pause")
            drain = await self.client.request(
                "POST", "/api/admission/drain", params={"timeout_s": self.config.drain_timeout_s}
            )
            wait_s = time.monotonic() - drained_at
            try:
                record = await self._update(
                    step,
                    ready,
                    val,
                    timings={"time/rollout": rollout_s, "time/wait": wait_s},
                )
            finally:
                await self.client.request("POST", "/api/admission/resume")
            if not drain.get("drained", True):
                record["gateway/drain_timed_out"] = 1
            record["time/step"] = time.monotonic() - started
            records.append(self._finish_step(step, record))
        return records

    async def _declare_room(self, running: list[Group], step: int) -> list[Group]:
        """New groups for the room left: rollouts start at most `max_staleness` updates ahead
        of the one that trains them, and no more are declared than the run's steps from `step`
        on will train."""
        per_step = self.config.tasks_per_step
        capacity = per_step * (self.config.max_staleness + 1)
        room = min(capacity, (self.config.steps - step) * per_step) - len(running)
        return await self._declare(self.train_tasks.take(room)) if room > 0 else []

    async def _prune(self, groups: list[Group], step: int) -> list[Group]:
        """`async`: stops the work that can no longer be trained. A group certain to be
        dropped for its staleness (or for a rollout that spanned an update, with
        `spanning_rollouts: drop`) is given up, its unfinished rollouts failed by the trainer,
        and a fresh group declared in its place, so that an update trains `tasks_per_step`
        groups rather than fewer. A group with a failed rollout (`failed_rollouts:
        drop_group`) has its other unfinished rollouts failed too; it stays, as in `sync`, to
        be taken and dropped in its turn. Staleness changes only with the weights, so the
        gateway is asked once per version (`POST /api/rollouts/stats`: the versions that
        served each rollout's calls so far, of its latest attempt: a running attempt already
        too stale is given up although a crash and a retry would have started it afresh)."""
        if self.config.failed_rollouts == "drop_group":
            for group in groups:
                if any(self._failed_on_its_own(rid) for rid in group.rollout_ids):
                    await self._cancel(group, "another rollout of its group failed")
        version = self.publisher.version
        if version == self._checked_version:
            return groups
        try:
            stats = await self.client.rollout_stats(
                [r for g in groups for r in g.rollout_ids], model=self.policy_model
            )
        except GatewayError as error:
            if error.status_code != 404:
                raise
            # Its rollouts are gone: the gateway is on another database, which the completion
            # watch reports (`DatabaseChanged`) with what to do.
            log.warning("cannot check the running groups' staleness: %s", error)
            return groups
        self._checked_version = version
        given_up: list[Group] = []
        for group in groups:
            reason = certain_drop(
                [(stats[r].min_version, stats[r].max_version) for r in group.rollout_ids],
                version,
                self.lineage,
                max_staleness=self.config.max_staleness,
                drop_stale=self.config.stale_groups == "drop",
                drop_spanning=self.config.spanning_rollouts == "drop",
            )
            if reason is not None:
                given_up.append(group)
                await self._cancel(group, f"its group can no longer be trained: {reason}")
        if not given_up:
            return groups
        kept = self._running = [g for g in groups if g not in given_up]
        for group in given_up:
            self._given_up.groups += 1
            self._given_up.finished += sum(self._finished_on_its_own(r) for r in group.rollout_ids)
            self._given_up.failed += sum(self._failed_on_its_own(r) for r in group.rollout_ids)
        kept += await self._declare_room(kept, step)
        self._running = kept
        return kept

    def _finished_on_its_own(self, rollout_id: str) -> bool:
        return rollout_id in self.watch.finished and rollout_id not in self._cancelled

    def _failed_on_its_own(self, rollout_id: str) -> bool:
        rollout = self.watch.finished.get(rollout_id)
        return (
            rollout is not None
            and rollout.status.state == "failed"
            and rollout_id not in self._cancelled
        )

    async def _cancel(self, group: Group, reason: str) -> None:
        """`_fail_unfinished`, counted as `rollouts/cancelled` rather than as failed."""
        failed = await self._fail_unfinished(group, f"trainer: {reason}")
        self._cancelled.update(failed)
        self._given_up.cancelled += len(failed)

    async def _fail_unfinished(self, group: Group, reason: str) -> list[str]:
        """Fails the group's unfinished rollouts (the controller stops their agents); returns
        those it failed."""
        failed = []
        for rollout_id in group.rollout_ids:
            if rollout_id in self.watch.finished or rollout_id in self._cancelled:
                continue
            try:
                await self.client.set_status(rollout_id, "failed", reason)
            except GatewayError as error:
                if error.status_code != 409:  # 409: it finished meanwhile
                    raise
                continue
            failed.append(rollout_id)
        return failed

    def _finish_step(self, step: int, record: dict[str, Any]) -> dict[str, Any]:
        """Commits a step: its checkpoint when due (holding its metrics line), then the line."""
        line = self.metrics.prepare(step, record)
        every = self.config.checkpoint_every
        if (every and (step + 1) % every == 0) or step + 1 == self.config.steps:
            self.save_checkpoint(step + 1, line)
        self.metrics.append(line)
        self.reporter.step_done(line)
        return line

    def save_checkpoint(self, next_step: int, record: dict[str, Any] | None = None) -> None:
        state = checkpoint.TrainerState(
            next_step=next_step,
            data_position=self.train_tasks.position,
            weight_version=self.publisher.version,
            rng=checkpoint.capture_rng(),
            lineage=list(self.lineage),
            pending=sorted([*self.pending, *(g.position for g in self._running)]),
            record=record,
            stream=self.train_tasks.identity(),
            setup=setup_of(self.config),
        )
        checkpoint.save(self.config.run_dir, self.backend, state, keep=self.config.keep_checkpoints)

    # -- declaring and waiting -------------------------------------------------------------

    async def _declare(self, tasks: list[tuple[int, Task]]) -> list[Group]:
        """Declares a group per task. Ids derive from the task's stream position, so a resumed run
        declares the same rollouts again if it is retried (the gateway returns them as they are);
        a resumed run's ids carry its incarnation, so they are new rollouts."""
        run = self.config.run_name
        version = self.publisher.version
        groups, specs = [], []
        widest = len(f".{self.config.group_size - 1}")
        for position, task in tasks:
            group_id = fitted_id(f"{run}.t{position:07d}.", task.id, self._suffix, reserve=widest)
            ids = [f"{group_id}.{k}" for k in range(self.config.group_size)]
            groups.append(Group(group_id, task, ids, version, position=position))
            step = position // self.config.tasks_per_step
            specs += [self._spec(rollout_id, group_id, task, "train", step) for rollout_id in ids]
        await self.client.create_rollouts(specs)
        return groups

    @property
    def _suffix(self) -> str:
        return f".r{self.incarnation}" if self.incarnation else ""

    def _spec(
        self, rollout_id: str, group_id: str, task: Task, mode: Mode, step: int
    ) -> RolloutSpec:
        return RolloutSpec(
            rollout_id=rollout_id,
            group_id=group_id,
            input=task.input,
            mode=mode,
            metadata={"run": self.config.run_name, "step": step, "task": task.id},
            config=RolloutConfig(
                timeout_s=self.config.rollout_timeout_s, max_attempts=self.config.max_attempts
            ),
        )

    async def _wait_groups(
        self,
        groups: list[Group],
        *,
        need: int,
        prune: Callable[[list[Group]], Awaitable[list[Group]]] | None = None,
    ) -> list[Group]:
        """The first `need` groups (in completion order) whose rollouts all finished; `prune`,
        when given, is first asked each time for the groups to wait on (`_prune`)."""
        limit = self.config.rollout_timeout_s * self.config.max_attempts + 60.0
        while True:
            if prune is not None:
                groups = await prune(groups)
            if need > len(groups):
                raise RuntimeError(
                    f"the trainer waits for {need} finished groups but only {len(groups)} are "
                    "declared: nothing could ever end this wait (a bug; please report it)"
                )
            total = sum(len(g.rollout_ids) for g in groups)
            done_ids = {rid for g in groups for rid in g.rollout_ids if rid in self.watch.finished}
            self.reporter.rollouts(len(done_ids), total)
            complete = [g for g in groups if all(r in self.watch.finished for r in g.rollout_ids)]
            if len(complete) >= need:
                last = {
                    g.group_id: max(self.watch.order.index(r) for r in g.rollout_ids)
                    for g in complete
                }
                return sorted(complete, key=lambda g: last[g.group_id])[:need]
            now = time.monotonic()
            for group in groups:
                if now - group.declared_at > limit:
                    await self._fail_overdue(group, limit)
            await self.watch.changed(timeout_s=1.0)

    async def _fail_overdue(self, group: Group, limit: float) -> None:
        await self._fail_unfinished(
            group, f"trainer: not finished {limit:.0f} s after it was declared"
        )

    # -- reading and updating --------------------------------------------------------------

    async def _records(
        self, groups: list[Group]
    ) -> tuple[list[RolloutRecord], dict[str, int], list[str], list[float]]:
        """Records of the groups' rollouts, counts of what was dropped and why, the ids of the
        groups whose rollouts are trained, and each trained rollout's staleness."""
        counts = {"failed": 0, "dropped_groups": 0, "stale_groups": 0, "missing_reward": 0}
        counts |= {"spanning": 0, "spanning_groups_dropped": 0, "stale_groups_corrected": 0}
        staleness: list[float] = []
        records: list[RolloutRecord] = []
        trained: list[str] = []
        current = self.publisher.version
        kept: list[tuple[Group, list[Rollout]]] = []
        tally = _Tally()
        for group in groups:
            rollouts = [self.watch.finished[r] for r in group.rollout_ids]
            failed = [r for r in rollouts if r.status.state == "failed"]
            # Those the trainer failed itself (`_prune`) are counted as cancelled, not failed.
            own = [r for r in failed if r.rollout_id not in self._cancelled]
            counts["failed"] += len(own)
            tally.failed += own
            if failed and self.config.failed_rollouts == "drop_group":
                counts["dropped_groups"] += 1
                tally.unread += len(rollouts) - len(failed)
                continue
            kept.append((group, rollouts))
        # One binary read for the step (`reins.recordbatch`), not a JSON read per rollout.
        ids = [rollout.rollout_id for _, rollouts in kept for rollout in rollouts]
        read = {}
        if ids:
            decoded = await self.client.get_records(ids, model=self.policy_model)
            read = dict(zip(ids, decoded, strict=True))
        for group, rollouts in kept:
            # Every rollout is read, so each one without a reward is counted, not only a
            # group's first; one missing drops the group (`_record` says when).
            found = []
            for rollout in rollouts:
                missing = counts["missing_reward"]
                found.append(self._record(rollout, read[rollout.rollout_id], counts))
                if rollout.status.state != "failed":
                    if counts["missing_reward"] > missing:
                        tally.unrewarded.append(rollout)
                    else:
                        tally.rewarded += 1
            group_records = [record for record in found if record is not None]
            if len(group_records) == len(found):
                served = [[call.model_version for call in r.calls] for r in group_records]
                stale = [rollout_staleness(v, current, self.lineage) for v in served]
                spanning = sum(spans_update(v) for v in served)
                # A group goes whole or not at all: its advantages are relative to each other.
                # Sync declares every group on the weights it trains: a call served by other
                # weights (a fleet engine that restarted at version 0) is stale there too.
                bound = self.config.max_staleness if self.config.mode == "async" else 0
                too_stale = max(stale, default=0.0) > bound
                if too_stale and (self.config.stale_groups == "drop" or math.isinf(max(stale))):
                    counts["stale_groups"] += 1
                    continue
                # Counted for the groups the staleness bound let through, kept or dropped here.
                counts["spanning"] += spanning
                if spanning and self.config.spanning_rollouts == "drop":
                    counts["spanning_groups_dropped"] += 1
                    continue
                counts["stale_groups_corrected"] += too_stale
                staleness += stale
                records += group_records
                trained.append(group.group_id)
                continue
            counts["dropped_groups"] += 1
        self._check_agent_runs(tally)
        return records, counts, trained, staleness

    def _check_agent_runs(self, tally: _Tally) -> None:
        """An `AgentCannotRun` when no rollout so far reported a reward: each failed, or ended
        without one. A mistyped command, a crash at start or a forgotten reward would otherwise
        do so in every step, and the run go through all its steps training on nothing."""
        if self._agent_ran:
            return
        if tally.rewarded:
            self._agent_ran = True
        elif not tally.unread and (tally.failed or tally.unrewarded):
            raise AgentCannotRun(self.config.agent, tally.failed, tally.unrewarded)

    def _record(
        self, rollout: Rollout, read: DecodedRollout, counts: dict[str, int]
    ) -> RolloutRecord | None:
        fill = self.config.fill_reward if rollout.status.state == "failed" else None
        try:
            record = record_of(read, group_id=rollout.group_id, missing_reward=fill)
        except MissingRewardError as missing:
            counts["missing_reward"] += 1
            log.warning("%s", missing)
            if self.config.failed_rollouts == "drop_group":
                return None
            record = record_of(
                read, group_id=rollout.group_id, missing_reward=self.config.fill_reward
            )
        if fill is not None:
            record.reward = fill
        return record

    def _waste(self, groups: list[Group], trained: int) -> dict[str, float]:
        """Rollouts generated per rollout trained so far in this process (1.0: nothing lost;
        absent until one is trained)."""
        self._generated += self._given_up.finished + sum(
            rollout_id not in self._cancelled
            for group in groups
            for rollout_id in group.rollout_ids
        )
        self._trained += trained
        if not self._trained:
            return {}
        return {"rollouts/generated_per_trained": self._generated / self._trained}

    async def _update(
        self, step: int, groups: list[Group], val: float | None, *, timings: dict[str, float]
    ) -> dict[str, Any]:
        self.reporter.phase(step, "samples")
        built_at = time.monotonic()
        records, counts, trained, staleness = await self._records(groups)
        batch: Batch | None = None
        if records:
            batch = build_batch(records, self.adapter, decode=self.decode)
        build_s = time.monotonic() - built_at
        self.reporter.phase(step, "update")
        updated_at = time.monotonic()
        stats, publish_s = StepStats(), 0.0
        if batch is not None and batch.sequences:
            if self.versions is not None:
                self.versions.served(self.publisher.version + 1)
            lags = version_lags(self.lineage)
            stats, publish_s = await asyncio.to_thread(
                self.publisher.update,
                lambda: self.backend.train_step(batch, lags),
                _moved_weights,
            )
            if self.versions is not None:
                self.versions.served(self.publisher.version)
            if self.publisher.version != self.lineage[-1]:
                if self.on_publish is not None:
                    await self.on_publish(self.publisher.version)
                self.lineage.append(self.publisher.version)
        update_s = time.monotonic() - updated_at - publish_s
        # Rollouts the update used: those with a sequence to train (a rollout whose every call
        # failed has none), less those the correction left out whole.
        used = len({s.rollout_id for s in batch.sequences}) if batch is not None else 0
        if stats.correction is not None:
            used -= stats.correction.masked_rollouts
        if self.on_update is not None:
            self.on_update()
        seen_at = self.watch.seen_at
        seen = [seen_at[r] for g in groups for r in g.rollout_ids if r in seen_at]
        record: dict[str, Any] = {
            "weight_version": self.publisher.version,
            "rollouts/trained": used,
            "rollouts/failed": counts["failed"] + self._given_up.failed,
            "rollouts/cancelled_groups": self._given_up.groups,
            "rollouts/cancelled": self._given_up.cancelled,
            "rollouts/dropped_groups": counts["dropped_groups"],
            "rollouts/stale_groups": counts["stale_groups"],
            "rollouts/stale_groups_corrected": counts["stale_groups_corrected"],
            "rollouts/spanning": counts["spanning"],
            "rollouts/spanning_groups_dropped": counts["spanning_groups_dropped"],
            "rollouts/staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
            "rollouts/staleness_max": max(staleness, default=0.0),
            "rollouts/missing_reward": counts["missing_reward"],
            "rollouts/groups": trained,
            "time/build": build_s,
            "time/update": update_s,
            "time/publish": publish_s,
            "time/rollout_tail": rollout_tail(seen),
            **timings,
            **self._waste(groups, used),
            "memory/peak_rss_mb": peak_rss_mb(),
        }
        self._given_up = _GivenUp()
        gpu_mb = peak_gpu_mb()
        if gpu_mb is not None:
            record["memory/peak_gpu_mb"] = gpu_mb
        # Over the rollouts trained: one the correction masked whole moved no weight, and its
        # reward (an off-policy outlier, often) would read as the policy's.
        masked = stats.correction.masked_rollout_ids if stats.correction is not None else ()
        rewarded = [r for r in records if r.rollout_id not in masked]
        if rewarded:
            rewards = [r.reward for r in rewarded]
            record["reward/mean"] = float(np.mean(rewards))
            record["reward/std"] = float(np.std(rewards))
        record.update(agent_metric_means(rewarded, "agent/"))
        if val is not None:
            record["val/reward_mean"] = val
            record.update(self.last_val_metrics)
        if batch is not None:
            sample_metrics = batch.metrics
            record["samples/one_sample_rollout_ratio"] = sample_metrics.one_sample_rollout_ratio
            record["samples/per_rollout"] = sample_metrics.samples_per_rollout
            record["samples/split_reasons"] = dict(sample_metrics.split_reasons)
            record["samples/sequences"] = sample_metrics.sequences
            record["samples/empty_rollouts"] = sample_metrics.empty_rollouts
            record["samples/response_tokens"] = sample_metrics.response_tokens
            record["samples/merge_token_saving"] = sample_metrics.merge_token_saving
            record["samples/mixed_version_sequences"] = sample_metrics.mixed_version_sequences
            # Calls left out (retries and unused choices; failed or empty ones; those another
            # registered model served), and sequences
            # past the micro-batch bound (each ran alone): none of these is an error.
            record["samples/dedup_calls"] = sample_metrics.dedup_calls
            record["samples/skipped_calls"] = sample_metrics.skipped_calls
            record["samples/other_model_calls"] = sample_metrics.other_model_calls
            record["samples/oversize_sequences"] = sample_metrics.oversize_sequences
            record.update(stats.as_metrics())
            record["samples/zero_advantage_skipped"] = stats.skipped_sequences
            busy = timings.get("time/rollout", 0.0) + update_s
            record["throughput/tokens_per_s"] = stats.trained_tokens / update_s if update_s else 0.0
            record["throughput/rollout_tokens_per_s"] = (
                sample_metrics.response_tokens / busy if busy else 0.0
            )
        return record

    # -- validation ------------------------------------------------------------------------

    def _validation_due(self, step: int) -> bool:
        every = self.config.val_every
        return bool(self.val_tasks) and every > 0 and step % every == 0

    async def _maybe_validate(self, step: int) -> float | None:
        if not self._validation_due(step):
            return None
        return await self.validate(step)

    async def _final_validation(self) -> None:
        """Validates the final weights (a metrics line of its own, step `steps`)."""
        if not self.val_tasks or self.config.val_every <= 0:
            return
        step = self.config.steps
        val = await self.validate(step)
        self.metrics.write(
            step,
            {
                "val/reward_mean": val,
                **self.last_val_metrics,
                "weight_version": self.publisher.version,
            },
        )
        self.reporter.step_done({"step": step, "val/reward_mean": val})

    async def validate(self, step: int) -> float:
        """Mean reward of the validation tasks (one rollout each, `val` mode); failed count 0."""
        self.reporter.phase(step, "validation")
        version = self.publisher.version
        prefix = f"{self.config.run_name}.val{step:06d}.v{version}{self._suffix}"
        ids = [fitted_id(f"{prefix}.", task.id) for task in self.val_tasks]
        specs = [
            self._spec(rollout_id, rollout_id, task, "val", step)
            for rollout_id, task in zip(ids, self.val_tasks, strict=True)
        ]
        await self.client.create_rollouts(specs)
        groups = [
            Group(spec.group_id or "", task, [spec.rollout_id or ""], version)
            for spec, task in zip(specs, self.val_tasks, strict=True)
        ]
        await self._wait_groups(groups, need=len(groups))
        rewards = []
        records: list[RolloutRecord] = []
        finished = [self.watch.finished[group.rollout_ids[0]] for group in groups]
        tally = _Tally(failed=[r for r in finished if r.status.state != "succeeded"])
        succeeded = [r.rollout_id for r in finished if r.status.state == "succeeded"]
        read = {}
        if succeeded:
            read = dict(zip(succeeded, await self.client.get_records(succeeded), strict=True))
        for rollout in finished:
            if rollout.status.state != "succeeded":
                rewards.append(0.0)
                continue
            try:
                record = record_of(read[rollout.rollout_id])
                rewards.append(record.reward)
                records.append(record)
                tally.rewarded += 1
            except MissingRewardError:
                rewards.append(0.0)
                tally.unrewarded.append(rollout)
        self._check_agent_runs(tally)
        value = float(np.mean(rewards))
        self.last_val = value
        self.last_val_metrics = agent_metric_means(records, "val/agent/")
        return value


@dataclass
class _GivenUp:
    """The groups `_prune` gave up since the last update's metrics line."""

    groups: int = 0
    finished: int = 0
    """Their rollouts that had finished (the work lost)."""
    failed: int = 0
    """Of those, the ones that failed."""
    cancelled: int = 0
    """Rollouts the trainer failed (theirs and those of groups with a failed rollout)."""


@dataclass
class _Tally:
    """How the rollouts of an update or a validation ended, for `_check_agent_runs`."""

    failed: list[Rollout] = field(default_factory=list)
    unrewarded: list[Rollout] = field(default_factory=list)
    """Succeeded without reporting a reward."""
    rewarded: int = 0
    unread: int = 0
    """Not read (their group was dropped for a failed one): whether they have a reward is not
    known."""


class AgentCannotRun(ValueError):
    """No rollout of the run's first step (or validation) reported a reward: each failed, or
    ended without one."""

    def __init__(self, agent: str, failed: list[Rollout], unrewarded: list[Rollout]) -> None:
        total = len(failed) + len(unrewarded)
        if not unrewarded:
            head = f"every rollout so far failed ({total} of {total}, none succeeded)"
        else:
            head = (
                f"no rollout so far reported a reward ({len(unrewarded)} of {total} ended "
                f"without one, {len(failed)} failed)"
            )
        message = (
            f"{head}: the run stops rather than go through its steps training on nothing; "
            f"check the agent setting ({agent!r})"
        )
        if failed:
            first = failed[0]
            reason = first.status.reason or "no reason given"
            message += f" and rollout_timeout_s. Rollout {first.rollout_id}: {reason}"
            tail = _log_tail(reason)
            message += f"; its log ends:\n{tail}" if tail else ""
        else:
            message += (
                ": an agent reports its reward with reins.agent.report_reward (a "
                "`module:function` agent by returning a number). Rollout "
                f"{unrewarded[0].rollout_id} ended without one"
            )
        super().__init__(message)


def _log_tail(reason: str, lines: int = 8) -> str:
    """The last lines of the agent log a failure's reason names, when it is on this machine."""
    path = reason.rpartition("(log: ")[2].removesuffix(")")
    if not path or path == reason:
        return ""
    try:
        with open(path, "rb") as log_file:
            log_file.seek(0, 2)
            log_file.seek(max(0, log_file.tell() - 4096))
            text = log_file.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def agent_metric_means(records: list[RolloutRecord], prefix: str) -> dict[str, float]:
    """Mean of each metric the agents reported with their reward, over the rollouts that
    reported it (`reins.agent.report_reward(metrics=...)`)."""
    values: dict[str, list[float]] = {}
    for record in records:
        for name, value in record.metrics.items():
            values.setdefault(name, []).append(value)
    return {f"{prefix}{name}": float(np.mean(v)) for name, v in sorted(values.items())}
