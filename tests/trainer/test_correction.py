"""`reins.trainer.correction` and `reins.trainer.staleness` on hand-made sequences, against
figures computed by hand; and the backend's masking, which must leave a masked rollout out of
the update whole, as if it had no gradient."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from reins.samples.batch import TrainingSequence
from reins.trainer.backend import BackendConfig, ResponseLogits, TorchBackend
from reins.trainer.correction import correction_weights
from reins.trainer.staleness import certain_drop, rollout_staleness, spans_update, version_lags
from tests.trainer.batches import make_batch
from tests.trainer.test_backend import load, parameters

NAN = float("nan")


def sequence(
    rollout_id: str,
    engine: list[float],
    spans: tuple[tuple[int, int], ...],
    versions: tuple[int | None, ...],
) -> TrainingSequence:
    """Two prompt tokens, then responses: `engine` holds a logprob per token (0 on the prompt)."""
    n = len(engine)
    mask = np.zeros(n, dtype=bool)
    for start, end in spans:
        mask[start:end] = True
    return TrainingSequence(
        token_ids=np.arange(n, dtype=np.int32), loss_mask=mask,
        old_logprobs=np.array(engine, dtype=np.float32), advantage=1.0,
        loss_weight=mask.astype(np.float32), reward=1.0, rollout_id=rollout_id, group_id="g",
        attempt_id=1, call_seqs=tuple(range(len(spans))), model_versions=versions,
        response_spans=spans, minibatch=0,
    )  # fmt: skip


def test_staleness_counts_from_the_oldest_serving_version_along_the_lineage() -> None:
    lineage = [1, 2, 3, 4, 5]
    assert rollout_staleness([3, 4], 5, lineage) == 2  # served by v3 and v4, trained at v5
    assert rollout_staleness([5, 5], 5, lineage) == 0
    assert rollout_staleness([None, 4], 5, lineage) == 1  # a call of unknown version: left out
    assert rollout_staleness([], 5, lineage) == 0
    assert rollout_staleness([7], 5, lineage) == math.inf  # weights a crash discarded
    assert (spans_update([3, 4]), spans_update([4, None, 4])) == (True, False)
    assert version_lags([1, 2, 5]) == {1: 2, 2: 1, 5: 0}


def test_truncated_ratios_and_a_rollout_masked_whole() -> None:
    a = sequence("r1", [0, 0, -1.0, -2.0, NAN], ((2, 4), (4, 5)), (4, 5))
    b1 = sequence("r2", [0, 0, -4.0], ((2, 3),), (3,))
    b2 = sequence("r2", [0, 0, -1.0, -1.0], ((2, 4),), (5,))
    b3 = sequence("r2", [0, 0, -1.0], ((2, 3),), (5,))  # not run by the update (no gradient)
    trainer = [
        np.array([0, 0, -0.5, -2.5, -1.0]),  # log-ratios +0.5, -0.5 (the NaN token: unknown)
        np.array([0, 0, -1.0]),  # +3.0
        np.array([0, 0, -1.2, -1.2]),  # -0.2, -0.2
        None,
    ]
    multipliers, stats = correction_weights(
        [a, b1, b2, b3], trainer, tis_cap=1.5, mask_ratio=2.0, version_lags={5: 0, 4: 1, 3: 2}
    )
    np.testing.assert_allclose(multipliers[0], [1, 1, 1.5, math.exp(-0.5), 1], rtol=1e-6)
    # r2's mean log-ratio, (3.0 - 0.2 - 0.2) / 3 = 0.867, is beyond log(2) = 0.693: every
    # sequence of it is left out, b2 whose own ratios are near 1 and b3 included.
    for masked in multipliers[1:]:
        assert not masked.any()
    ratios = [math.exp(0.5), math.exp(-0.5), math.exp(3.0), math.exp(-0.2), math.exp(-0.2)]
    assert stats.tokens == 5 and (stats.rollouts, stats.masked_rollouts) == (2, 1)
    assert stats.masked_rollout_ids == {"r2"}
    assert stats.ratio_mean == pytest.approx(sum(ratios) / 5)
    assert (stats.ratio_min, stats.ratio_max) == (
        pytest.approx(math.exp(-0.5)),
        pytest.approx(math.exp(3.0)),
    )
    assert stats.clipped_fraction == pytest.approx(2 / 5)  # e^0.5 and e^3 are above 1.5
    # By the serving version's lag: v5 (lag 0) served b2's tokens; v4 (lag 1) a's two; v3 b1's.
    assert dict(stats.gap_by_lag) == pytest.approx({0: 0.2, 1: 0.5, 2: 3.0})
    metrics = stats.as_metrics()
    assert metrics["correction/masked_fraction"] == 0.5
    assert metrics["correction/logprob_gap_lag2"] == pytest.approx(3.0)


def test_the_masked_fraction_counts_the_rollouts_the_update_runs_and_a_nan_ratio_is_masked() -> (
    None
):
    """`masked_fraction` is of the rollouts with a ratio known: one with no gradient (the
    update does not run it) is not among them. A NaN trainer logprob (a broken forward) gives
    a ratio nothing can trust: its rollout is masked, not trained at a NaN weight."""
    run = sequence("r1", [0, 0, -4.0], ((2, 3),), (1,))
    idle = sequence("r2", [0, 0, -1.0], ((2, 3),), (1,))
    broken = sequence("r3", [0, 0, -1.0], ((2, 3),), (1,))
    multipliers, stats = correction_weights(
        [run, idle, broken],
        [np.array([0, 0, -1.0]), None, np.array([0, 0, NAN])],
        tis_cap=None,
        mask_ratio=2.0,
    )
    assert (stats.rollouts, stats.masked_rollouts) == (2, 2)  # r1: +3.0 > log 2; r3: NaN
    assert stats.as_metrics()["correction/masked_fraction"] == 1.0
    assert [m.tolist() for m in multipliers] == [[0, 0, 0], [1, 1, 1], [0, 0, 0]]


def test_the_cap_and_the_mask_apply_only_when_set() -> None:
    a = sequence("r1", [0, 0, -4.0], ((2, 3),), (1,))
    multipliers, stats = correction_weights(
        [a], [np.array([0, 0, -1.0])], tis_cap=None, mask_ratio=None
    )
    assert multipliers[0].tolist() == [1, 1, 1] and stats.masked_rollouts == 0
    assert stats.clipped_fraction == 0 and stats.gap_by_lag == {}
    with pytest.raises(ValueError, match="above 1"):
        correction_weights([a], [None], tis_cap=None, mask_ratio=0.5)


def test_a_masked_rollout_moves_the_weights_as_a_rollout_with_no_gradient(
    tiny_model_dir: Path,
) -> None:
    """The backend with `rollout_mask_ratio`: one rollout whose engine logprobs are far from the
    trainer's (0: probability 1) is masked; the others' are unknown (NaN: no ratio, weight 1).
    The update equals that of the same batch with that rollout's advantage 0 (never run)."""
    batch = make_batch()
    target = batch.sequences[0].rollout_id
    assert batch.sequences[0].advantage != 0

    def engine(sequence: TrainingSequence) -> TrainingSequence:
        known = sequence.rollout_id == target
        lp = np.where(sequence.loss_mask, 0.0 if known else NAN, 0.0).astype(np.float32)
        return dataclasses.replace(sequence, old_logprobs=lp)

    masked_batch = dataclasses.replace(batch, sequences=[engine(s) for s in batch.sequences])
    silent = dataclasses.replace(
        masked_batch,
        sequences=[
            dataclasses.replace(s, advantage=0.0) if s.rollout_id == target else s
            for s in masked_batch.sequences
        ],
    )
    masking = load(tiny_model_dir, rollout_mask_ratio=2.0)
    stats = masking.train_step(masked_batch)
    reference = load(tiny_model_dir)
    reference.train_step(silent)
    assert stats.correction is not None and stats.correction.masked_rollouts == 1
    for x, y in zip(parameters(masking), parameters(reference), strict=True):
        torch.testing.assert_close(x, y, atol=5e-5, rtol=0)
    unmasked = load(tiny_model_dir)
    unmasked.train_step(masked_batch)  # the rollout trained: the weights differ
    assert any(
        not torch.allclose(x, y, atol=5e-5, rtol=0)
        for x, y in zip(parameters(unmasked), parameters(reference), strict=True)
    )


