"""One rank of the data-parallel test: `torchrun ... -m tests.trainer.dp_worker MODEL_DIR OUT`.

Every rank builds the same batch planned for `WORLD_SIZE` ranks, trains on its own micro-batches,
all-reduces gradients by SUM, steps; rank 0 saves the parameters.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from reins.trainer.backend import BackendConfig, TorchBackend
from tests.trainer.batches import make_batch


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    backend = TorchBackend(model, BackendConfig(lr=1e-3), rank=rank, world_size=world)
    batch = make_batch(groups=2, per_group=4, dp_size=world, micro_tokens=40)
    assert all(plan.micro_batches[rank] for plan in batch.minibatches), "a rank got no data"
    backend.train_step(batch)
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
