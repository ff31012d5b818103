"""Loss weights: the three normalizations of paper section 2.3, on figure 5's batch."""

from __future__ import annotations

import numpy as np
import pytest
from samples_factory import record, separate_calls

from reins.samples import AdapterConfig, Batch, build_batch, step_loss_weights

# Figure 5: rollout A has samples of 50 and 100 response tokens, B three of 30, C one of 40.
FIGURE5 = {"A": [50, 100], "B": [30, 30, 30], "C": [40]}


def _figure5(aggregation: str) -> Batch:
    rollouts = [record(rid, separate_calls(lengths)) for rid, lengths in FIGURE5.items()]
    batch = build_batch(rollouts, AdapterConfig(loss_aggregation=aggregation))  # type: ignore[arg-type]
    lengths = [int(s.loss_mask.sum()) for s in batch.sequences]
    assert lengths == [50, 100, 30, 30, 30, 40]
    return batch


def _losses(batch: Batch, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=s.token_ids.size) for s in batch.sequences]


def _sample_sums(batch: Batch, losses: list[np.ndarray]) -> list[float]:
    """A1, A2, B1, B2, B3, C1 of the paper: each sample's summed per-token response loss."""
    return [float(loss[s.loss_mask].sum()) for s, loss in zip(batch.sequences, losses, strict=True)]


def _weighted(batch: Batch, losses: list[np.ndarray]) -> float:
    return sum(
        float((s.loss_weight * loss).sum()) for s, loss in zip(batch.sequences, losses, strict=True)
    )


def test_figure5_token_mean() -> None:
    batch = _figure5("token-mean")
    losses = _losses(batch)
    a1, a2, b1, b2, b3, c1 = _sample_sums(batch, losses)
    # paper eq. 14
    expected = (a1 + a2 + b1 + b2 + b3 + c1) / (50 + 100 + 30 + 30 + 30 + 40)
    assert _weighted(batch, losses) == pytest.approx(expected, rel=1e-6)


def test_figure5_seq_mean_token_mean() -> None:
    batch = _figure5("seq-mean-token-mean")
    losses = _losses(batch)
    a1, a2, b1, b2, b3, c1 = _sample_sums(batch, losses)
    # paper eq. 15
    expected = (a1 / 50 + a2 / 100 + b1 / 30 + b2 / 30 + b3 / 30 + c1 / 40) / 6
    assert _weighted(batch, losses) == pytest.approx(expected, rel=1e-6)


def test_figure5_rollout_mean() -> None:
    batch = _figure5("rollout-mean")
    losses = _losses(batch)
    a1, a2, b1, b2, b3, c1 = _sample_sums(batch, losses)
    # paper eq. 16
    expected = ((a1 + a2) / (50 + 100) + (b1 + b2 + b3) / (30 + 30 + 30) + c1 / 40) / 3
    assert _weighted(batch, losses) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("aggregation", "per_sample"),
    [
        ("token-mean", [1 / 280] * 6),
        ("seq-mean-token-mean", [1 / 300, 1 / 600, 1 / 180, 1 / 180, 1 / 180, 1 / 240]),
        ("rollout-mean", [1 / 450, 1 / 450, 1 / 270, 1 / 270, 1 / 270, 1 / 120]),
    ],
)
def test_figure5_per_token_weights(aggregation: str, per_sample: list[float]) -> None:
    batch = _figure5(aggregation)
    for seq, weight in zip(batch.sequences, per_sample, strict=True):
        assert seq.loss_weight.dtype == np.float32
        assert seq.loss_weight[seq.loss_mask] == pytest.approx(weight, rel=1e-6)


def test_weights_are_zero_on_prompt_and_observation_tokens() -> None:
    batch = _figure5("rollout-mean")
    for seq in batch.sequences:
        assert (seq.loss_weight[~seq.loss_mask] == 0).all()


def test_rollout_mean_gives_each_minibatch_a_mean_over_its_own_rollouts() -> None:
    rollouts = [record(rid, separate_calls(lengths)) for rid, lengths in FIGURE5.items()]
    batch = build_batch(rollouts, AdapterConfig(num_minibatches=3))
    for mb in batch.minibatches:
        total = sum(float(batch.sequences[j].loss_weight.sum()) for j in mb.sequences)
        assert total == pytest.approx(1.0, rel=1e-6)  # one rollout per step: weight 1


def test_step_loss_weights_renormalizes_a_replanned_step() -> None:
    batch = _figure5("rollout-mean")
    step = batch.sequences[:2]  # rollout A alone as one step
    weights = step_loss_weights(step, [s.rollout_id for s in step])
    assert sum(float(w.sum()) for w in weights) == pytest.approx(1.0, rel=1e-6)
    assert weights[0][step[0].loss_mask] == pytest.approx(1 / 150, rel=1e-6)