def test_a_correction_needs_the_recomputed_logprobs() -> None:
    from pydantic import ValidationError

    from reins.trainer.config import TrainConfig

    fields = {"tasks": "t.jsonl", "agent": "m:f"}
    assert TrainConfig.model_validate({**fields, "tis_cap": 2.0}).tis_cap == 2.0
    with pytest.raises(ValidationError, match="need old_logprobs: recompute"):
        TrainConfig.model_validate({**fields, "rollout_mask_ratio": 2, "old_logprobs": "rollout"})
    with pytest.raises(ValidationError, match="set tis_cap or rollout_mask_ratio too"):
        TrainConfig.model_validate({**fields, "stale_groups": "correct"})
    with pytest.raises(ValidationError, match="greater than 1"):
        TrainConfig.model_validate({**fields, "rollout_mask_ratio": 0.5})


def test_an_async_run_is_told_when_max_parallel_holds_its_rollouts_back() -> None:
    from reins.trainer.config import TrainConfig

    fields = {"tasks": "t.jsonl", "agent": "m:f", "tasks_per_step": 8, "group_size": 4}
    short = TrainConfig.model_validate({**fields, "mode": "async", "max_parallel": 63})
    message = short.async_parallel_shortfall()
    assert message is not None and "up to 64 rollouts" in message and "is 63" in message
    enough = TrainConfig.model_validate({**fields, "mode": "async", "max_parallel": 64})
    assert enough.async_parallel_shortfall() is None
    deeper = enough.model_copy(update={"max_staleness": 2})
    assert "up to 96 rollouts" in (deeper.async_parallel_shortfall() or "")
    assert (
        TrainConfig.model_validate({**fields, "max_parallel": 1}).async_parallel_shortfall() is None
    )


