"""`reins train`: everything the main job needs, in one process on the embedded defaults.

The gateway (SQLite in the run folder), the embedded engine (sharing the trainer's weights), the
local reconciler (agents as processes) and the trainer loop run side by side: servers in threads,
the controller and the loop on one asyncio loop, the optimizer step in a worker thread. Any of
them can instead be external: `gateway_url` and `engine_url` in the config.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from reins.client import GatewayClient
from reins.schemas import ModelEndpointIn
from reins.serving import BackgroundServer
from reins.trainer import checkpoint
from reins.trainer.backend import BackendConfig, TorchBackend
from reins.trainer.config import TrainConfig
from reins.trainer.data import TaskStream, load_tasks
from reins.trainer.loop import Reporter, Trainer
from reins.trainer.metrics import MetricsLog
from reins.trainer.publish import InProcessPublisher, ReloadPublisher, WeightPublisher

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ConsoleReporter:
    """A live progress bar over the steps, with the phase and the latest figures."""

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

    def __enter__(self) -> ConsoleReporter:
        self.progress.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.progress.stop()

    def phase(self, step: int, name: str) -> None:
        self.progress.update(self.task, phase=f"[cyan]{name}[/cyan]")

    def services(self, gateway_url: str, api_key: str) -> None:
        self.console.print(
            f"dashboard: {gateway_url}/ui (admin key {api_key}); "
            f"API schema {gateway_url}/ui/openapi.json"
        )

    def rollouts(self, done: int, total: int) -> None:
        self.progress.update(self.task, phase=f"[cyan]rollouts {done}/{total}[/cyan]")

    def step_done(self, record: dict[str, Any]) -> None:
        if "reward/mean" in record:
            self.figures["reward"] = f"reward {record['reward/mean']:.3f}"
        if record.get("val/reward_mean") is not None:
            self.figures["val"] = f"val {record['val/reward_mean']:.3f}"
        if "time/step" in record:
            self.figures["time"] = f"{record['time/step']:.0f} s/step"
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


def load_policy(config: TrainConfig) -> tuple[Any, Any, Path]:
    """(model, tokenizer, folder) for training, on the configured device and precision."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reins.engine.prepare import prepare_default_model

    folder = config.model or prepare_default_model()
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[config.precision])
    model = model.to(device)
    if config.lora is not None:
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


@contextlib.asynccontextmanager
async def _gateway(config: TrainConfig, api_key: str, tokenizer: Path) -> AsyncIterator[str]:
    if config.gateway_url is not None:
        yield config.gateway_url.rstrip("/")
        return
    from reins.gateway import GatewaySettings, create_app
    from reins.gateway.capture import SamplingPolicy

    val_sampling = (
        SamplingPolicy(set={"temperature": config.val_temperature})
        if config.val_temperature is not None
        else SamplingPolicy()
    )
    settings = GatewaySettings(
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


async def train(
    config: TrainConfig, *, resume: bool = False, reporter: Reporter | None = None
) -> list[dict[str, Any]]:
    """Runs the configured training; returns the metrics records of the steps it made."""
    from reins.controller import Controller, LocalReconciler

    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    found = checkpoint.latest(run_dir) if resume else None
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(
            f"{run_dir} already holds a run; pass --resume to go on with it, or choose another "
            "run_name"
        )
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    torch.manual_seed(config.seed)

    model, tokenizer, folder = load_policy(config)
    backend = TorchBackend(
        model,
        BackendConfig.model_validate(
            {**config.model_dump(), "temperature": config.train_temperature}
        ),
    )
    train_tasks = load_tasks(config.tasks)
    val_tasks = load_tasks(config.val_tasks) if config.val_tasks else []
    stream = TaskStream(train_tasks, config.seed)
    start_step, version = 0, 0
    if found is not None:
        state = checkpoint.load(found, backend)
        checkpoint.restore_rng(state.rng)
        start_step, stream.position, version = (
            state.next_step,
            state.data_position,
            state.weight_version,
        )
        log.info("resuming from %s at step %d", found, start_step)
    metrics = MetricsLog(run_dir, tensorboard=config.tensorboard)
    metrics.truncate_after(start_step - 1)

    api_key = (
        config.api_key or os.environ.get("REINS_API_KEY") or "rk-admin-" + secrets.token_urlsafe(18)
    )
    engine = None
    engine_server = None
    async with _gateway(config, api_key, folder) as gateway_url:
        client = GatewayClient(gateway_url, api_key)
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
            publisher = InProcessPublisher(engine)
            endpoint = f"{engine_server.url}/v1"
        else:
            publisher = ReloadPublisher(
                backend, config.engine_url, run_dir / "weights", version=version
            )
            endpoint = f"{config.engine_url.rstrip('/')}/v1"
        await client.register_models(
            [ModelEndpointIn(model=name, endpoint=endpoint, engine="reins", weight_version=version)]
        )
        controller = Controller(
            client,
            LocalReconciler(config.agent, config.max_parallel, run_dir / "agents"),
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
        )
        started = time.monotonic()
        try:
            records = await trainer.run(start_step)
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(controller_task, 60)
            metrics.close()
            if engine_server is not None:
                engine_server.stop()
            if engine is not None:
                engine.close()
            await client.close()
        log.info("trained %d steps in %.0f s", len(records), time.monotonic() - started)
    return records
