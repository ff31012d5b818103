"""The gradient a training step must produce, computed here from the definitions alone.

A comparison of two runs after one Adam step cannot see a wrong scale or weighting: Adam's first
step is about `lr * sign(gradient)`, the same for a gradient halved everywhere. These helpers
give the absolute reference instead: float64 autograd, on a float64 copy of the model, of

    L = sum over rollouts rho, sequences j, response tokens t of  w_rho * loss(t)
    w_rho = 1 / (R * L_rho)            (paper eq. 16, rollout-level token mean)
    loss(t) = max(-A * r, -A * clamp(r, 1 - clip_low, 1 + clip_high)),  r = exp(logp - old)

where R is the number of rollouts of the step and L_rho the response tokens of rollout rho over
all its sequences. Nothing here calls the backend or reads `loss_weight`: the weights come from
the loss masks and the rollout ids.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reins.samples.batch import Batch, TrainingSequence
from reins.samples.records import Call, RolloutRecord


def rollout_mean_weights(sequences: list[TrainingSequence]) -> list[float]:
    """w of each sequence's tokens: 1 / (R * L_rho) (eq. 16), from the masks alone."""
    per_rollout: dict[str, int] = defaultdict(int)
    for sequence in sequences:
        per_rollout[sequence.rollout_id] += int(sequence.loss_mask.sum())
    rollouts = len(per_rollout)
    return [1.0 / (rollouts * per_rollout[s.rollout_id]) for s in sequences]


def float64_model(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    model.eval()  # no dropout (the tiny model has none; the backend trains in train mode)
    return model


def response_logprobs(model: torch.nn.Module, sequence: TrainingSequence) -> torch.Tensor:
    """logp of each response token of one sequence under `model` (token t predicted at t - 1)."""
    ids = torch.as_tensor(np.asarray(sequence.token_ids, dtype=np.int64))[None]
    logits = model(input_ids=ids).logits[0, :-1]
    mask = torch.as_tensor(np.asarray(sequence.loss_mask[1:], dtype=bool))
    logprobs = torch.log_softmax(logits[mask], dim=-1)
    return logprobs.gather(-1, ids[0, 1:][mask][:, None])[:, 0]


def reference_gradient(
    model: torch.nn.Module,
    sequences: list[TrainingSequence],
    *,
    old: list[torch.Tensor] | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> list[torch.Tensor]:
    """dL/dtheta for every parameter (float64). `old[j]`: old logprobs of sequence j's response
    tokens; None: ratio 1 (old = logp), where the loss is -sum(w * A * logp) in gradient."""
    model.zero_grad(set_to_none=True)
    weights = rollout_mean_weights(sequences)
    total = torch.zeros((), dtype=torch.float64)
    for j, (sequence, weight) in enumerate(zip(sequences, weights, strict=True)):
        logp = response_logprobs(model, sequence)
        advantage = float(sequence.advantage)
        if old is None:
            total = total - weight * advantage * logp.sum()
            continue
        ratio = torch.exp(logp - old[j])
        clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
        total = total + weight * torch.maximum(-advantage * ratio, -advantage * clipped).sum()
    total.backward()  # type: ignore[no-untyped-call]
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in model.parameters()
    ]


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """|got - want| / |want| over all parameters together."""
    diff = sum(float(((g.double() - w) ** 2).sum()) for g, w in zip(got, want, strict=True))
    norm = sum(float((w**2).sum()) for w in want)
    return (diff / norm) ** 0.5


def split_rollouts() -> list[RolloutRecord]:
    """Two groups of rollouts; some split into two sequences (their second call does not extend
    the first), of different lengths, so eq. 14, 15 and 16 all weigh tokens differently."""
    rng = np.random.default_rng(7)
    records = []
    for g in range(2):
        for r in range(3):
            calls = []
            history = list(rng.integers(100, 5000, size=10))
            turns = 2 if r != 1 else 1
            for turn in range(turns):
                size = int(rng.integers(3, 12)) if turn == 0 else int(rng.integers(2, 5))
                response = list(rng.integers(100, 5000, size=size))
                lp = rng.uniform(-3, -0.1, size=size).astype(np.float32)
                calls.append(Call(np.array(history), np.array(response), lp, seq=turn + 1))
                # The next prompt starts over (a new history): a split, not a merge.
                history = list(rng.integers(100, 5000, size=8 + turn))
            reward = float((r + g) % 3 == 0) + 0.5 * r
            records.append(
                RolloutRecord(rollout_id=f"g{g}.r{r}", reward=reward, calls=calls, group_id=f"g{g}")
            )
    return records


def step_sequences(batch: Batch, minibatch: int = 0) -> list[TrainingSequence]:
    return [s for s in batch.sequences if s.minibatch == minibatch]


def stepped_gradient(backend: Any, batch: Batch) -> list[torch.Tensor]:
    """One `train_step` of `backend` (a `TorchBackend`); the gradient its optimizer stepped on
    (after the all-reduce and clipping), taken at the step: the backend frees it afterwards."""
    taken: list[torch.Tensor] = []
    step = backend.optimizer.step

    def taking_step(*args: Any, **kwargs: Any) -> Any:
        taken[:] = [p.grad.detach().clone() for p in backend.model.parameters()]
        return step(*args, **kwargs)

    backend.optimizer.step = taking_step
    try:
        backend.train_step(batch)
    finally:
        backend.optimizer.step = step
    assert taken, "the optimizer made no step"
    return taken
