"""`reins train`: everything the main job needs, in one process on the embedded defaults.

The gateway (SQLite in the run folder), the embedded engine (sharing the trainer's weights), the
local reconciler (agents as processes) and the trainer loop run side by side: servers in threads,
the controller and the loop on one asyncio loop, the optimizer step in a worker thread. Any of
them can instead be external: `gateway_url` and `engine_url` in the config.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import importlib.util
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping
from importlib.machinery import PathFinder
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from reins import allocator
from reins.client import GatewayClient
from reins.cliout import counted
from reins.engine.folder import check_model_folder
from reins.engine.weights import load_into
from reins.schemas import ModelEndpointIn
from reins.serving import BackgroundServer
from reins.trainer import checkpoint
from reins.trainer import resume as resuming
from reins.trainer.backend import Backend, BackendConfig, TorchBackend
from reins.trainer.config import TrainConfig
from reins.trainer.data import Task, TaskStream, load_tasks
from reins.trainer.loop import Reporter, Trainer
from reins.trainer.metrics import MetricsLog
from reins.trainer.publish import InProcessPublisher, ReloadPublisher, WeightPublisher

if TYPE_CHECKING:
    from reins.trainer.ranks import Leader

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ConsoleReporter:
    """A live progress bar over the steps, with the phase and the latest figures.

    The bar is drawn from the first phase the run reports, not on entering: `reins train`
    enters one on every rank of a sharded run, and the ranks other than 0, which only follow
    rank 0's updates and report nothing, each drew a `step 0/N` bar of their own."""

    def __init__(self, console: Console, steps: int, start: int) -> None:
        self.progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[phase]}"),
            TextColumn("{task.fields[figures]}"),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task(
            "train", total=steps, completed=start, phase="", figures=""
        )
        self.figures: dict[str, str] = {}
        self.console = console
        self.drawing = False

    def __enter__(self) -> ConsoleReporter:
        return self

    def __exit__(self, *_: object) -> None:
        if self.drawing:
            self.progress.stop()
            self.drawing = False

    def _draw(self) -> None:
        if not self.drawing:
            self.progress.start()
            self.drawing = True

    def phase(self, step: int, name: str) -> None:
        self._draw()
        # Working on `step`: the steps before it are done. A resumed run starts at its
        # checkpoint's step, and its bar read `step 0/N` until its first step ended.
        task = self.progress.tasks[0]
        done = max(task.completed, min(step, task.total or 0))
        self.progress.update(self.task, phase=f"[cyan]{name}[/cyan]", completed=done)

    def say(self, message: str) -> None:
        # Not markup: a message names paths and ids, and a `[/x]` in one was a MarkupError
        # that stopped the run.
        self.console.print(message, markup=False)

    def services(self, gateway_url: str, api_key: str) -> None:
        self.console.print(
            f"dashboard: {gateway_url}/ui (admin key {api_key}); "
            f"API schema {gateway_url}/ui/openapi.json",
            markup=False,
        )

    def rollouts(self, done: int, total: int) -> None:
        self._draw()
        self.progress.update(self.task, phase=f"[cyan]rollouts {done}/{total}[/cyan]")

    def step_done(self, record: dict[str, Any]) -> None:
        if record.get("reward/mean") is not None:  # None: NaN, which the metrics log writes so
            self.figures["reward"] = f"reward {record['reward/mean']:.3f}"
        if record.get("val/reward_mean") is not None:
            self.figures["val"] = f"val {record['val/reward_mean']:.3f}"
        if record.get("time/step") is not None:
            self.figures["time"] = f"{record['time/step']:.0f} s/step"
        self._draw()
        step = int(record.get("step", 0))
        completed = min(step + 1, int(self.progress.tasks[0].total or 0))
        if "reward/mean" in record or "time/step" in record:
            self.progress.update(self.task, completed=completed)
        self.progress.update(self.task, figures="  ".join(self.figures.values()))
        self.console.log(_summary(record))


