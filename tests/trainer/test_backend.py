"""The torch backend on a tiny real Llama: PPO-clip on `reins.samples` weights."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from reins.trainer.backend import BackendConfig, StepStats, TorchBackend
from tests.trainer.batches import make_batch


def load(folder: Path, **config: object) -> TorchBackend:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return TorchBackend(model, BackendConfig(lr=1e-3, **config))  # type: ignore[arg-type]


def parameters(backend: TorchBackend) -> list[torch.Tensor]:
    return [p.detach().clone() for p in backend.model.parameters()]


def test_micro_batching_gives_the_same_update_as_one_batch(tiny_model_dir: Path) -> None:
    """The same optimizer step; the gradients themselves are checked against an absolute
    reference in tests/trainer/test_gradient.py (one Adam step cannot tell their scale)."""
    whole, split = load(tiny_model_dir), load(tiny_model_dir)
    whole.train_step(make_batch(micro_tokens=None))
    stats = split.train_step(make_batch(micro_tokens=40))
    assert stats.optimizer_steps == 1
    for a, b in zip(parameters(whole), parameters(split), strict=True):
        # Adam turns float-summation-order noise on near-zero gradients into tiny steps: the
        # bound is 5 % of one step (lr 1e-3).
        torch.testing.assert_close(a, b, atol=5e-5, rtol=0)


def test_positive_advantage_raises_the_response_logprob(tiny_model_dir: Path) -> None:
    backend = load(tiny_model_dir)
    batch = make_batch(groups=1, per_group=2)
    winner = next(s for s in batch.sequences if s.advantage > 0)
    loser = next(s for s in batch.sequences if s.advantage < 0)

    def mean_logprob(sequence: object) -> float:
        from reins.trainer.backend import _pack

        tensors = _pack([sequence], backend.device)  # type: ignore[list-item]
        with torch.no_grad():
            logprobs, _ = backend._response_logprobs(backend.policy, tensors, with_entropy=False)
        return float(logprobs.mean())

    before = mean_logprob(winner), mean_logprob(loser)
    for _ in range(3):
        backend.train_step(batch)
    after = mean_logprob(winner), mean_logprob(loser)
    assert after[0] > before[0]
    assert after[1] < before[1]


def test_stats_report_entropy_and_the_rollout_logprob_gap(tiny_model_dir: Path) -> None:
    stats = load(tiny_model_dir).train_step(make_batch())
    vocab = 49152
    assert 0 < stats.entropy <= np.log(vocab) + 1e-3
    # The synthetic rollout logprobs are not the model's: the gap is large and measured.
    assert stats.logprob_gap is not None and stats.logprob_gap > 1
    assert stats.clip_fraction == 0  # recomputed old logprobs: ratio 1 on the first mini-batch


def test_rollout_logprobs_far_from_the_policy_are_clipped(tiny_model_dir: Path) -> None:
    stats = load(tiny_model_dir, old_logprobs="rollout").train_step(make_batch())
    # The synthetic rollout logprobs (-3..-0.1) are far above a random model's (~-10.8): the
    # ratio is ~0, so every token with a negative advantage (half the weight) is clipped.
    assert stats.clip_fraction == pytest.approx(0.5, abs=0.1)


def test_missing_rollout_logprobs_are_no_gap_and_no_clip(tiny_model_dir: Path) -> None:
    stats = load(tiny_model_dir, old_logprobs="rollout").train_step(make_batch(logprobs=False))
    assert stats.logprob_gap is None
    assert stats.clip_fraction == 0


def test_several_minibatches_recompute_old_logprobs_and_step_each(tiny_model_dir: Path) -> None:
    """Old logprobs are the policy's before the batch: the second mini-batch runs on weights the
    first step moved (lr 1e-2, enough to move some ratios out of the clip range), so some of its
    tokens are clipped. Recomputed after the first step they would all be at ratio 1 (nothing
    clipped, as in one mini-batch); the rollout's logprobs would clip about half."""
    from transformers import AutoModelForCausalLM

    def step(minibatches: int) -> StepStats:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        return TorchBackend(model, BackendConfig(lr=1e-2)).train_step(
            make_batch(num_minibatches=minibatches)
        )

    one, two = step(1), step(2)
    assert (one.optimizer_steps, two.optimizer_steps) == (1, 2)
    assert one.clip_fraction == 0
    assert 0.01 < two.clip_fraction < 0.3


