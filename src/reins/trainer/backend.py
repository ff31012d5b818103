"""The torch backend: PPO-clip on the per-token weights of `reins.samples`, on one machine or
data-parallel under torchrun.

The step's loss is `sum(loss_weight * token_loss)` over every token of the batch: the weights
already carry every denominator (docs/samples.md), so micro-batch losses are added as they are and
ranks all-reduce gradients by SUM; nothing is averaged afterwards. That is why 2 ranks give the
same update as 1 on the same batch (tests/trainer/test_distributed.py).
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from reins.filemodes import readable_as_umask_allows
from reins.samples.batch import Batch, TrainingSequence
from reins.trainer.correction import CorrectionStats, correction_weights
from reins.trainer.entropy import entropy as entropy_of

log = logging.getLogger(__name__)


class BackendConfig(BaseModel):
    """What the backend needs of the run's config (see `TrainConfig` for each field's meaning)."""

    model_config = ConfigDict(extra="ignore")

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    tis_cap: float | None = None
    rollout_mask_ratio: float | None = None
    kl_to_initial: bool = False
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    gradient_checkpointing: bool = True
    temperature: float = 1.0
    """The sampling temperature of `train` calls: the policy is softmax(logits / temperature), as
    the engine's logprobs are."""


@dataclass
class StepStats:
    """Weighted means over the step's response tokens (weights: the loss weights)."""

    loss: float = 0.0
    """The mean of the optimizer steps' losses."""
    entropy: float = 0.0
    clip_fraction: float = 0.0
    logprob_gap: float | None = None
    """Mean |rollout logprob - trainer logprob| before the update, where the engine gave one."""
    kl_initial: float | None = None
    grad_norm: float = 0.0
    response_tokens: int = 0
    trained_tokens: int = 0
    optimizer_steps: int = 0
    """0: the weights did not change (every advantage 0, or every gradient non-finite): the
    trainer then publishes no new version, and the rollouts in flight do not age."""
    nonfinite_steps: int = 0
    """Optimizer steps not taken: the gradient held an inf or a NaN (one step would have made
    every weight NaN)."""
    skipped_sequences: int = 0
    """Sequences with advantage 0 (and no KL penalty or entropy bonus): no gradient, so no
    forward or backward."""
    correction: CorrectionStats | None = None
    """The importance correction's figures, when one is on."""

    def as_metrics(self) -> dict[str, float]:
        out = {
            "loss": self.loss,
            "policy/grad_norm": self.grad_norm,
            "policy/optimizer_steps": float(self.optimizer_steps),
            "policy/nonfinite_steps_skipped": float(self.nonfinite_steps),
        }
        if self.response_tokens:  # measured on the sequences that were run
            out["policy/entropy"] = self.entropy
            out["policy/clip_fraction"] = self.clip_fraction
        if self.logprob_gap is not None:
            out["policy/logprob_gap"] = self.logprob_gap
        if self.kl_initial is not None:
            out["policy/kl_initial"] = self.kl_initial
        if self.correction is not None:
            out.update(self.correction.as_metrics())
        return out


class Backend(Protocol):
    """Turns a batch of samples into a policy update."""

    def train_step(
        self, batch: Batch, version_lags: Mapping[int, int] | None = None
    ) -> StepStats: ...

    def save_checkpoint(self, folder: Path) -> None: ...

    def load_checkpoint(self, folder: Path) -> None: ...

    def save_weights(self, folder: Path) -> None: ...


