"""The entropy bonus: the chunked entropy and its hand-written gradient, and the backend's use."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from reins.samples.batch import TrainingSequence
from reins.trainer.backend import TorchBackend, _pack
from reins.trainer.entropy import ROWS, entropy
from tests.trainer.batches import make_batch
from tests.trainer.test_backend import load


def naive(logits: torch.Tensor) -> torch.Tensor:
    probabilities = torch.softmax(logits, -1)
    return -(probabilities * torch.log_softmax(logits, -1)).sum(-1)


def test_the_entropy_and_its_gradient_are_autograds_over_several_chunks() -> None:
    torch.manual_seed(0)
    rows = 2 * ROWS + 5  # two whole chunks and a partial one
    logits = (3 * torch.randn(rows, 50, dtype=torch.float64)).requires_grad_()
    upstream = torch.randn(rows, dtype=torch.float64)

    ours = entropy(torch.log_softmax(logits, -1), with_gradient=True)
    (ours_grad,) = torch.autograd.grad((ours * upstream).sum(), logits)
    reference = naive(logits)
    (reference_grad,) = torch.autograd.grad((reference * upstream).sum(), logits)

    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_grad, reference_grad, rtol=1e-10, atol=1e-12)
    # The closed form on the logits: dH/dz_v = -p_v (log p_v + H).
    p = torch.softmax(logits.detach(), -1)
    closed = -p * (torch.log(p) + reference.detach()[:, None]) * upstream[:, None]
    torch.testing.assert_close(ours_grad, closed, rtol=1e-9, atol=1e-12)


def test_a_token_of_probability_zero_adds_nothing_and_no_nan() -> None:
    logits = torch.tensor([[0.0, 0.0, float("-inf")], [1.0, 2.0, 3.0]], requires_grad=True)
    values = entropy(torch.log_softmax(logits, -1), with_gradient=True)
    assert values[0].item() == pytest.approx(np.log(2), abs=1e-6)
    values.sum().backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
    assert logits.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-7)


def test_without_a_gradient_the_entropy_is_detached() -> None:
    logits = torch.randn(3, 7, requires_grad=True)
    values = entropy(torch.log_softmax(logits, -1), with_gradient=False)
    assert not values.requires_grad
    torch.testing.assert_close(values, naive(logits).detach())


def policy_entropy(backend: TorchBackend, sequences: list[TrainingSequence]) -> float:
    tensors = _pack(sequences, backend.device)
    with torch.no_grad():
        _, values = backend._response_logprobs(backend.policy, tensors, with_entropy=True)
    return float(values.mean())


def test_the_bonus_moves_a_policy_whose_groups_all_tie(tiny_model_dir: Path) -> None:
    """Every reward equal: no advantage, so without the bonus no sequence runs and no weight
    moves; with it every sequence runs, the loss is exactly minus the weighted entropy, and the
    step raises the policy's entropy on those tokens."""
    batch = make_batch(groups=2, per_group=2)
    tied = replace(batch, sequences=[replace(s, advantage=0.0) for s in batch.sequences])
    total_weight = sum(float(s.loss_weight[1:][s.loss_mask[1:]].sum()) for s in tied.sequences)

    assert load(tiny_model_dir).train_step(tied).optimizer_steps == 0

    coef = 0.5
    backend = load(tiny_model_dir, entropy_coef=coef)
    before = policy_entropy(backend, tied.sequences)
    stats = backend.train_step(tied)
    after = policy_entropy(backend, tied.sequences)

    assert (stats.skipped_sequences, stats.optimizer_steps) == (0, 1)
    assert stats.response_tokens == sum(int(s.loss_mask[1:].sum()) for s in tied.sequences)
    assert stats.loss == pytest.approx(-coef * stats.entropy * total_weight, rel=1e-5)
    assert after > before + 1e-4


def test_the_bonus_adds_to_the_policy_gradient_not_instead_of_it(tiny_model_dir: Path) -> None:
    """The same batch with and without a bonus: different updates; a tiny bonus, nearly the
    same one (the PPO gradient is still there)."""
    batch = make_batch(groups=1, per_group=2)
    plain, tiny, large = (
        load(tiny_model_dir),
        load(tiny_model_dir, entropy_coef=1e-9),
        load(tiny_model_dir, entropy_coef=1.0),
    )
    for backend in (plain, tiny, large):
        backend.train_step(batch)
    weights = [[p.detach() for p in backend.model.parameters()] for backend in (plain, tiny, large)]
    gap_tiny = max(float((a - b).abs().max()) for a, b in zip(weights[0], weights[1], strict=True))
    gap_large = max(float((a - b).abs().max()) for a, b in zip(weights[0], weights[2], strict=True))
    assert gap_tiny < 1e-5 < gap_large
