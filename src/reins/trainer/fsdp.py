"""The FSDP2 backend: parameters, gradients and AdamW states sharded across ranks.

`torch.distributed.fsdp.fully_shard` on each decoder layer and on the whole model, launched by
`torchrun` (gloo on CPU, nccl on GPU). The loss is `TorchBackend`'s: the per-token weights of
`reins.samples` carry every denominator, so gradients are reduce-scattered as a SUM (divide
factor 1) and nothing is averaged; 2 ranks give the gradient of 1 (tests/trainer/test_fsdp.py).

FSDP gathers a layer's weights in its forward and reduces its gradients in its backward: every
rank must run as many passes as the others. A rank with fewer micro-batches (after the sequences
without a gradient are cut) runs passes on no data, with a zero loss, until they are even.

Checkpoints are sharded (`torch.distributed.checkpoint`: each rank writes its own shard, and a
checkpoint may be loaded on another number of ranks); with LoRA they hold the adapters only.
Each rank's random state is saved beside its shard (`rng/rank-N.json`) and restored by the same
rank, so a resumed run draws the dropout masks an unbroken one would.
`save_weights` gathers the full weights on rank 0 (LoRA merged in, `lora.py`) and writes a
Hugging Face folder an engine loads.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as load_sharded
from torch.distributed.checkpoint.state_dict_saver import save as save_sharded
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from reins.filemodes import readable_as_umask_allows
from reins.trainer import checkpoint
from reins.trainer.backend import BackendConfig, Packed, ResponseLogits, TorchBackend
from reins.trainer.lora import is_lora, merged_state

log = logging.getLogger(__name__)

ParamDtype = Literal["fp32", "bf16"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (LoRA-wrapped or not), or of the one a
    `ResponseLogits` runs."""
    if isinstance(model, ResponseLogits):
        model = model.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(base.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(base).__name__} has no `layers` in its decoder: the FSDP backend shards "
            "one unit per transformer block and cannot find them"
        )
    return list(layers)


def shard(model: Any, *, param_dtype: ParamDtype = "fp32") -> Any:
    """`fully_shard` each decoder layer, then the rest (embeddings, final norm, LM head).

    `param_dtype` is the precision of the gathered weights in forward and backward; the
    sharded master weights, the optimizer and the gradient reduction stay in fp32.
    """
    policy = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    gloo = dist.get_backend() == "gloo"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # A SUM, not FSDP's default mean over ranks: the loss weights already divide.
            module.set_gradient_divide_factor(1.0)
            if gloo:
                # gloo has no PREMUL_SUM; a plain SUM with the factor 1 is the same reduction.
                module.set_force_sum_reduction_for_comms(True)
    return model