def test_token_level_tis_from_the_updates_own_forward_equals_the_recomputing_pass(
    tiny_model_dir: Path,
) -> None:
    """TIS alone (one mini-batch) weighs tokens by the update's own forward, without the pass
    that recomputes every logprob first; a huge `rollout_mask_ratio` (never masking) forces that
    pass: the same statistics, and weights far closer to each other than to an update without
    the correction (the two passes pack sequences differently: logprobs agree to ~1e-6, not
    bit for bit). The engine's logprobs alternate -10.9 and -10.3 (the tiny model's are near
    -10.8): some ratios are above the cap, others well below 1."""
    batch = make_batch()

    def engine(sequence: TrainingSequence) -> TrainingSequence:
        alternating = np.where(np.arange(len(sequence.token_ids)) % 2 == 0, -10.9, -10.3)
        lp = np.where(sequence.loss_mask, alternating, 0.0).astype(np.float32)
        return dataclasses.replace(sequence, old_logprobs=lp)

    batch = dataclasses.replace(batch, sequences=[engine(s) for s in batch.sequences])
    assert len(batch.minibatches) == 1
    inline = load(tiny_model_dir, tis_cap=1.1)
    inline_stats = inline.train_step(batch).correction
    recomputing = load(tiny_model_dir, tis_cap=1.1, rollout_mask_ratio=1e9)
    recomputing_stats = recomputing.train_step(batch).correction
    assert inline_stats is not None and recomputing_stats is not None
    assert 0 < inline_stats.clipped_fraction < 0.5 and inline_stats.ratio_min < 0.8
    assert inline_stats.tokens == recomputing_stats.tokens > 0
    assert inline_stats.clipped_fraction == pytest.approx(recomputing_stats.clipped_fraction)
    assert inline_stats.ratio_mean == pytest.approx(recomputing_stats.ratio_mean, abs=1e-5)
    assert inline_stats.ratio_min == pytest.approx(recomputing_stats.ratio_min, abs=1e-5)
    plain = load(tiny_model_dir)
    plain.train_step(batch)  # no correction: other weights

    def largest_difference(a: TorchBackend, b: TorchBackend) -> float:
        pairs = zip(parameters(a), parameters(b), strict=True)
        return max(float((x - y).abs().max()) for x, y in pairs)

    corrected_vs_plain = largest_difference(inline, plain)
    assert corrected_vs_plain > 1e-4
    assert largest_difference(inline, recomputing) < corrected_vs_plain / 20


