"""`reins swe prepare`: the coding-agent task pipeline (reins.swe.prepare) on the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from reins.cliout import error_line

swe_app = typer.Typer(
    help="Coding-agent tasks (SWE-smith format).", no_args_is_help=True, rich_markup_mode=None
)
console = Console(stderr=True, soft_wrap=True, highlight=False)


@swe_app.command("prepare")
def prepare_command(
    config: Annotated[Path, typer.Argument(help="The prepare config (examples/swe/prepare.yaml).")],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", metavar="KEY=VALUE", help="Override a field: --set attempts=2"),
    ] = None,
) -> None:
    """Filter SWE-smith task instances as the paper does (empty statements, missing problem
    branches, too many tests; then the policy's own difficulty, k attempts per task), split
    them, and write train.jsonl, test.jsonl and report.json."""
    import logging

    from reins.swe.instances import InstanceError
    from reins.swe.prepare import PrepareError, load_prepare_config, prepare

    logging.basicConfig(level=logging.WARNING)
    try:
        loaded = load_prepare_config(config, set_)
    except PrepareError as error:
        console.print(error_line(f"{error}"))
        raise typer.Exit(2) from error
    columns = (
        TextColumn("difficulty rollouts"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("rollouts", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        try:
            prepare(loaded, say=console.print, progress=progress)
        except (PrepareError, InstanceError, OSError) as error:  # an `out` that is a file
            console.print(error_line(f"{error}"))
            raise typer.Exit(2) from error
