"""What the C allocator keeps: glibc's settings that decide whether freed memory goes back to the
system (docs/benchmarks.md, "Trainer memory").

glibc serves a block of at least its *mmap threshold* from a memory map of its own, unmapped
(handed back) when freed; smaller blocks come from an arena, which keeps what is freed for
later. The threshold is dynamic by default: each mapped block freed raises it to that block's
size, up to 32 MB, so after the first step nearly every tensor lives in an arena, and what one
phase frees (a forward's transients, a generation's KV) stays resident while the next phase
allocates elsewhere. Elsewhere than glibc, each function here does nothing."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number (glibc's malloc.h)."""
ENVIRONMENT_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_")
"""Settings a user may have exported: each one also fixes glibc's threshold, so they win."""


@functools.cache
def _glibc() -> Any | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 - both exist in glibc only
    except (OSError, AttributeError):
        return None
    return libc


def return_freed_memory() -> None:
    """Hands the memory the allocator holds free, in every arena, back to the system."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def map_large_blocks(threshold_mb: float) -> bool:
    """Fixes glibc's mmap threshold at `threshold_mb`: blocks at least that large (a step's
    activations, logits and KV) get their own map and go back to the system when freed.
    Returns whether it was set: not elsewhere than glibc, nor when the environment already
    sets glibc's thresholds (the user's choice is kept)."""
    if threshold_mb <= 0:
        raise ValueError(f"the mmap threshold must be positive, not {threshold_mb} MB")
    chosen = [name for name in ENVIRONMENT_SETTINGS if name in os.environ]
    if "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        log.info("glibc's mmap threshold left as %s set it", ", ".join(chosen))
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold_mb * 2**20)))
