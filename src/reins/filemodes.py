"""File modes as a plain `open` would give them: libraries that write model files (safetensors,
transformers) make some 0600, and an engine or user of another account could not read them."""

from __future__ import annotations

import contextlib
from pathlib import Path


def process_umask() -> int:
    """The process's umask, read without setting it: `os.umask(0)` and back sets it for every
    thread, and a file another thread created meanwhile (the engine, the trainer, a harness in
    the same process) was left world-writable."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def readable_as_umask_allows(folder: Path) -> None:
    """Gives each file of `folder` the mode a plain `open` would have (0666 less the umask)."""
    mode = 0o666 & ~process_umask()
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(mode)
