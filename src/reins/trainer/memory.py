"""The trainer process's peak memory, as each step reports it (`memory/peak_rss_mb`, and
`memory/peak_gpu_mb` on a GPU)."""

from __future__ import annotations

import resource
import sys


def peak_rss_mb() -> float:
    """The process's peak resident memory so far, in MB: the kernel's high-water mark (VmHWM)
    on Linux. Not `ru_maxrss` there: a child inherits its parent's at fork and keeps it across
    exec, so a small process started by a large one would report the large one's peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes there, else KiB


def peak_gpu_mb() -> float | None:
    """The most GPU memory torch held at once on this process's device so far, in MB (None
    without a GPU): weights, gradients, optimizer states and activations of the trainer, and
    the embedded engine's KV when it shares the process."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    return float(torch.cuda.max_memory_allocated()) / 2**20
