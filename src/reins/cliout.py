"""What the command line prints: rich markup for its own words, never for the text it quotes."""

from __future__ import annotations

from rich.markup import escape


def error_line(message: object) -> str:
    """`error: MESSAGE`, the word in red and the message shown as it is: a `[/x]` in a path, an
    id or a server's answer was read as markup (a MarkupError traceback, or words dropped)."""
    return f"[red]error:[/red] {escape(str(message))}"


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`1 rollout`, `2 rollouts`: a count with its noun in the number it takes."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
