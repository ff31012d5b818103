"""One rank of the data-parallel test: `torchrun ... -m tests.trainer.dp_worker MODEL_DIR OUT`.

Every rank builds the same batch planned for `WORLD_SIZE` ranks, runs its own micro-batches and
all-reduces gradients by SUM, with lr 0 and no norm clipping so that the gradient stays as it
was summed; rank 0 saves it.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from reins.samples.batch import AdapterConfig, build_batch
from reins.trainer.backend import BackendConfig, TorchBackend
from reins.trainer.ranks import exit_rank
from tests.trainer.reference import split_rollouts, stepped_gradient


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = BackendConfig(lr=0.0, grad_clip=math.inf)
    backend = TorchBackend(model, config, rank=rank, world_size=world)
    batch = build_batch(
        split_rollouts(), AdapterConfig(dp_size=world, max_tokens_per_microbatch=40)
    )
    assert all(plan.micro_batches[rank] for plan in batch.minibatches), "a rank got no data"
    gradient = stepped_gradient(backend, batch)
    # The old logprobs a correction weighs: each rank computes its own micro-batches', and
    # every rank gets all of them (lr 0: the weights are the initial ones still).
    shared = backend._recomputed_old_logprobs(batch, share=True)
    if rank == 0:
        torch.save({"gradient": gradient, "old_logprobs": shared}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
    exit_rank(0)  # as `reins train` ends a rank: gloo's threads can abort the finalization
