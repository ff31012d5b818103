"""The torch backend's gradient against an absolute reference computed from the definitions
(tests/trainer/reference.py): at ratio 1, in one batch or micro-batched, and with PPO clipping
active on both sides. A wrong scale (a gradient halved), a wrong weighting (token-mean or
seq-mean instead of rollout-mean) or swapped clip bounds each fail here."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from reins.samples.batch import AdapterConfig, build_batch
from reins.trainer.backend import BackendConfig, TorchBackend
from tests.trainer.reference import (
    float64_model,
    reference_gradient,
    relative_error,
    response_logprobs,
    rollout_mean_weights,
    split_rollouts,
    stepped_gradient,
)

# float32 forward and backward against float64: ~1e-6 apart; a wrong weighting is >= 10 % off.
TOLERANCE = 1e-4


def backend_gradient(folder: Path, batch: object, **config: object) -> list[torch.Tensor]:
    """The summed gradient of one train step (lr 0, no clipping of the norm: nothing moves)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    backend = TorchBackend(
        model,
        BackendConfig(lr=0.0, grad_clip=math.inf, **config),  # type: ignore[arg-type]
    )
    before = [p.detach().clone() for p in model.parameters()]
    gradient = stepped_gradient(backend, batch)  # type: ignore[arg-type]
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b.detach()), "lr 0 must not move the weights"
    return gradient


def test_the_reference_tells_the_normalizations_apart() -> None:
    """The batch is built so that eq. 14, 15 and 16 give different weights (else the tests
    below could not see a wrong one)."""
    batch = {
        aggregation: build_batch(split_rollouts(), AdapterConfig(loss_aggregation=aggregation))
        for aggregation in ("rollout-mean", "token-mean", "seq-mean-token-mean")
    }
    sequences = batch["rollout-mean"].sequences
    assert len({s.rollout_id for s in sequences}) < len(sequences), "some rollout must split"
    expected = rollout_mean_weights(sequences)
    for aggregation, built in batch.items():
        weights = [float(s.loss_weight[s.loss_mask].max()) for s in built.sequences]
        same = np.allclose(weights, expected, rtol=1e-6)
        assert same == (aggregation == "rollout-mean"), aggregation


@pytest.mark.parametrize("micro_tokens", [None, 40, 12])
def test_the_gradient_at_ratio_one_is_the_reference(
    tiny_model_dir: Path, micro_tokens: int | None
) -> None:
    """-sum(w * A * logp) at ratio 1, whatever the micro-batching."""
    batch = build_batch(split_rollouts(), AdapterConfig(max_tokens_per_microbatch=micro_tokens))
    if micro_tokens is not None:
        assert len(batch.minibatches[0].micro_batches[0]) > 1, "the batch must be split"
    want = reference_gradient(float64_model(tiny_model_dir), batch.sequences)
    got = backend_gradient(tiny_model_dir, batch)
    assert relative_error(got, want) < TOLERANCE


def test_a_wrong_weighting_is_far_from_the_reference(tiny_model_dir: Path) -> None:
    """What the tolerance must reject: token-mean weights, and a gradient halved."""
    want = reference_gradient(
        float64_model(tiny_model_dir), build_batch(split_rollouts()).sequences
    )
    token_mean = build_batch(split_rollouts(), AdapterConfig(loss_aggregation="token-mean"))
    assert relative_error(backend_gradient(tiny_model_dir, token_mean), want) > 100 * TOLERANCE
    halved = [0.5 * g for g in want]
    assert relative_error(halved, want) > 100 * TOLERANCE


@pytest.mark.parametrize(("clip_low", "clip_high"), [(0.2, 0.28), (0.28, 0.2)])
def test_the_clipped_gradient_is_the_reference(
    tiny_model_dir: Path, clip_low: float, clip_high: float
) -> None:
    """The PPO-clip loss by hand, with clipping active: rollout logprobs are set so that each
    token's ratio is one of 0.5, 0.75, 1.0, 1.25, 1.5. With A > 0 a ratio of 1.25 is inside
    (1 + clip_high = 1.28) and 1.5 is clipped; with A < 0, 0.75 is clipped (1 - clip_low = 0.8)
    and 1.25 is not. Swapping the bounds flips 0.75 and 1.25: the second case checks the backend
    follows the bounds it is given (and the first one that clipping happens at all)."""
    batch = build_batch(split_rollouts())
    reference = float64_model(tiny_model_dir)
    targets = np.array([0.5, 0.75, 1.0, 1.25, 1.5])
    olds, sequences = [], []
    for j, sequence in enumerate(batch.sequences):
        with torch.no_grad():
            logp = response_logprobs(reference, sequence)
        ratio = torch.as_tensor(targets[(np.arange(len(logp)) + j) % len(targets)])
        old = logp - torch.log(ratio)
        olds.append(old)
        rollout_old = np.zeros(len(sequence.token_ids), dtype=np.float32)
        rollout_old[np.flatnonzero(sequence.loss_mask)] = old.float().numpy()
        sequences.append(replace(sequence, old_logprobs=rollout_old))
    batch = replace(batch, sequences=sequences)
    want = reference_gradient(
        reference, sequences, old=olds, clip_low=clip_low, clip_high=clip_high
    )
    got = backend_gradient(
        tiny_model_dir, batch, old_logprobs="rollout", clip_low=clip_low, clip_high=clip_high
    )
    assert relative_error(got, want) < TOLERANCE
    unclipped = reference_gradient(reference, sequences)  # ratio 1 everywhere: no clipping
    assert relative_error(unclipped, want) > 100 * TOLERANCE
    swapped = reference_gradient(
        reference, sequences, old=olds, clip_low=clip_high, clip_high=clip_low
    )
    assert relative_error(swapped, want) > 100 * TOLERANCE