def test_the_logprob_gap_is_measured_over_every_mini_batch(tiny_model_dir: Path) -> None:
    """The gap compares the engine's logprobs with the trainer's before the update, which a
    run of several mini-batches recomputed for all of them: it was measured on the first
    mini-batch's tokens only. With engine logprobs of 0, the gap is the mean of -logprob over
    every response token."""
    batch = make_batch(num_minibatches=2)
    batch = dataclasses.replace(
        batch,
        sequences=[
            dataclasses.replace(s, old_logprobs=np.zeros_like(s.old_logprobs))
            for s in batch.sequences
        ],
    )
    backend = load(tiny_model_dir)
    before = backend._recomputed_old_logprobs(batch)
    tokens = [lp[1:][s.loss_mask[1:]] for s, lp in zip(batch.sequences, before, strict=True)]
    want = float(-np.concatenate(tokens).astype(np.float64).mean())
    first = [t for s, t in zip(batch.sequences, tokens, strict=True) if s.minibatch == 0]
    assert abs(float(-np.concatenate(first).mean()) - want) > 1e-3  # the two can be told apart
    stats = backend.train_step(batch)
    assert stats.logprob_gap == pytest.approx(want, rel=1e-4)


def test_the_loss_is_a_mean_over_the_optimizer_steps_not_their_sum(tiny_model_dir: Path) -> None:
    """Each mini-batch's loss weights are normalized over its own rollouts, so each step's loss
    is a mean: the update's `loss` is their mean. It was their sum, 0.40, 0.80 and 1.60 on the
    same rollouts in 1, 2 and 4 mini-batches (an lr too small to move them between steps)."""
    from transformers import AutoModelForCausalLM

    def loss(minibatches: int) -> float:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        backend = TorchBackend(model, BackendConfig(lr=1e-12, old_logprobs="rollout"))
        stats = backend.train_step(make_batch(groups=4, num_minibatches=minibatches))
        assert stats.optimizer_steps == minibatches
        return stats.loss

    one = loss(1)
    assert abs(one) > 0.1
    assert loss(2) == pytest.approx(one, abs=1e-4)
    assert loss(4) == pytest.approx(one, abs=1e-4)


def test_kl_to_initial_is_zero_before_and_positive_after_an_update(tiny_model_dir: Path) -> None:
    backend = load(tiny_model_dir, kl_to_initial=True)
    first = backend.train_step(make_batch())
    second = backend.train_step(make_batch())
    assert first.kl_initial == pytest.approx(0.0, abs=1e-7)
    assert second.kl_initial is not None and second.kl_initial > 0


def test_checkpoint_round_trip_gives_the_same_next_update(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    original = load(tiny_model_dir)
    original.train_step(make_batch())
    original.save_checkpoint(tmp_path / "ckpt")
    restored = load(tiny_model_dir)
    restored.load_checkpoint(tmp_path / "ckpt")
    assert restored.steps_done == 1
    original.train_step(make_batch())
    restored.train_step(make_batch())
    for a, b in zip(parameters(original), parameters(restored), strict=True):
        torch.testing.assert_close(a, b)


def test_lora_trains_only_the_adapters(tiny_model_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    backend = TorchBackend(model, BackendConfig(lr=1e-2))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora" in name for name in adapters)
    backend.train_step(make_batch())
    backend.train_step(make_batch())
    named = dict(model.named_parameters())
    assert all(torch.equal(named[n], value) for n, value in frozen.items())
    assert any(not torch.equal(named[n], value) for n, value in adapters.items())


def test_saved_weights_load_as_a_plain_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    backend = load(tiny_model_dir)
    backend.train_step(make_batch())
    backend.save_weights(tmp_path / "weights")
    # Each file as the umask allows (safetensors wrote its own 0600: an engine running as
    # another user could not read it).
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "weights").iterdir()}
    assert modes["model.safetensors"] == 0o666 & ~umask, modes
    assert set(modes.values()) == {0o666 & ~umask}, modes
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "weights", dtype=torch.float32)
    saved = reloaded.state_dict()
    for name, value in backend.model.state_dict().items():
        torch.testing.assert_close(value, saved[name], msg=name)