class FSDPBackend(TorchBackend):
    """`TorchBackend`'s update on a model sharded with FSDP2 across the default process group.

    Build the model unsharded on every rank (the same weights: load the same folder); the
    backend shards it in place. `rank` and `world_size` are the process group's.
    """

    def __init__(self, model: Any, config: BackendConfig, *, param_dtype: ParamDtype = "fp32"):
        if not dist.is_initialized():
            raise RuntimeError(
                "the FSDP backend needs a process group: run under torchrun, or call "
                "torch.distributed.init_process_group first"
            )
        self.param_dtype = param_dtype
        super().__init__(model, config, rank=dist.get_rank(), world_size=dist.get_world_size())

    def _distribute(self, forward: ResponseLogits) -> Any:
        return shard(forward, param_dtype=self.param_dtype)

    def _idle_passes(self, work: list[list[list[int]]]) -> int:
        return max(len(rank_work) for rank_work in work) - len(work[self.rank])

    def _idle_pass(self) -> None:
        """One forward and backward on a two-token row with a zero loss: the same collectives as
        a real micro-batch (each layer gathered, its zero gradient reduced), no change to any
        sum."""
        idle = self._idle_row()
        logprobs, _ = self._response_logprobs(self.policy, idle, with_entropy=False)
        if self.reference is not None:
            with torch.no_grad():
                self._response_logprobs(self.reference, idle, with_entropy=False)
        (logprobs.sum() * 0.0).backward()  # type: ignore[no-untyped-call]

    def _idle_forward(self) -> None:
        """A forward on the idle row: the collectives of a real no-grad pass (each layer
        gathered), for a rank with fewer sequences to recompute than another."""
        with torch.no_grad():
            self._response_logprobs(self.policy, self._idle_row(), with_entropy=False)

    def _idle_row(self) -> Packed:
        row = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        return Packed(
            input_ids=row,
            attention_mask=torch.ones_like(row),
            response_positions=torch.ones((1, 1), dtype=torch.bool, device=self.device),
            targets=torch.zeros(1, dtype=torch.long, device=self.device),
            weights=torch.zeros(1, device=self.device),
            old=torch.zeros(1, device=self.device),
            advantages=torch.zeros(1, device=self.device),
            trained_tokens=0,
        )

    def _all_reduce(self, gradient: torch.Tensor) -> None:
        """FSDP reduced the gradients in the backward already."""

    def _norm(self, norm: torch.Tensor) -> float:
        full = getattr(norm, "full_tensor", None)
        return float(full() if full is not None else norm)

    # -- checkpoints: sharded, one file per rank ---------------------------------------------

    def save_checkpoint(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        # Taken first: nothing the save does may move it. Each rank draws its own dropout
        # masks, on its own micro-batches: rank 0's state alone (in `trainer.json`) left the
        # others to resume on a fresh stream, unlike an unbroken run.
        rng = json.dumps(checkpoint.capture_rng(), default=checkpoint.plain)
        save_sharded(self._state(), checkpoint_id=folder / "sharded")
        own = checkpoint.rank_rng_file(folder, self.rank)
        own.parent.mkdir(exist_ok=True)
        own.write_text(rng)
        if self.rank == 0:
            (folder / "backend.json").write_text(
                json.dumps({"steps_done": self.steps_done, "world_size": self.world_size})
            )
        dist.barrier()

    def load_checkpoint(self, folder: Path) -> None:
        """Loads the weights and optimizer (resharded when the checkpoint was written by
        another number of ranks), then this rank's random state: on as many ranks as wrote
        it, each rank's own; on another number, the ranks that have a saved state of their
        number restore it and the others keep theirs (the batches split otherwise across ranks
        then: no run would draw as the unbroken one did), with a warning."""
        if not (folder / "sharded").is_dir():
            raise ValueError(
                f"checkpoint {folder} has no sharded state: it was not written by the FSDP "
                "backend (a single-process checkpoint holds model.pt and optimizer.pt)"
            )
        state = self._state()
        load_sharded(state, checkpoint_id=folder / "sharded")
        keys = set_model_state_dict(
            self.model, state["model"], options=StateDictOptions(strict=False)
        )
        trained = set(keys.missing_keys) - self._frozen()
        if trained or keys.unexpected_keys:
            raise ValueError(
                f"checkpoint {folder} does not fit this model: missing {sorted(trained)[:3]}, "
                f"unexpected {sorted(keys.unexpected_keys)[:3]}"
            )
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        saved = json.loads((folder / "backend.json").read_text())
        self.steps_done = saved["steps_done"]
        self._restore_rng(folder, saved.get("world_size"))

    def _restore_rng(self, folder: Path, saved_world: int | None) -> None:
        own = checkpoint.rank_rng_file(folder, self.rank)
        if saved_world != self.world_size and self.rank == 0:
            log.warning(
                "checkpoint %s was written by %s ranks, this run has %d: the weights and "
                "optimizer are resharded; ranks with a saved random state of their number "
                "restore it, the others' random streams (dropout) start afresh",
                folder,
                saved_world if saved_world is not None else "an unknown number of",
                self.world_size,
            )
        if not own.is_file():
            if saved_world == self.world_size and self.rank == 0:
                log.warning(
                    "checkpoint %s holds no rank's random state (written before they were "
                    "kept): the ranks' random streams (dropout) start afresh",
                    folder,
                )
            return
        try:
            rng = json.loads(own.read_text())
            checkpoint.check_rng(rng)
        except ValueError as error:
            raise ValueError(
                f"checkpoint {folder}: {own.name} cannot be restored: {error}"
            ) from error
        checkpoint.restore_rng(rng)

    def _state(self) -> dict[str, Any]:
        # Frozen weights (LoRA's base) never change: a checkpoint holds what trains. Filtered
        # here by every name of each frozen weight: `ignore_frozen_params` keeps a tied one's
        # second name (`lm_head.weight`, the frozen embeddings again).
        frozen = self._frozen()
        model = get_model_state_dict(self.model)
        return {
            "model": {name: value for name, value in model.items() if name not in frozen},
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
        }

    def _frozen(self) -> set[str]:
        """Every name of every weight that does not train."""
        return {
            name
            for name, parameter in self.model.named_parameters(remove_duplicate=False)
            if not parameter.requires_grad
        }

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's weights on rank 0's CPU (empty on the others), as the base model
        names them, LoRA adapters merged in; every rank calls it."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state: dict[str, Any] = get_model_state_dict(self.model, options=options)
        if self.rank == 0 and is_lora(self.model):
            return merged_state(self.model, state)
        return state

    def save_weights(self, folder: Path) -> None:
        """The whole model for an engine: in the precision it computes in (`param_dtype`; the
        fp32 master weights doubled every publish's bytes), each tied weight once (gathered, a
        tied weight's names are separate copies, and both were saved)."""
        state = self.full_state_dict()
        if self.rank == 0:
            base = self.model.get_base_model() if is_lora(self.model) else self.model
            every = {name for name, _ in base.named_parameters(remove_duplicate=False)}
            aliases = every - {name for name, _ in base.named_parameters()}
            dtype = _DTYPES[self.param_dtype]
            state = {
                name: value.to(dtype) if value.is_floating_point() else value
                for name, value in state.items()
                if name not in aliases
            }
            base.save_pretrained(folder, state_dict=state, safe_serialization=True)
            readable_as_umask_allows(folder)
        dist.barrier()
