"""The services of a training config without the trainer: the gateway, the policy's engine and a
local controller running the config's agent. For work that rolls the policy out but does not
update it (`reins swe prepare`'s difficulty filter).

Same choices as `reins train`: the config's `gateway_url` or a gateway in this process on
SQLite in the run folder; its `engine_url`(s) or the embedded engine on the config's model; the
agents as local processes, `max_parallel` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

from reins.client import GatewayClient
from reins.schemas import ModelEndpointIn
from reins.serving import BackgroundServer
from reins.trainer.config import TrainConfig


@dataclass
class PolicyServices:
    client: GatewayClient
    gateway_url: str
    model: str
    """The name the policy is registered under at the gateway."""


@contextlib.asynccontextmanager
async def policy_services(config: TrainConfig) -> AsyncIterator[PolicyServices]:
    """Runs the services until the block ends; the controller's agents end with it."""
    from reins.controller import Controller, LocalReconciler
    from reins.trainer.runtime import _gateway, load_policy

    config.run_dir.mkdir(parents=True, exist_ok=True)
    api_key = (
        config.api_key or os.environ.get("REINS_API_KEY") or "rk-admin-" + secrets.token_urlsafe(18)
    )
    from reins.engine.prepare import prepare_default_model

    folder = config.model or prepare_default_model()
    name = folder.name
    engine = engine_server = None
    if config.engine_url is None:
        from reins.engine.api import create_engine_app
        from reins.engine.embedded import EmbeddedEngine

        model, tokenizer, _ = load_policy(config, lora=False)
        engine = EmbeddedEngine(
            model,
            tokenizer,
            name=name,
            max_batch=config.max_batch,
            max_model_len=config.max_model_len,
            prefix_cache_gb=config.prefix_cache_gb,
        )
        engine_server = BackgroundServer(create_engine_app(engine)).start()
        endpoints = [(f"{engine_server.url}/v1", "reins")]
    else:
        from reins.trainer.fleet import connect

        fleet = await asyncio.gather(*(asyncio.to_thread(connect, u) for u in config.engine_urls))
        endpoints = [(f"{e.url}/v1", e.kind) for e in fleet]
    try:
        async with (
            _gateway(config, api_key, folder) as gateway_url,
            GatewayClient(gateway_url, api_key) as client,
        ):
            await client.register_models(
                [ModelEndpointIn(model=name, endpoint=url, engine=kind) for url, kind in endpoints]
            )
            agents = LocalReconciler(
                config.agent, config.max_parallel, config.run_dir / "agents", die_with_parent=True
            )
            controller = Controller(
                client,
                agents,
                gateway_url=gateway_url,
                max_attempts=config.max_attempts,
                default_timeout_s=config.rollout_timeout_s,
            )
            stop = asyncio.Event()
            running = asyncio.create_task(controller.run(stop))
            try:
                yield PolicyServices(client, gateway_url, name)
            finally:
                stop.set()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(running, 60)
    finally:
        if engine_server is not None:
            engine_server.stop()
        if engine is not None:
            engine.close()