@dataclass
class _Sums:
    """Running weighted sums over the response tokens seen so far."""

    weight: float = 0.0
    loss: float = 0.0
    entropy: float = 0.0
    clipped: float = 0.0
    kl: float = 0.0
    gap: float = 0.0
    gap_tokens: int = 0
    tokens: int = 0
    trained: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class TorchBackend:
    """AdamW on a Hugging Face causal LM (optionally LoRA), PPO-clip loss, SUM all-reduce."""

    def __init__(self, model: Any, config: BackendConfig, *, rank: int = 0, world_size: int = 1):
        self.config = config
        self.rank = rank
        self.world_size = world_size
        if config.gradient_checkpointing:
            # transformers 5 renamed it (the old name warns); older releases have the old one.
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        self.reference: Any = None
        """The initial policy's `ResponseLogits`, when a KL to it is measured."""
        if config.kl_to_initial or config.kl_coef > 0:
            initial = copy.deepcopy(model).eval().requires_grad_(False)
            self.reference = self._distribute(ResponseLogits(initial))
        self.model = model
        self.policy = self._distribute(ResponseLogits(model))
        """The forward the loss runs (the model's own weights, shared)."""
        self.device = next(self.model.parameters()).device
        self.dropout = drops_units(model)
        """Whether the model drops units while it trains (`lora.dropout`, a model's own
        dropout): its logprobs from the update's forward are then not the policy's, which the
        engine served without dropout, so those compared with the engine's are taken in a pass
        of their own, in eval mode."""
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        if not self.parameters:
            raise ValueError("the model has no trainable parameter")
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.steps_done = 0

    def _distribute(self, forward: ResponseLogits) -> Any:
        """The forward as this backend runs it: as it is here (DDP all-reduces by hand)."""
        return forward

    # -- the update ------------------------------------------------------------------------

    def train_step(self, batch: Batch, version_lags: Mapping[int, int] | None = None) -> StepStats:
        """One update on `batch`. `version_lags` (serving version -> updates behind the weights
        trained now) sorts the correction's logprob gaps by lag."""
        self._check_plan(batch)
        sums = _Sums()
        skipped = 0
        config = self.config
        correcting = config.tis_cap is not None or config.rollout_mask_ratio is not None
        correction: CorrectionStats | None = None
        multipliers: list[np.ndarray[Any, Any]] | None = None
        self.model.train()
        # Token-level TIS alone weighs each token by its own ratio: with one mini-batch on one
        # rank the forward's detached logprobs are the recomputed ones, so it needs no pass of
        # its own (the rollout mask needs a whole rollout's tokens before any of its loss).
        inline = (
            correcting
            and config.rollout_mask_ratio is None
            and self.world_size == 1
            and not self._needs_recompute(batch)
        )
        seen: list[np.ndarray[Any, Any] | None] = [None] * len(batch.sequences)
        try:
            recompute = (correcting and not inline) or self._needs_recompute(batch)
            # The mask weighs a rollout's tokens on every rank, wherever they trained.
            share = correcting and not inline
            old = self._recomputed_old_logprobs(batch, share=share) if recompute else None
            if correcting and not inline:
                assert old is not None
                computed = [
                    o if self._contributes(s) else None
                    for s, o in zip(batch.sequences, old, strict=True)
                ]
                multipliers, correction = correction_weights(
                    batch.sequences,
                    computed,
                    tis_cap=config.tis_cap,
                    mask_ratio=config.rollout_mask_ratio,
                    version_lags=version_lags,
                )
            grad_norms = []
            for position, plan in enumerate(batch.minibatches):
                self.optimizer.zero_grad(set_to_none=True)
                work = [self._with_gradient(batch, micro) for micro in plan.micro_batches]
                # Over the whole batch: every rank holds it.
                skipped += sum(len(m) for rank in plan.micro_batches for m in rank)
                skipped -= sum(len(kept) for rank in work for kept in rank)
                if not any(work):
                    # No sequence of the mini-batch, on any rank, has a gradient: no step. On a
                    # zero gradient AdamW would still move every weight (its momentum, ~0.9x
                    # the last update, and weight decay): a run of all-equal-reward steps would
                    # drift the policy with no signal. Every rank holds the whole batch, so all
                    # decide alike and stay in lockstep.
                    continue
                for kept in work[self.rank]:
                    sequences = [batch.sequences[i] for i in kept]
                    olds = [old[i] for i in kept] if old is not None else None
                    weighed = [multipliers[i] for i in kept] if multipliers is not None else None
                    trainer_logprobs = self._accumulate(
                        sequences,
                        olds,
                        sums,
                        # Recomputed, the logprobs before the update are known for every
                        # mini-batch; otherwise only the first runs on those weights.
                        measure_gap=position == 0 or old is not None,
                        multipliers=weighed,
                        inline_tis=inline,
                    )
                    if inline:
                        for index, logprobs in zip(kept, trainer_logprobs, strict=True):
                            seen[index] = logprobs
                for _ in range(self._idle_passes(work)):
                    self._idle_pass()
                grad_norms.append(self._step())
            self.steps_done += 1
            if inline:  # the statistics of the weights the micro-batches applied
                _, correction = correction_weights(
                    batch.sequences,
                    seen,
                    tis_cap=config.tis_cap,
                    mask_ratio=None,
                    version_lags=version_lags,
                )
        finally:
            # The gradients (one more copy of the weights) are not kept while rollouts run.
            self.optimizer.zero_grad(set_to_none=True)
            self.model.eval()
        if self.world_size > 1:
            self._sum_over_ranks(sums)
        stepped = [norm for norm in grad_norms if math.isfinite(norm)]
        weight = max(sums.weight, 1e-12)
        return StepStats(
            # Each mini-batch's weights are normalized over its own rollouts (sequences,
            # tokens): its loss is a mean already; their sum grew with `num_minibatches`.
            loss=sums.loss / max(len(grad_norms), 1),
            entropy=sums.entropy / weight,
            clip_fraction=sums.clipped / weight,
            logprob_gap=sums.gap / sums.gap_tokens if sums.gap_tokens else None,
            kl_initial=sums.kl / weight if self.reference is not None else None,
            grad_norm=float(np.mean(stepped)) if stepped else 0.0,
            response_tokens=sums.tokens,
            trained_tokens=sums.trained,
            optimizer_steps=len(stepped),
            nonfinite_steps=len(grad_norms) - len(stepped),
            skipped_sequences=skipped,
            correction=correction,
        )

    def _sum_over_ranks(self, sums: _Sums) -> None:
        """The step's figures over the whole batch, not this rank's share."""
        names = [
            *("weight", "loss", "entropy", "clipped", "kl"),
            *("gap", "gap_tokens", "tokens", "trained"),
        ]
        values = torch.tensor([float(getattr(sums, name)) for name in names], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        for name, value in zip(names, values.tolist(), strict=True):
            setattr(sums, name, type(getattr(sums, name))(value))

    def _check_plan(self, batch: Batch) -> None:
        """A batch planned for another number of ranks would train a part of its sequences
        (each rank runs only its own share) or fail on a missing share: refused."""
        for plan in batch.minibatches:
            if len(plan.micro_batches) != self.world_size:
                raise ValueError(
                    f"the batch was planned for {len(plan.micro_batches)} data-parallel rank(s) "
                    f"(AdapterConfig.dp_size) but this backend trains on {self.world_size}: "
                    f"plan it with dp_size={self.world_size}"
                )

    def _with_gradient(
        self, batch: Batch, micro_batches: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """A rank's micro-batches cut to the sequences that have a gradient, empty ones left
        out."""
        out = []
        for micro in micro_batches:
            kept = [i for i in micro if self._contributes(batch.sequences[i])]
            if kept:
                out.append(kept)
        return out

    def _idle_passes(self, work: list[list[list[int]]]) -> int:
        """Passes this rank runs with no data so that every rank runs as many: none here (a DDP
        rank all-reduces once per step, whatever it ran)."""
        return 0

    def _idle_pass(self) -> None:
        raise NotImplementedError

    def _idle_forward(self) -> None:
        raise NotImplementedError

    def _contributes(self, sequence: TrainingSequence) -> bool:
        """Whether the sequence has a gradient: PPO's token loss is 0 for advantage 0, so only
        a KL penalty or an entropy bonus would give one. Skipping the others changes no weight:
        the optimizer steps on the same (summed) gradient, or not at all when no sequence of the
        mini-batch has one; a group whose rollouts all got the same reward costs nothing."""
        return sequence.advantage != 0 or self.config.kl_coef > 0 or self.config.entropy_coef > 0

    def _needs_recompute(self, batch: Batch) -> bool:
        # With one mini-batch, the weights have not moved when each micro-batch runs its forward:
        # the recomputed logprobs are the forward's own, detached; no extra pass is needed.
        # Unless that forward drops units: then they are a noisy draw, not the policy's.
        if self.dropout:
            return True
        return self.config.old_logprobs == "recompute" and len(batch.minibatches) > 1

    def _step(self) -> float:
        for parameter in self.parameters:
            # A rank that ran no sequence of a mini-batch others did still steps, on a zero
            # gradient, before the SUM: all ranks stay in lockstep.
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            self._all_reduce(parameter.grad)
        norm = self._norm(torch.nn.utils.clip_grad_norm_(self.parameters, self.config.grad_clip))
        if math.isfinite(norm):
            # The norm is the whole model's (after the all-reduce): every rank decides alike.
            self.optimizer.step()
        return norm

    def _all_reduce(self, gradient: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(gradient, op=dist.ReduceOp.SUM)

    def _norm(self, norm: torch.Tensor) -> float:
        return float(norm)

    def _accumulate(
        self,
        sequences: list[TrainingSequence],
        olds: list[np.ndarray[Any, Any]] | None,
        sums: _Sums,
        *,
        measure_gap: bool,
        multipliers: list[np.ndarray[Any, Any]] | None = None,
        inline_tis: bool = False,
    ) -> list[np.ndarray[Any, Any]]:
        """Adds the micro-batch's loss gradient; returns each sequence's logprobs under the
        trainer (aligned with its `token_ids`) when `inline_tis`, else nothing."""
        tensors = _pack(sequences, self.device)
        logprobs, entropy = self._response_logprobs(self.policy, tensors, with_entropy=True)
        weight = tensors.weights
        aligned: list[np.ndarray[Any, Any]] = []
        if inline_tis:
            aligned = _scatter_response(logprobs.detach(), sequences, tensors)
            multipliers, _ = correction_weights(
                sequences, aligned, tis_cap=self.config.tis_cap, mask_ratio=None
            )
        if multipliers is not None:  # the importance correction's, per token
            weight = weight * _gather_response(multipliers, tensors, self.device)
        rollout_old = tensors.old
        # The trainer's logprobs before the update: the pass that recomputed them (several
        # mini-batches, a correction's, or a model with dropout: eval mode), or this forward's.
        before = (
            _gather_response(olds, tensors, self.device) if olds is not None else logprobs.detach()
        )
        if self.config.old_logprobs == "rollout":
            old = torch.where(torch.isnan(rollout_old), before, rollout_old)
        else:
            old = before
        ratio = torch.exp(logprobs - old)
        advantage = tensors.advantages
        unclipped = -advantage * ratio
        clipped = -advantage * ratio.clamp(1 - self.config.clip_low, 1 + self.config.clip_high)
        token_loss = torch.maximum(unclipped, clipped)
        loss = (weight * token_loss).sum()
        kl = None
        if self.reference is not None:
            with torch.no_grad():
                reference, _ = self._response_logprobs(self.reference, tensors, with_entropy=False)
            delta = reference - logprobs
            kl = torch.exp(delta) - delta - 1  # k3: unbiased, non-negative
            if self.config.kl_coef > 0:
                loss = loss + self.config.kl_coef * (weight * kl).sum()
        if self.config.entropy_coef > 0:
            loss = loss - self.config.entropy_coef * (weight * entropy).sum()
        loss.backward()  # type: ignore[no-untyped-call]

        with torch.no_grad():
            sums.weight += float(weight.sum())
            sums.loss += float(loss)
            sums.entropy += float((weight * entropy).sum())
            sums.clipped += float((weight * (clipped > unclipped).float()).sum())
            if kl is not None:
                sums.kl += float((weight * kl).sum())
            sums.tokens += int(logprobs.numel())
            sums.trained += tensors.trained_tokens
            if measure_gap:
                known = ~torch.isnan(rollout_old)
                sums.gap += float((rollout_old[known] - before[known]).abs().sum())
                sums.gap_tokens += int(known.sum())
        return aligned

    def _response_logprobs(
        self, forward: Any, tensors: Packed, *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs of the response tokens (and the policy's entropy there), flat [N]."""
        logits = forward(tensors.input_ids, tensors.attention_mask, tensors.response_positions)
        # [response tokens x vocabulary] floats are the step's largest tensors: the temperature
        # divides in place (the LM head's backward needs its input, not its output), and only
        # the log-softmax, which its backward needs, outlives this line.
        all_logprobs = torch.log_softmax(logits.float().div_(self.config.temperature), dim=-1)
        del logits
        logprobs = all_logprobs.gather(-1, tensors.targets[:, None]).squeeze(-1)
        if not with_entropy:
            return logprobs, logprobs
        return logprobs, entropy_of(all_logprobs, with_gradient=self.config.entropy_coef > 0)

    def _recomputed_old_logprobs(
        self, batch: Batch, *, share: bool = False
    ) -> list[np.ndarray[Any, Any]]:
        """Per sequence, the current policy's logprob of each token (aligned with token_ids),
        without dropout, as the engine computes them: those of the sequences this rank trains,
        or with `share` every rank's (0 for a sequence with no gradient, which none runs)."""
        self.model.eval()
        try:
            computed = self._logprobs_of(batch)
        finally:
            self.model.train()
        if share and self.world_size > 1:
            shares: list[Any] = [None] * self.world_size
            dist.all_gather_object(shares, computed)
            computed = {index: value for part in shares for index, value in part.items()}
        return [
            computed.get(index, np.zeros(len(sequence.token_ids), dtype=np.float32))
            for index, sequence in enumerate(batch.sequences)
        ]

    def _logprobs_of(self, batch: Batch) -> dict[int, np.ndarray[Any, Any]]:
        """This rank's share, by sequence index: the micro-batches it trains, so that every
        rank computes its own (each computed every sequence of the batch, one at a time, so 8
        ranks spent 8 times the pass), in as many passes as the others (a sharded forward is a
        collective)."""
        out: dict[int, np.ndarray[Any, Any]] = {}
        with torch.no_grad():
            for plan in batch.minibatches:
                work = [self._with_gradient(batch, micro) for micro in plan.micro_batches]
                for kept in work[self.rank]:
                    sequences = [batch.sequences[i] for i in kept]
                    tensors = _pack(sequences, self.device)
                    logprobs, _ = self._response_logprobs(self.policy, tensors, with_entropy=False)
                    aligned = _scatter_response(logprobs, sequences, tensors)
                    out.update(zip(kept, aligned, strict=True))
                for _ in range(self._idle_passes(work)):
                    self._idle_forward()
        return out

    # -- checkpoints -----------------------------------------------------------------------

    def save_checkpoint(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(_trainable_state(self.model), folder / "model.pt")
        torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        (folder / "backend.json").write_text(json.dumps({"steps_done": self.steps_done}))

    def load_checkpoint(self, folder: Path) -> None:
        state = torch.load(folder / "model.pt", map_location=self.device, weights_only=True)
        missing = [name for name in state if name not in dict(self.model.named_parameters())]
        if missing:
            raise ValueError(f"checkpoint {folder} has weights this model lacks: {missing[:3]}")
        with torch.no_grad():
            parameters = dict(self.model.named_parameters())
            for name, value in state.items():
                parameters[name].copy_(value)
        self.optimizer.load_state_dict(
            torch.load(folder / "optimizer.pt", map_location=self.device, weights_only=True)
        )
        self.steps_done = json.loads((folder / "backend.json").read_text())["steps_done"]

    def save_weights(self, folder: Path) -> None:
        """A plain Hugging Face folder an external engine can load (LoRA merged in)."""
        model = self.model
        if hasattr(model, "merge_adapter"):
            model.merge_adapter()
            try:
                model.get_base_model().save_pretrained(folder, safe_serialization=True)
            finally:
                model.unmerge_adapter()
        else:
            model.save_pretrained(folder, safe_serialization=True)
        readable_as_umask_allows(folder)


class ResponseLogits(torch.nn.Module):
    """The forward the loss needs: the decoder on whole rows, the LM head on the response
    positions only (prompts are long, responses short: the logits over the vocabulary are the
    biggest tensor otherwise). One module, so that a sharded model is gathered by its hooks."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_positions: torch.Tensor,
    ) -> torch.Tensor:
        model = self.model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        hidden = base.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        # Token t is predicted at position t - 1.
        logits: torch.Tensor = base.get_output_embeddings()(hidden[:, :-1][response_positions])
        return logits


def drops_units(model: Any) -> bool:
    """Whether `model` drops units in train mode: a dropout module with p > 0 (LoRA's
    `lora_dropout`), or a configured dropout rate above 0 (attention dropout is applied
    functionally, with no module to find)."""
    configs: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        settings = getattr(module, "config", None)
        if hasattr(settings, "to_dict"):  # a Hugging Face config (every layer holds the same)
            configs[id(settings)] = settings
    return any(
        "dropout" in name and type(value) in (int, float) and value > 0
        for settings in configs.values()
        for name, value in settings.to_dict().items()
    )


def _trainable_state(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


@dataclass
class Packed:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_positions: torch.Tensor
    """[rows, length - 1] bool: position t - 1 predicts a response token t."""
    targets: torch.Tensor
    weights: torch.Tensor
    old: torch.Tensor
    advantages: torch.Tensor
    trained_tokens: int


def _pack(sequences: list[TrainingSequence], device: torch.device) -> Packed:
    """Right-padded tensors of a micro-batch; per-token values flattened over response tokens."""
    length = max(len(s.token_ids) for s in sequences)
    ids = np.zeros((len(sequences), length), dtype=np.int64)
    mask = np.zeros((len(sequences), length), dtype=np.int64)
    response = np.zeros((len(sequences), length), dtype=bool)
    for row, sequence in enumerate(sequences):
        n = len(sequence.token_ids)
        ids[row, :n] = sequence.token_ids
        mask[row, :n] = 1
        response[row, :n] = sequence.loss_mask
    response[:, 0] = False  # the first token has no prediction
    positions = response[:, 1:]
    flat_weights = np.concatenate([s.loss_weight[1:][s.loss_mask[1:]] for s in sequences])
    flat_old = np.concatenate([s.old_logprobs[1:][s.loss_mask[1:]] for s in sequences])
    flat_advantage = np.concatenate(
        [np.full(int(s.loss_mask[1:].sum()), s.advantage, np.float32) for s in sequences]
    )
    return Packed(
        input_ids=torch.from_numpy(ids).to(device),
        attention_mask=torch.from_numpy(mask).to(device),
        response_positions=torch.from_numpy(positions).to(device),
        targets=torch.from_numpy(ids[:, 1:][positions]).to(device),
        weights=torch.from_numpy(flat_weights.astype(np.float32)).to(device),
        old=torch.from_numpy(flat_old.astype(np.float32)).to(device),
        advantages=torch.from_numpy(flat_advantage).to(device),
        trained_tokens=int(mask.sum()),
    )


def _gather_response(
    olds: list[np.ndarray[Any, Any]], tensors: Packed, device: torch.device
) -> torch.Tensor:
    rows = tensors.response_positions.cpu().numpy()
    flat = [old[1:][rows[i, : len(old) - 1]] for i, old in enumerate(olds)]
    return torch.from_numpy(np.concatenate(flat).astype(np.float32)).to(device)


def _scatter_response(
    flat: torch.Tensor, sequences: list[TrainingSequence], tensors: Packed
) -> list[np.ndarray[Any, Any]]:
    """`_gather_response` undone: per sequence, its response tokens' values (flat, in packing
    order) back at their positions in `token_ids`, 0 elsewhere."""
    rows = tensors.response_positions.cpu().numpy()
    values = flat.float().cpu().numpy()
    out, offset = [], 0
    for i, sequence in enumerate(sequences):
        aligned = np.zeros(len(sequence.token_ids), dtype=np.float32)
        positions = np.flatnonzero(rows[i, : len(sequence.token_ids) - 1]) + 1
        aligned[positions] = values[offset : offset + len(positions)]
        offset += len(positions)
        out.append(aligned)
    return out
