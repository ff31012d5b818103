"""What `reins train --resume` finds in a run folder, and the bookkeeping that lets a run go on
after a crash (SIGKILL, power loss, Ctrl-C) without training on anything it should not.

Invariants:
- `--resume` goes on from a complete checkpoint or not at all: a missing run folder or a run with
  no checkpoint yet is a `ResumeError` that says what exists; nothing is wiped.
- A weight version number names one set of weights, forever. Before the engine serves version
  `v`, `<run>/versions.json` records `v` (written to a temporary file and renamed). A resumed run
  whose checkpoint is older than the highest version ever recorded serves the loaded weights under
  a new number above it, so no call recorded before the crash carries a number that now names
  other weights.
- Each resume is a new incarnation (counted in the same file). Rollouts an earlier incarnation
  left queuing or running are failed before the controller starts, so none of them runs on
  weights other than those of its step, and no agent is retried for them; the resumed run
  declares its groups again under ids that carry the incarnation (`...r1`), when the trainer
  serves the weights of their step.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reins.client import DatabaseChanged, GatewayClient, GatewayError, check_database
from reins.trainer import checkpoint
from reins.trainer.backend import Backend
from reins.trainer.checkpoint import TrainerState
from reins.trainer.config import TrainConfig
from reins.trainer.metrics import MetricsLog

log = logging.getLogger(__name__)

VERSIONS = "versions.json"


class ResumeError(ValueError):
    """`--resume` cannot go on with this run; the message says what exists and what to do."""


@dataclass(frozen=True)
class ResumePoint:
    folder: Path
    """The checkpoint folder."""
    state: TrainerState
    removed_partial: list[Path]
    """Staging folders of a checkpoint a crash interrupted (deleted)."""


def find(config: TrainConfig) -> ResumePoint:
    """The checkpoint a resume of `config`'s run starts from, or a `ResumeError`."""
    run_dir = config.run_dir
    if not run_dir.is_dir():
        runs = (
            sorted(p.name for p in config.runs_dir.iterdir() if p.is_dir())
            if config.runs_dir.is_dir()
            else []
        )
        listed = ", ".join(runs[:20]) + (" ..." if len(runs) > 20 else "") if runs else "none"
        raise ResumeError(
            f"there is no run {config.run_name!r} to resume ({run_dir} does not exist; runs in "
            f"{config.runs_dir}: {listed}); check run_name, or drop --resume to start it"
        )
    removed = checkpoint.remove_partial(run_dir)
    found = checkpoint.latest(run_dir)
    if found is None:
        steps = [r.get("step") for r in MetricsLog(run_dir, tensorboard=False).records()]
        made = (
            f"its metrics.jsonl holds steps {steps[0]}..{steps[-1]}"
            if steps
            else "it holds no metrics line"
        )
        raise ResumeError(
            f"run {config.run_name!r} has no checkpoint yet ({made}; checkpoint_every is "
            f"{config.checkpoint_every}), so it cannot be resumed. Start it again under another "
            f"run_name (or delete {run_dir}); a lower checkpoint_every makes resumes possible "
            "sooner"
        )
    try:
        state = checkpoint.read_state(found)
        checkpoint.check_rng(state.rng)
        checkpoint.check_rank_rngs(found)  # a sharded checkpoint's ranks' own
    except (OSError, ValueError, TypeError) as error:  # missing, not JSON, not a TrainerState
        raise ResumeError(damaged(found, error)) from error
    return ResumePoint(found, state, removed)


def load(point: ResumePoint, backend: Backend) -> TrainerState:
    """Loads the checkpoint's weights and optimizer into `backend`; a `ResumeError` when its files
    cannot be loaded (truncated, deleted, or from another model or LoRA setting)."""
    try:
        checkpoint.load(point.folder, backend)
    except Exception as error:  # torch.load and load_state_dict fail in many ways, all alike here
        raise ResumeError(damaged(point.folder, error)) from error
    return point.state


def check_stream(point: ResumePoint, now: dict[str, Any], config: TrainConfig) -> None:
    """A `ResumeError` when the training tasks or the seed changed since the checkpoint: its
    data position, and the positions of the groups it declares again, would then name other
    tasks (some trained twice, some never) while the run looks continuous."""
    then = point.state.stream
    if then is None or then == now:
        return
    changes = []
    if then.get("seed") != now["seed"]:
        changes.append(f"seed was {then.get('seed')}, is {now['seed']}")
    if then.get("tasks") != now["tasks"] or then.get("digest") != now["digest"]:
        changes.append(
            f"the training tasks ({config.tasks}) changed: {then.get('tasks')} tasks then, "
            f"{now['tasks']} now" + ("" if then.get("tasks") != now["tasks"] else ", other ones")
        )
    raise ResumeError(
        f"run {config.run_name!r} cannot go on from {point.folder.name}: "
        + "; ".join(changes)
        + ". Its stream position would name other tasks: put them back as they were, or start "
        "a new run under another run_name"
    )


