"""List helpers."""

from typing import Any


def chunk(items: list[Any], size: int) -> list[list[Any]]:
    """Consecutive pieces of `size` items (the last one may be shorter)."""
    if size < 1:
        raise ValueError("size must be >= 1")
    return [items[start : start + size] for start in range(0, len(items), size)]


def flatten(nested: list[list[Any]]) -> list[Any]:
    """One level of nesting removed."""
    return [item for inner in nested for item in inner]


def dedupe(items: list[Any]) -> list[Any]:
    """Items without repeats, in order of first appearance."""
    seen = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def rotate(items: list[Any], steps: int) -> list[Any]:
    """Items moved `steps` places to the left (to the right when negative)."""
    if not items:
        return []
    steps %= len(items)
    return items[steps:] + items[:steps]


def windows(items: list[Any], size: int) -> list[list[Any]]:
    """Every run of `size` consecutive items."""
    return [items[start : start + size] for start in range(len(items) - size + 1)]
