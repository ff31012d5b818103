"""One rank for tests/trainer/test_rank_exit.py, started with torch.distributed's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): `python -m tests.trainer.exit_worker CODE MARK`.

It does what a rank of `reins train --backend fsdp` does last: collectives on tensors Python
made, a barrier, `destroy_process_group` while something still holds the group (FSDP's device
mesh does), then `exit_rank(CODE)`. An exit handler writes MARK-<rank>, and a line goes to
stdout with no newline (so no line buffer's flush).
"""

from __future__ import annotations

import atexit
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from reins.trainer.ranks import exit_rank

HELD: list[object] = []


def main() -> None:
    code, mark = int(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    atexit.register(lambda: mark.with_name(f"{mark.name}-{rank}").write_text("ran"))
    HELD.append(dist.group.WORLD)
    for _ in range(20):
        part = torch.ones(100_000)
        whole = torch.empty(100_000 * dist.get_world_size())
        dist.all_gather_into_tensor(whole, part, async_op=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", end="")
    exit_rank(code)


if __name__ == "__main__":
    main()
