"""One rank of the FSDP tests: `torchrun ... -m tests.trainer.fsdp_worker MODE MODEL_DIR OUT CKPT`.

MODE `train`: three steps (one mini-batch, two mini-batches, one again) on batches planned for
`WORLD_SIZE` ranks, a sharded checkpoint after the second; rank 0 saves, per step, the gradient
the optimizer stepped on (whole, gathered from the shards) and the step's loss, and the whole
weights at the end. MODE `resume`: loads that checkpoint and makes the third step again.
`train-lora` and `resume-lora`: the same with LoRA adapters (`lora_model`), the gradients of the
adapters only, the whole weights with the adapters merged in. `train-dropout` and
`resume-dropout`: the same on the model with attention dropout (`DROPOUT`), so that each step
draws from every rank's random stream.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reins.samples.batch import AdapterConfig, Batch, build_batch
from reins.trainer.backend import BackendConfig, StepStats, TorchBackend
from reins.trainer.fsdp import FSDPBackend
from reins.trainer.ranks import exit_rank
from tests.trainer.reference import split_rollouts

DROPOUT = 0.1
"""The attention dropout of the `-dropout` modes."""


def batches(world: int) -> list[Batch]:
    records = split_rollouts()
    one = AdapterConfig(dp_size=world, max_tokens_per_microbatch=40)
    two = AdapterConfig(dp_size=world, max_tokens_per_microbatch=40, num_minibatches=2)
    return [build_batch(records, one), build_batch(records, two), build_batch(records, one)]


def lora_model(model: Any) -> Any:
    """The model with LoRA adapters, initialised alike on every rank (and in the test)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    adapters = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return get_peft_model(model, adapters)


def step(backend: TorchBackend, batch: Batch) -> tuple[StepStats, list[torch.Tensor]]:
    """One step; the whole gradient of its first optimizer step (after clipping)."""
    taken: list[torch.Tensor] = []
    optimizer_step = backend.optimizer.step

    def taking_step(*args: Any, **kwargs: Any) -> Any:
        if not taken:
            taken[:] = [_whole(p.grad) for p in backend.model.parameters() if p.requires_grad]
        return optimizer_step(*args, **kwargs)

    backend.optimizer.step = taking_step  # type: ignore[method-assign]
    try:
        stats = backend.train_step(batch)
    finally:
        backend.optimizer.step = optimizer_step  # type: ignore[method-assign]
    return stats, taken


@contextlib.contextmanager
def counting_recompute_passes(backend: TorchBackend) -> Iterator[list[int]]:
    """Counts the forwards of the no-grad pass that recomputes the old logprobs."""
    passes = [0]
    recompute, forward = backend._recomputed_old_logprobs, backend._response_logprobs
    inside = [False]

    def counting_forward(*args: Any, **kwargs: Any) -> Any:
        passes[0] += inside[0]
        return forward(*args, **kwargs)

    def counted(*args: Any, **kwargs: Any) -> Any:
        inside[0] = True
        try:
            return recompute(*args, **kwargs)
        finally:
            inside[0] = False

    backend._recomputed_old_logprobs = counted  # type: ignore[method-assign]
    backend._response_logprobs = counting_forward  # type: ignore[method-assign]
    try:
        yield passes
    finally:
        backend._recomputed_old_logprobs = recompute  # type: ignore[method-assign]
        backend._response_logprobs = forward  # type: ignore[method-assign]


def _whole(tensor: Any) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # a shard (DTensor): every rank gathers it
    return (full() if full is not None else tensor).detach().clone()


def main() -> None:
    mode, model_dir, out, checkpoint = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import AutoModelForCausalLM

    dropout = DROPOUT if mode.endswith("-dropout") else 0.0
    mode = mode.removesuffix("-dropout")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attention_dropout=dropout
    )
    if mode.endswith("-lora"):
        mode, model = mode.removesuffix("-lora"), lora_model(model)
    if mode == "publish":  # one step in bf16, then the engine's weights into `checkpoint`
        backend = FSDPBackend(model, BackendConfig(lr=1e-3), param_dtype="bf16")
        step(backend, batches(world)[0])
        backend.save_weights(Path(checkpoint))
        dist.destroy_process_group()
        return
    backend = FSDPBackend(model, BackendConfig(lr=1e-3, grad_clip=1e9))
    plans = batches(world)
    if world > 1:
        uneven = [
            {len(backend._with_gradient(batch, micro)) for micro in plan.micro_batches}
            for batch in plans
            for plan in batch.minibatches
        ]
        assert any(len(counts) > 1 for counts in uneven), "no rank ran an idle pass"
    results: dict[str, Any] = {"losses": [], "gradients": [], "recompute_passes": []}
    if mode == "train":
        for index, batch in enumerate(plans):
            with counting_recompute_passes(backend) as passes:
                stats, gradient = step(backend, batch)
            # Each rank recomputes the old logprobs of its own micro-batches only (a pass as
            # long as the rank with the most), not every sequence of the batch.
            own = sum(
                max(len(backend._with_gradient(batch, micro)) for micro in plan.micro_batches)
                for plan in batch.minibatches
            )
            results["recompute_passes"].append(
                (passes[0], own if len(batch.minibatches) > 1 else 0)
            )
            results["losses"].append(stats.loss)
            results["gradients"].append(gradient)
            if index == 1:
                backend.save_checkpoint(Path(checkpoint))
    else:
        backend.load_checkpoint(Path(checkpoint))
        assert backend.steps_done == 2
        stats, gradient = step(backend, plans[2])
        results["losses"].append(stats.loss)
        results["gradients"].append(gradient)
    results["weights"] = backend.full_state_dict()
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
    exit_rank(0)  # as `reins train` ends a rank: gloo's threads can abort the finalization
