"""`reins controller`: builds a reconciler from the command line, runs the loop until a signal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from reins.client import GatewayClient
from reins.controller.loop import Controller, Reconciler

log = logging.getLogger("reins.controller")


@dataclass
class ControllerOptions:
    """What `reins controller` was asked for (docs/controller.md lists every flag)."""

    runner: Literal["local", "kubernetes"]
    gateway: str
    """The gateway as the controller reaches it."""
    api_key: str
    agent: str | None
    """`module:function` or a command line; a rollout's `config.agent` overrides it."""
    max_parallel: int
    max_attempts: int = 3
    timeout_s: float | None = None
    log_dir: Path = Path(".reins/agents")
    poll_interval_s: float = 0.25
    agent_gateway: str | None = None
    """The gateway as agents reach it, when it differs (a Service name inside a cluster)."""
    namespace: str = "default"
    kubeconfig: Path | None = None
    job_template: Path | None = None
    network_policy_template: Path | None = None
    network_policy: bool = True
    values: Mapping[str, Any] = field(default_factory=dict)
    controller_name: str = "reins"
    creations_per_s: float = 10.0
    preload: bool = True
    """local: `module:function` agents fork from a zygote that imported their module once."""
    log_max_bytes: int | None = None
    """local: each `agent.log` is cut back past this size (None: `local.LOG_MAX_BYTES`)."""

    def __post_init__(self) -> None:
        # Refused at once: these were refused only once the gateway had been tried (and the
        # log folder made, the cluster reached), so a gateway down meant a wait for a typo.
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be at least 1, not {self.max_attempts}")
        if self.max_parallel < 1:
            raise ValueError(f"--max-parallel must be at least 1, not {self.max_parallel}")
        if self.log_max_bytes is not None:
            from reins.controller.loop import TAIL_BYTES

            if self.log_max_bytes < 4 * TAIL_BYTES:
                raise ValueError(
                    f"--log-max-bytes must be at least {4 * TAIL_BYTES} (four times the tail "
                    f"an ended attempt reports), not {self.log_max_bytes}"
                )


def parse_values(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs; each VALUE is read as YAML (`3`, `[a, b]`, `{k: v}`, text)."""
    values: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--set {pair!r}: write --set KEY=VALUE")
        try:
            values[name.strip()] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as error:
            problem = str(error).replace("\n", " ")
            raise ValueError(f"--set {pair!r}: its value is not YAML ({problem})") from error
    return values


def build_reconciler(options: ControllerOptions) -> Reconciler:
    agent_gateway = options.agent_gateway or options.gateway
    if options.runner == "local":
        from reins.controller.local import LocalReconciler

        if not options.agent:
            raise ValueError(
                "--agent is required with --runner local (module:function or a command)"
            )
        from reins.controller.local import LOG_MAX_BYTES

        return LocalReconciler(
            options.agent,
            options.max_parallel,
            options.log_dir,
            preload=options.preload,
            log_max_bytes=options.log_max_bytes or LOG_MAX_BYTES,
        )
    from reins.controller.kubernetes import KubernetesReconciler
    from reins.controller.templates import (
        DEFAULT_JOB_TEMPLATE,
        DEFAULT_NETWORK_POLICY_TEMPLATE,
    )

    policy: str | None = None
    if options.network_policy:
        policy = (
            _template(options.network_policy_template, "--network-policy-template")
            if options.network_policy_template
            else DEFAULT_NETWORK_POLICY_TEMPLATE
        )
    job_template = (
        _template(options.job_template, "--job-template")
        if options.job_template
        else DEFAULT_JOB_TEMPLATE
    )
    return KubernetesReconciler(
        namespace=options.namespace,
        gateway_url=agent_gateway,
        kubeconfig=options.kubeconfig,
        agent=options.agent,
        job_template=job_template,
        network_policy_template=policy,
        values=options.values,
        controller_name=options.controller_name,
        max_parallel=options.max_parallel,
        creations_per_s=options.creations_per_s,
        log_dir=options.log_dir,
    )


def _template(path: Path, flag: str) -> str:
    """A template file's text; ValueError saying which flag names what it cannot read."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{flag} {path}: cannot read it ({error})") from None


STOP_GRACE_S = 5.0
"""How long a stop (SIGINT, SIGTERM) waits for a reconcile pass in progress."""


async def serve(options: ControllerOptions) -> None:
    """Runs the controller until SIGINT or SIGTERM (local agents are then killed)."""
    reconciler = build_reconciler(options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with GatewayClient(options.gateway, options.api_key) as client:
        if not await client.healthz():
            log.warning("the gateway at %s does not answer yet; retrying", options.gateway)
        controller = Controller(
            client,
            reconciler,
            gateway_url=options.agent_gateway or options.gateway,
            max_attempts=options.max_attempts,
            default_timeout_s=options.timeout_s,
            poll_interval_s=options.poll_interval_s,
        )
        log.info(
            "controller up: runner %s, %d at a time, gateway %s",
            options.runner,
            options.max_parallel,
            options.gateway,
        )
        run = asyncio.ensure_future(controller.run(stop))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({run, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not run.done():
                # A pass waiting on a gateway that does not answer retries its call for two
                # minutes, and the stop waited as long: it now waits a few seconds for the pass,
                # then cuts it (the run's own `finally` still stops the agents).
                await asyncio.wait({run}, timeout=STOP_GRACE_S)
                run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
        finally:
            stopped.cancel()
        stats = controller.stats
        log.info(
            "controller stopped: %d launched, %d succeeded, %d retried, %d failed, %d adopted",
            stats.launched,
            stats.succeeded,
            stats.retried,
            stats.failed,
            stats.adopted,
        )


def main(options: ControllerOptions) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    asyncio.run(serve(options))