def test_logprobs_are_those_of_the_sampling_temperature(tiny_model_dir: Path) -> None:
    from reins.trainer.backend import _pack

    cold, hot = load(tiny_model_dir), load(tiny_model_dir, temperature=0.5)
    sequence = make_batch().sequences[0]
    tensors = _pack([sequence], cold.device)
    with torch.no_grad():
        at_one, _ = cold._response_logprobs(cold.policy, tensors, with_entropy=False)
        at_half, _ = hot._response_logprobs(hot.policy, tensors, with_entropy=False)
        hidden = cold.model.model(input_ids=tensors.input_ids).last_hidden_state
        logits = cold.model.lm_head(hidden[:, :-1][tensors.response_positions]).float()
    expected = torch.log_softmax(logits / 0.5, -1).gather(-1, tensors.targets[:, None])[:, 0]
    torch.testing.assert_close(at_half, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(at_one, at_half)


def test_zero_advantage_sequences_are_never_run(tiny_model_dir: Path) -> None:
    from dataclasses import replace

    batch = make_batch(groups=2, per_group=2)
    flat_group = [i for i, s in enumerate(batch.sequences) if s.group_id == "g1"]
    # g1's rollouts all got the same reward: advantage 0. Its tokens are then irrelevant: the
    # update with them replaced by other tokens must be the same (they are never run).
    zeroed = [
        replace(s, advantage=0.0) if i in flat_group else s for i, s in enumerate(batch.sequences)
    ]
    scrambled = [
        replace(s, token_ids=(s.token_ids + 7) % 4000) if i in flat_group else s
        for i, s in enumerate(zeroed)
    ]
    first, second = load(tiny_model_dir), load(tiny_model_dir)
    stats = first.train_step(replace(batch, sequences=zeroed))
    second.train_step(replace(batch, sequences=scrambled))
    assert stats.skipped_sequences == len(flat_group) > 0
    assert stats.response_tokens == sum(
        int(s.loss_mask[1:].sum()) for i, s in enumerate(zeroed) if i not in flat_group
    )
    for a, b in zip(parameters(first), parameters(second), strict=True):
        assert torch.equal(a, b)
    # With a KL penalty every sequence has a gradient: none is skipped.
    with_kl = load(tiny_model_dir, kl_coef=0.1).train_step(replace(batch, sequences=zeroed))
    assert with_kl.skipped_sequences == 0


def test_a_step_with_no_gradient_anywhere_moves_no_weight(tiny_model_dir: Path) -> None:
    """All rewards of every group equal: no step at all. On a zero gradient AdamW would still
    move the weights (weight decay, and its momentum: ~0.9x the previous update), so steps
    without signal after one with it would drift the policy."""
    from dataclasses import replace

    batch = make_batch(groups=1, per_group=2)
    flat = replace(batch, sequences=[replace(s, advantage=0.0) for s in batch.sequences])
    backend = load(tiny_model_dir, weight_decay=0.1)
    assert backend.train_step(batch).optimizer_steps == 1  # momentum now holds this update
    before = parameters(backend)
    stats = backend.train_step(flat)
    assert stats.skipped_sequences == len(flat.sequences)
    assert (stats.optimizer_steps, stats.grad_norm) == (0, 0.0)
    assert stats.as_metrics()["policy/optimizer_steps"] == 0.0
    for a, b in zip(before, parameters(backend), strict=True):
        assert torch.equal(a, b)
    assert backend.train_step(batch).optimizer_steps == 1  # the next signal steps again


def test_a_gradient_with_a_nan_is_not_stepped_on(tiny_model_dir: Path) -> None:
    """One NaN in the loss (an advantage from a NaN reward, an overflow) made every weight NaN,
    which was then checkpointed and served: the step is skipped and counted instead."""
    from dataclasses import replace

    batch = make_batch(groups=1, per_group=2)
    poisoned = replace(
        batch,
        sequences=[replace(s, advantage=float("nan")) if i == 0 else s for i, s in
                   enumerate(batch.sequences)],
    )  # fmt: skip
    backend = load(tiny_model_dir)
    before = parameters(backend)
    stats = backend.train_step(poisoned)
    assert (stats.optimizer_steps, stats.nonfinite_steps, stats.grad_norm) == (0, 1, 0.0)
    assert stats.as_metrics()["policy/nonfinite_steps_skipped"] == 1.0
    for a, b in zip(before, parameters(backend), strict=True):
        assert torch.equal(a, b)
    stats = backend.train_step(batch)  # the next finite gradient steps
    assert (stats.optimizer_steps, stats.nonfinite_steps) == (1, 0) and stats.grad_norm > 0
    assert all(bool(p.isfinite().all()) for p in parameters(backend))


def checkpointing(model: Any) -> bool:
    if hasattr(type(model), "is_activation_checkpointing"):  # transformers 5 renamed it
        return bool(model.is_activation_checkpointing)
    return bool(model.is_gradient_checkpointing)


def test_activation_checkpointing_changes_no_update(tiny_model_dir: Path) -> None:
    """On by default (it is most of the peak memory saved, docs/benchmarks.md): the backward
    recomputes the activations it dropped, so the step is the one without it."""
    kept = load(tiny_model_dir, gradient_checkpointing=False)
    recomputed = load(tiny_model_dir)
    assert BackendConfig().gradient_checkpointing is True
    assert checkpointing(recomputed.model) and not checkpointing(kept.model)
    kept_stats = kept.train_step(make_batch(num_minibatches=2))
    recomputed_stats = recomputed.train_step(make_batch(num_minibatches=2))
    assert recomputed_stats.loss == pytest.approx(kept_stats.loss, rel=1e-6)
    for a, b in zip(parameters(kept), parameters(recomputed), strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)


def test_gradients_are_not_kept_between_steps(tiny_model_dir: Path) -> None:
    """A gradient is one more copy of the weights: it is freed once the optimizer stepped, not
    held while the next rollouts run."""
    backend = load(tiny_model_dir)
    stats = backend.train_step(make_batch())
    assert stats.optimizer_steps == 1 and stats.grad_norm > 0
    assert [name for name, p in backend.model.named_parameters() if p.grad is not None] == []


@pytest.mark.parametrize(("planned", "ranks"), [(2, 1), (3, 2)])
def test_a_batch_planned_for_another_world_size_is_refused(
    tiny_model_dir: Path, planned: int, ranks: int
) -> None:
    """Each rank trains only its share: 1 process on a plan for 2 would drop half the batch."""
    from reins.samples.batch import AdapterConfig, build_batch
    from tests.trainer.reference import split_rollouts

    backend = load(tiny_model_dir)
    backend.world_size = ranks  # the check comes before any collective
    before = [p.detach().clone() for p in backend.parameters]
    batch = build_batch(split_rollouts(), AdapterConfig(dp_size=planned))
    with pytest.raises(ValueError, match=f"planned for {planned} data-parallel rank"):
        backend.train_step(batch)
    assert all(torch.equal(p, q) for p, q in zip(backend.parameters, before, strict=True))