def setup_of(config: TrainConfig) -> dict[str, Any]:
    """What a checkpoint's files are laid out for: its backend (one `model.pt` or shards), its
    model (by folder name: a copy elsewhere is the same model) and its LoRA adapters' shape and
    scale. LoRA adapters load onto another base model without an error, and under another
    `alpha` they add another update (`alpha / r * B @ A`) to the weights: a policy the run
    never trained."""
    lora = config.lora
    adapters = None
    if lora is not None:
        adapters = {"r": lora.r, "target_modules": lora.target_modules, "alpha": lora.alpha}
    return {
        "backend": config.backend,
        "model": config.model.name if config.model is not None else None,
        "lora": adapters,
    }


def check_setup(point: ResumePoint, config: TrainConfig) -> None:
    """A `ResumeError` naming what changed when the config's backend, model or LoRA shape or
    scale is not the checkpoint's (its files would be read as damaged, or LoRA adapters loaded
    onto another model or scaled otherwise)."""
    then, now = point.state.setup, setup_of(config)
    if then is None:
        return
    then_lora, now_lora = then.get("lora"), now["lora"]
    if isinstance(then_lora, dict) and now_lora is not None and "alpha" not in then_lora:
        # A checkpoint written before the scale was kept: its shape alone is compared.
        now = {**now, "lora": {k: v for k, v in now_lora.items() if k != "alpha"}}
    if then == now:
        return
    changes = [
        f"{name} was {then.get(name)!r}, is {now[name]!r}"
        for name in now
        if then.get(name) != now[name]
    ]
    raise ResumeError(
        f"run {config.run_name!r} cannot go on from {point.folder.name}: "
        + "; ".join(changes)
        + ". Its checkpoints are for the first: set it back, or start a new run under another "
        "run_name"
    )


def damaged(folder: Path, error: BaseException) -> str:
    """Why `folder` cannot be resumed from, and what the user can do."""
    found = checkpoint.saved(folder.parent)
    earlier = found[: found.index(folder)] if folder in found else []
    instead = (
        f"move it out of {folder.parent} to resume from {earlier[-1].name}, the one before it"
        if earlier
        else "there is no earlier checkpoint: start the run again under another run_name"
    )
    return (
        f"checkpoint {folder} cannot be loaded ({error}); it is damaged or was written for "
        f"another model or LoRA setting: {instead}"
    )


@dataclass
class VersionLedger:
    """`<run>/versions.json`: the highest weight version ever served, and the incarnation."""

    path: Path
    highest: int = 0
    incarnation: int = 0

    @classmethod
    def open(cls, run_dir: Path) -> VersionLedger:
        ledger = cls(run_dir / VERSIONS)
        try:
            text = ledger.path.read_text()
        except FileNotFoundError:
            return ledger
        try:
            data = json.loads(text)
            ledger.highest = int(data["highest"])
            ledger.incarnation = int(data["incarnation"])
        except (KeyError, TypeError, ValueError) as error:  # not JSON, a number missing or not one
            raise ResumeError(
                f"{ledger.path} does not hold the highest weight version served and the "
                f"incarnation ({error!r}): it cannot be trusted, so no version number is given "
                "out. Start the run again under another run_name"
            ) from error
        return ledger

    def served(self, version: int) -> None:
        """Records that `version` is (about to be) served; call it before the engine serves it."""
        if version > self.highest:
            self.highest = version
            self._save()

    def resumed(self, checkpoint_version: int) -> int:
        """Starts a new incarnation; returns the version the loaded weights are served under."""
        self.incarnation += 1
        version = checkpoint_version if self.highest <= checkpoint_version else self.highest + 1
        self.highest = max(self.highest, version)
        self._save()
        return version

    def _save(self) -> None:
        staging = self.path.with_suffix(".json.tmp")
        with staging.open("w") as out:
            json.dump({"highest": self.highest, "incarnation": self.incarnation}, out)
            out.flush()
            os.fsync(out.fileno())
        staging.replace(self.path)


PAGE = 1000
"""Rollouts per page of the leftover sweep."""


async def cancel_leftovers(client: GatewayClient, run_name: str, reason: str) -> list[str]:
    """Fails the run's queuing and running rollouts (all of them belong to an earlier
    incarnation or to a run that is stopping); returns their ids."""
    cancelled: list[str] = []
    cursor, database = 0, None
    ids: list[str] = []
    while True:
        page = await client.list_rollouts(states=("queuing", "running"), cursor=cursor, limit=PAGE)
        try:
            database = check_database(database, cursor, page)
        except DatabaseChanged:
            # The gateway came back on another database (or an older copy) between two pages:
            # the sweep is of that database's rollouts, from the start.
            cursor, database, ids = 0, None, []
            continue
        ids += [r.rollout_id for r in page.items if r.metadata.get("run") == run_name]
        cursor = page.next_cursor
        if len(page.items) < PAGE:
            break
    for rollout_id in ids:
        try:
            await client.set_status(rollout_id, "failed", reason)
        except GatewayError as error:
            if error.status_code != 409:  # 409: it finished meanwhile
                raise
            continue
        cancelled.append(rollout_id)
    if cancelled:
        log.info("failed %d rollouts left in flight: %s", len(cancelled), reason)
    return cancelled