def _summary(record: dict[str, Any]) -> str:
    keys = (
        ("reward/mean", "reward"),
        ("val/reward_mean", "val"),
        ("policy/entropy", "entropy"),
        ("samples/per_rollout", "samples/rollout"),
        ("rollouts/failed", "failed"),
        ("time/rollout", "rollout s"),
        ("time/update", "update s"),
    )
    parts = [f"step {record.get('step')}"]
    for key, label in keys:
        value = record.get(key)
        if isinstance(value, float):
            parts.append(f"{label} {value:.3f}")
        elif value is not None:
            parts.append(f"{label} {value}")
    return "  ".join(parts)


def load_policy(
    config: TrainConfig, *, dtype: torch.dtype | None = None, lora: bool = True
) -> tuple[Any, Any, Path]:
    """(model, tokenizer, folder) for training, on the configured device and precision (or
    `dtype`), with the configured LoRA adapters unless `lora` is False."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reins.engine.prepare import prepare_default_model

    folder = config.model or prepare_default_model()
    device = rank_device(config.device, os.environ)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model: Any = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype or DTYPES[config.precision]
    )
    model = model.to(device)
    if lora and config.lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=config.lora.r,
                lora_alpha=config.lora.alpha,
                lora_dropout=config.lora.dropout,
                target_modules=config.lora.target_modules,
                task_type="CAUSAL_LM",
            ),
        )
    model.eval()
    return model, tokenizer, Path(folder)


def saved_config(config: TrainConfig) -> dict[str, Any]:
    """The config as the run folder keeps it (`config.yaml`), its paths absolute: relative ones
    are read against the file's own folder (`load_config`), so `reins train
    RUN_DIR/config.yaml --resume` looked for `RUN_DIR/examples/recall/train.jsonl`."""
    data = config.model_dump(mode="json")
    for name in ("tasks", "val_tasks", "model", "runs_dir"):
        value = getattr(config, name)
        if value is not None:
            data[name] = str(Path(value).expanduser().resolve())
    return data


async def _refuse_a_taken_run_name(
    client: GatewayClient, config: TrainConfig, gateway_url: str
) -> None:
    """A FileExistsError when a run that starts afresh finds rollouts of its name at its gateway.
    Its rollout ids derive from the run's name and its tasks' positions, and the gateway hands
    back an existing rollout for a known id and body (a retried declare): the new run would get
    the old run's rollouts, finished (or failed by its stop), and train on them, or drop them,
    without running an agent. That happened when a run stopped before its first step's line was
    started again in the same folder, and on a shared gateway when a run folder was deleted to
    start over, or two runs had the same name."""
    page = await client.request("GET", "/api/rollouts", params={"run": config.run_name, "limit": 1})
    if not page.get("items"):
        return
    found = page["items"][0]
    where = (
        f"of {config.run_dir} (gateway.db)" if config.gateway_url is None else f"at {gateway_url}"
    )
    instead = (
        f"delete {config.run_dir} to start this run afresh"
        if config.gateway_url is None
        else "resume the run that declared them (--resume, from its run folder)"
    )
    raise FileExistsError(
        f"the gateway {where} already holds rollouts of a run named {config.run_name!r} (such as "
        f"{found['rollout_id']}, {found['status']['state']}), which a new run of that name would "
        f"be handed back instead of running its agents: start it under another run_name, or "
        f"{instead}"
    )


def rank_device(device: str | None, environ: Mapping[str, str]) -> str:
    """The device a process trains on: `cuda` when present and none is set; under torchrun,
    the GPU of its `LOCAL_RANK`. A GPU named by its index under several ranks is refused: every
    rank would take that one GPU."""
    chosen = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not chosen.startswith("cuda") or "LOCAL_RANK" not in environ:
        return chosen
    if chosen != "cuda" and int(environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            f"device {chosen} under torchrun puts every rank on that one GPU: set device to cuda "
            "(each rank takes the GPU of its LOCAL_RANK)"
        )
    return f"cuda:{environ['LOCAL_RANK']}"


def check_device(device: str | None) -> None:
    """A ValueError when `device` (the config's) is no torch device, or a GPU torch does not see
    here: torch answers both with a traceback from deep in the model's load."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"device {device!r} is not a torch device: set cpu, cuda or cuda:N, or leave it unset "
            "(cuda when present)"
        ) from None
    if parsed.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0 or (parsed.index is not None and parsed.index >= count):
        raise ValueError(
            f"device {device}: torch sees {count} CUDA device(s) here; set device to cpu, or "
            "leave it unset (cuda when present)"
        )


def check_agent(agent: str) -> None:
    """A ValueError when the agent cannot run anywhere: empty, or a `module:function` whose
    module is nowhere its agents look (the working directory they run in, this one, then the
    paths of this interpreter, theirs). Every rollout would crash on it, and the run would go
    through all its steps training on nothing."""
    from reins.controller.loop import _MODULE_FUNCTION

    if not agent.strip():
        raise ValueError("the agent is empty: set agent to `module:function` or a command line")
    if not _MODULE_FUNCTION.match(agent):
        return  # a command line: the shell finds it, or the attempt's log says why not
    top = agent.partition(":")[0].split(".")[0]
    # Top-level names only: finding `a.b` would import package `a` into the trainer.
    if PathFinder.find_spec(top, [os.getcwd()]) is None and importlib.util.find_spec(top) is None:
        raise ValueError(
            f"agent {agent}: there is no module {top!r} in {os.getcwd()} (where agents run) nor "
            "on this Python's path: check the name, run from the folder that holds it, or add "
            "that folder to PYTHONPATH"
        )


@contextlib.asynccontextmanager
async def _gateway(config: TrainConfig, api_key: str, tokenizer: Path) -> AsyncIterator[str]:
    if config.gateway_url is not None:
        yield config.gateway_url.rstrip("/")
        return
    from reins.gateway import create_app
    from reins.gateway.capture import SamplingPolicy
    from reins.gateway.settings import load_settings

    val_sampling = (
        SamplingPolicy(set={"temperature": config.val_temperature})
        if config.val_temperature is not None
        else SamplingPolicy()
    )
    settings = load_settings(  # SettingsRefused (a ValueError) names a bad REINS_* variable
        database_url=str(config.run_dir / "gateway.db"),
        api_key=api_key,
        runs_dir=config.runs_dir,
        train_sampling=SamplingPolicy(set={"temperature": config.train_temperature, "top_p": 1.0}),
        val_sampling=val_sampling,
        monitor_tokenizer=str(tokenizer),  # the dashboard shows token text and split reasons
    )
    server = BackgroundServer(create_app(settings)).start()
    try:
        yield server.url
    finally:
        server.stop()


def _tell(reporter: Reporter | None, message: str) -> None:
    """A line for the user: the console's when there is one, the log's otherwise."""
    say = getattr(reporter, "say", None)
    if say is not None:
        say(message)
    else:
        log.warning("%s", message)


async def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    reporter: Reporter | None = None,
    on_serving: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Runs the configured training; returns the metrics records of the steps it made (none on
    a rank other than 0 of a sharded run: that rank only follows rank 0's updates).
    The process's allocator and garbage collector are left as they are: `reins train` sets the
    first (`configure_allocator`) and freezes the objects alive once the gateway, the engine and
    the controller run (`on_serving`: called then, before the first step)."""

    if config.backend == "torch":
        return await _train(
            config, resume=resume, reporter=reporter, leader=None, on_serving=on_serving
        )
    from reins.trainer import ranks

    ranks.start_process_group(
        config.distributed_timeout_s, cuda=rank_device(config.device, os.environ).startswith("cuda")
    )
    try:
        if dist.get_rank() != 0:
            await asyncio.to_thread(_follow, config)
            return []
        leader = ranks.Leader()
        failed = True
        try:
            records = await _train(
                config, resume=resume, reporter=reporter, leader=leader, on_serving=on_serving
            )
            failed = False
            return records
        finally:
            leader.release(failed=failed)
    finally:
        dist.destroy_process_group()


T = TypeVar("T")


async def _while_controller_runs(work: Coroutine[Any, Any, T], controller: asyncio.Task[None]) -> T:
    """`work`'s result; if the rollout controller ends first (an error it does not retry, such
    as a refused key or an agents folder it cannot write), `work` is cancelled and this fails
    with the controller's error: no rollout would run again, and the trainer would wait for
    them forever."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, controller}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this run is cancelled (Ctrl-C): so is `work`, whose cleanup ends first
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    error = None if controller.cancelled() else controller.exception()
    raise RuntimeError(f"the rollout controller stopped: {error!r}") from error


def configure_allocator(config: TrainConfig) -> None:
    """This process's C allocator as the config asks (`malloc_mmap_threshold_mb`): for the
    process's owner to call (the `reins train` command), since it changes every allocation of
    the process, not only the trainer's."""
    if config.malloc_mmap_threshold_mb is not None:
        allocator.map_large_blocks(config.malloc_mmap_threshold_mb)


GATEWAY_CHECK_S = 10.0


async def _reach_gateway(url: str, api_key: str) -> None:
    """An external gateway answers and takes the key before the model loads (minutes, for a
    large one): a wrong `gateway_url` was found only after it, and two minutes of silent
    retries. A `GatewayError` when not (`reins train` says which setting to fix)."""
    async with GatewayClient(url, api_key, retry_for_s=GATEWAY_CHECK_S) as client:
        await client.request("GET", "/api/admission")


def _backend_config(config: TrainConfig) -> BackendConfig:
    return BackendConfig.model_validate(
        {**config.model_dump(), "temperature": config.train_temperature}
    )


def _follow(config: TrainConfig) -> None:
    """A rank other than 0: its shard of the model, each update rank 0 tells, until released."""
    from reins.trainer import ranks
    from reins.trainer.fsdp import FSDPBackend

    def build() -> FSDPBackend:
        torch.manual_seed(config.seed)  # as rank 0 does: the same LoRA initialization
        model, _, _ = load_policy(config, dtype=torch.float32)
        return FSDPBackend(model, _backend_config(config), param_dtype=config.precision)

    calls = ranks.follow(build)
    log.info("rank %d made %d calls of rank 0", dist.get_rank(), calls)


async def _train(
    config: TrainConfig,
    *,
    resume: bool,
    reporter: Reporter | None,
    leader: Leader | None,
    on_serving: Callable[[], None] | None,
) -> list[dict[str, Any]]:
    # What the config names is checked before anything is created or loaded: a mistake there is
    # told as such, not as a loader's traceback minutes into the model's load.
    if config.model is not None:
        check_model_folder(config.model, setting="model")
    check_device(config.device)
    check_agent(config.agent)
    train_tasks = load_tasks(config.tasks)
    val_tasks = load_tasks(config.val_tasks) if config.val_tasks else []
    if resume and not config.run_dir.is_dir():
        resuming.find(config)  # a ResumeError naming the runs there; nothing is created
    with _run_lock(config):
        return await _train_locked(
            config,
            train_tasks,
            val_tasks,
            resume=resume,
            reporter=reporter,
            leader=leader,
            on_serving=on_serving,
        )


LOCK = "run.lock"
"""`<run>/run.lock`: held (flock) by the one process that runs the run; holds its pid."""


@contextlib.contextmanager
def _run_lock(config: TrainConfig) -> Iterator[None]:
    """The run folder, made and held for this process alone while it runs. A second `reins
    train` of the same run (a --resume typed while the run still runs, the same command in two
    terminals) would share its gateway database and agents folder, adopt its agents, train its
    rollouts a second time and write its steps' metrics lines twice. The kernel releases the
    lock when the process ends, however it ends, so a crashed run leaves none behind."""
    run_dir = config.run_dir
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise ValueError(
            f"cannot create the run folder {run_dir} ({error}); set runs_dir to a folder this "
            "user can write"
        ) from error
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise FileExistsError(
                f"run {config.run_name!r} is being run by another process (pid {holder}, which "
                f"holds {run_dir / LOCK}): wait for it to end, or stop it, before running or "
                "resuming it here"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


async def _train_locked(
    config: TrainConfig,
    train_tasks: list[Task],
    val_tasks: list[Task],
    *,
    resume: bool,
    reporter: Reporter | None,
    leader: Leader | None,
    on_serving: Callable[[], None] | None,
) -> list[dict[str, Any]]:
    from reins.controller import Controller, LocalReconciler

    run_dir = config.run_dir
    point = resuming.find(config) if resume else None  # a ResumeError says what exists
    if point is None and (
        (run_dir / "metrics.jsonl").exists() or checkpoint.latest(run_dir) is not None
    ):
        raise FileExistsError(
            f"{run_dir} already holds a run; pass --resume to go on with it, or choose another "
            "run_name"
        )
    stream = TaskStream(train_tasks, config.seed)
    if point is not None:
        resuming.check_stream(point, stream.identity(), config)
        resuming.check_setup(point, config)
    metrics = MetricsLog(run_dir, tensorboard=config.tensorboard)
    final_validation = True
    if point is not None:
        start = point.state.next_step
        if start > config.steps:
            metrics.close()
            raise resuming.ResumeError(
                f"run {config.run_name!r} made {counted(start, 'step')} already (checkpoint "
                f"{point.folder}); set steps to {start} or more to go on with it"
            )
        validates = bool(config.val_tasks) and config.val_every > 0
        if start == config.steps and (not validates or metrics.has_final_validation(config.steps)):
            metrics.close()
            done = counted(start, "step")
            _tell(reporter, f"run {config.run_name} is finished ({done}): nothing to do")
            return []
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved_config(config)))
    shortfall = config.async_parallel_shortfall()
    if shortfall is not None:
        _tell(reporter, shortfall)
    torch.manual_seed(config.seed)
    api_key = (
        config.api_key or os.environ.get("REINS_API_KEY") or "rk-admin-" + secrets.token_urlsafe(18)
    )
    if config.gateway_url is not None:
        await _reach_gateway(config.gateway_url, api_key)

    backend: Backend
    leading = None
    if leader is not None:
        from reins.trainer import ranks
        from reins.trainer.fsdp import FSDPBackend

        leader.tell("start")
        # fp32 master weights, sharded; the engine serves its own whole copy.
        model, tokenizer, folder = load_policy(config, dtype=torch.float32)
        sharded = FSDPBackend(model, _backend_config(config), param_dtype=config.precision)
        backend = leading = ranks.LeaderBackend(sharded, leader)
        if config.engine_url is None:
            # The engine's own whole copy, LoRA merged in at each update (`full_state_dict`).
            model, _, _ = load_policy(config, lora=False)
    else:
        model, tokenizer, folder = load_policy(config)
        backend = TorchBackend(model, _backend_config(config))
    versions = resuming.VersionLedger.open(run_dir)
    start_step, version, lineage, pending = 0, 0, [0], []
    if point is not None:
        state = resuming.load(point, backend)  # a ResumeError when it cannot be loaded
        if leading is not None and config.engine_url is None:
            # The embedded engine's own copy serves the checkpoint's weights too.
            load_into(model, leading.full_state_dict())
        checkpoint.restore_rng(state.rng)
        start_step, stream.position = state.next_step, state.data_position
        # Weights served after the checkpoint are gone: their version numbers are never reused.
        version = versions.resumed(state.weight_version)
        lineage = state.lineage + ([version] if version != state.weight_version else [])
        pending = state.pending
        moved = metrics.settle(start_step, steps=config.steps, checkpoint_record=state.record)
        final_validation = not metrics.has_final_validation(config.steps)
        notes = [f"weights served as version {version}"]
        if moved:
            notes.append(f"{len(moved)} metrics lines of steps it redoes moved aside")
        if point.removed_partial:
            notes.append(f"removed {len(point.removed_partial)} partial checkpoint folder(s)")
        _tell(
            reporter,
            f"resumed run {config.run_name} from step {start_step} (checkpoint {point.folder}); "
            + "; ".join(notes),
        )
    else:
        versions.served(0)

    engine = None
    engine_server = None
    async with _gateway(config, api_key, folder) as gateway_url:
        client = GatewayClient(gateway_url, api_key)
        if point is None:
            try:
                await _refuse_a_taken_run_name(client, config, gateway_url)
            except BaseException:
                await client.close()
                raise
        if point is not None:
            # Before the controller starts: nothing an earlier incarnation declared runs again.
            await resuming.cancel_leftovers(
                client,
                config.run_name,
                f"the trainer was restarted from {point.folder.name}; the run declares this "
                "rollout's task again when it serves the weights of its step",
            )
        announce = getattr(reporter, "services", None)
        if announce is not None:
            announce(gateway_url, api_key)
        publisher: WeightPublisher
        name = folder.name
        if config.engine_url is None:
            from reins.engine.api import create_engine_app
            from reins.engine.embedded import EmbeddedEngine

            engine = EmbeddedEngine(
                model,
                tokenizer,
                name=name,
                weight_version=version,
                max_batch=config.max_batch,
                max_model_len=config.max_model_len,
                prefix_cache_gb=config.prefix_cache_gb,
            )
            engine_server = BackgroundServer(create_engine_app(engine)).start()
            if leading is not None:
                from reins.trainer.ranks import GatheringPublisher

                publisher = GatheringPublisher(engine, leading)
            else:
                publisher = InProcessPublisher(engine)
            endpoints = [(f"{engine_server.url}/v1", "reins")]
        else:
            # Asks each engine its kind (blocking HTTP, hence a thread).
            reloading = await asyncio.to_thread(
                ReloadPublisher,
                backend,
                config.engine_urls,
                run_dir / "weights",
                version=version,
                sleep=config.engine_sleep,
            )
            publisher = reloading
            served = max((e.served_version or 0 for e in reloading.engines), default=0)
            if served > version:
                # A `reins engine` that served another run's (or an earlier incarnation's)
                # weights: numbered above this run's, it had every call of a fresh run read as
                # stale (nothing trained), and refused a resume's weights (versions only go up).
                version = served + 1
                versions.served(version)
                lineage = [*lineage, version] if point is not None else [version]
                _tell(
                    reporter,
                    f"an engine served version {served} of other weights: this run's load as "
                    f"version {version}",
                )
            if point is not None or version != 0:
                # An engine may hold weights the crash discarded, or have restarted, or serve
                # another run's: every one is handed this run's, as the version it serves them
                # under.
                await asyncio.to_thread(publisher.publish, version)
            endpoints = [(f"{e.url}/v1", e.kind) for e in reloading.engines]

        async def register(version: int) -> None:
            await client.register_models(
                [
                    ModelEndpointIn(model=name, endpoint=url, engine=kind, weight_version=version)
                    for url, kind in endpoints
                ]
            )

        # This run's endpoints only: an earlier incarnation's (its embedded engine's port, a
        # fleet member since dropped) would take calls by sticky routing and fail them.
        await client.delete_models(name)
        await register(version)
        controller = Controller(
            client,
            # Its agents die with this process: the gateway they talk to does too.
            LocalReconciler(
                config.agent, config.max_parallel, run_dir / "agents", die_with_parent=True
            ),
            gateway_url=gateway_url,
            max_attempts=config.max_attempts,
            default_timeout_s=config.rollout_timeout_s,
        )
        stop = asyncio.Event()
        controller_task = asyncio.create_task(controller.run(stop))
        trainer = Trainer(
            config,
            client,
            backend,
            publisher,
            train_tasks=stream,
            val_tasks=val_tasks,
            decode=tokenizer.decode,
            reporter=reporter,
            metrics=metrics,
            on_publish=register,
            incarnation=versions.incarnation,
            lineage=lineage,
            pending=pending,
            versions=versions,
            policy_model=name,
        )
        if on_serving is not None:
            on_serving()
        started = time.monotonic()
        try:
            records = await _while_controller_runs(
                trainer.run(start_step, final_validation=final_validation), controller_task
            )
        finally:
            # Stopping (done, an error, Ctrl-C): no rollout of this run stays queuing or running.
            # Swept before the controller stops (it then ends their agents) and once more after:
            # a declare the cancelled trainer had already sent may land between the two.
            leftovers = functools.partial(
                resuming.cancel_leftovers,
                client,
                config.run_name,
                "the trainer stopped before this rollout ended",
            )
            with contextlib.suppress(Exception):
                await asyncio.wait_for(leftovers(), 30)
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(controller_task, 60)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(leftovers(), 30)
            metrics.close()
            if engine_server is not None:
                engine_server.stop()
            if engine is not None:
                engine.close()
            await client.close()
        log.info("trained %d steps in %.0f s", len(records), time.monotonic() - started)
    return records