def test_a_group_is_given_up_only_when_no_next_call_can_save_it() -> None:
    lineage = [0, 1, 2, 3]
    rules = {"max_staleness": 1, "drop_stale": True, "drop_spanning": False}
    # At v3, a call served by v1 is 2 updates back: dropped whatever the group does next.
    assert certain_drop([(3, 3), (1, 1)], 3, lineage, **rules) == (
        "a call was served 2 updates back (max_staleness 1)"
    )
    # One update back, or no call yet (it will be served by v3 or later): it may be trained.
    assert certain_drop([(2, 3), (None, None)], 3, lineage, **rules) is None
    assert certain_drop([], 3, lineage, **rules) is None
    # `stale_groups: correct` trains stale groups: only weights a crash discarded give it up.
    correct = {**rules, "drop_stale": False}
    assert certain_drop([(1, 1)], 3, lineage, **correct) is None
    assert certain_drop([(5, 5)], 3, lineage, **correct) == (
        "a call was served by weights a crash discarded"
    )
    # `spanning_rollouts: drop`: a rollout whose calls spanned an update stays spanning.
    spanning = {**correct, "drop_spanning": True}
    assert certain_drop([(2, 3)], 3, lineage, **spanning) == (
        "a rollout's calls spanned an update (spanning_rollouts: drop)"
    )
    assert certain_drop([(3, 3), (2, 2)], 3, lineage, **spanning) is None


def test_the_trainers_logprobs_it_compares_with_the_engines_are_taken_without_dropout(
    tiny_model_dir: Path,
) -> None:
    """LoRA with dropout (`lora.dropout`), trained on rollouts its own weights sampled (the
    engine serves the model in eval mode: no unit dropped): the trainer's logprobs of them are
    the engine's, so every ratio is 1, no rollout is masked and the gap is 0. They were taken
    from the update's forward, with units dropped: ratios 0.67-1.24, 5 of these 8 on-policy
    rollouts masked, and a gap of 0.11 that read as a trainer/engine mismatch."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from reins.trainer.backend import _pack, _scatter_response

    def backend(**config: object) -> TorchBackend:
        torch.manual_seed(0)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
            LoraConfig(
                r=8,
                lora_alpha=64,
                lora_dropout=0.5,
                target_modules=["q_proj", "v_proj", "o_proj"],
                init_lora_weights=False,  # random B: the adapters (and their dropout) matter
                task_type="CAUSAL_LM",
            ),
        )
        return TorchBackend(model, BackendConfig(lr=1e-3, **config))  # type: ignore[arg-type]

    batch = make_batch()
    serving = backend().model.eval()
    with torch.no_grad():
        tensors = _pack(batch.sequences, torch.device("cpu"))
        logits = ResponseLogits(serving)(
            tensors.input_ids, tensors.attention_mask, tensors.response_positions
        )
        engine = torch.log_softmax(logits.float(), dim=-1)
        engine = engine.gather(-1, tensors.targets[:, None]).squeeze(-1)
    served = _scatter_response(engine, batch.sequences, tensors)
    batch = dataclasses.replace(
        batch,
        sequences=[
            dataclasses.replace(s, old_logprobs=np.where(s.loss_mask, lp, 0).astype(np.float32))
            for s, lp in zip(batch.sequences, served, strict=True)
        ],
    )
    for config in ({"rollout_mask_ratio": 1.01}, {"tis_cap": 2.0}):
        stats = backend(**config).train_step(batch)
        assert stats.correction is not None and stats.correction.tokens > 0, config
        assert stats.correction.masked_rollouts == 0, config
        assert stats.correction.ratio_min == pytest.approx(1, abs=1e-4), config
        assert stats.correction.ratio_max == pytest.approx(1, abs=1e-4), config
        assert stats.logprob_gap is not None and stats.logprob_gap < 1e-4, config
