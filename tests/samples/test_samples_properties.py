"""Properties of the adapter over random conversations (hypothesis)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from samples_factory import call, record

from reins.samples import (
    LOSS_AGGREGATIONS,
    AdapterConfig,
    Batch,
    Call,
    RolloutRecord,
    build_batch,
    dedup_calls,
    merge_calls,
)

FAST = settings(deadline=None, max_examples=50)

TOKENS = st.integers(0, 4)  # a tiny vocabulary, so that accidental prefix matches happen
MOVES = ["continue", "continue", "perturb", "branch", "retry", "truncate", "resume"]


@st.composite
def conversations(draw: st.DrawFn, max_calls: int = 7) -> list[Call]:
    """Calls as a harness makes them: mostly continuing, sometimes drifting, branching, retrying."""
    calls: list[Call] = []
    prompt = draw(st.lists(TOKENS, min_size=1, max_size=6))
    for seq in range(draw(st.integers(1, max_calls))):
        response = draw(st.lists(TOKENS, min_size=1, max_size=4))
        calls.append(call(prompt, response, seq=seq))
        history = prompt + response
        move = draw(st.sampled_from(MOVES))
        if move == "resume" and len(calls) > 1:  # an earlier thread goes on (interleaving)
            earlier = calls[draw(st.integers(0, len(calls) - 2))]
            history = [*earlier.prompt.tolist(), *earlier.response.tolist()]
            move = "continue"
        if move == "continue":
            prompt = history + draw(st.lists(TOKENS, max_size=4))
        elif move == "perturb":
            i = draw(st.integers(0, len(history) - 1))
            history[i] = (history[i] + 1) % 5
            prompt = history + draw(st.lists(TOKENS, max_size=3))
        elif move == "branch":
            prompt = draw(st.lists(TOKENS, min_size=1, max_size=8))
        elif move == "truncate":
            prompt = history[: draw(st.integers(1, len(history)))]
        # "retry": the next call reuses the same prompt
    return calls


@st.composite
def batches(draw: st.DrawFn) -> list[RolloutRecord]:
    n = draw(st.integers(1, 6))
    return [
        record(
            f"r{i}",
            draw(conversations()),
            reward=draw(st.sampled_from([0.0, 1.0])),
            group_id=draw(st.sampled_from(["g0", "g1", None])),
        )
        for i in range(n)
    ]


CONFIGS = st.builds(
    AdapterConfig,
    loss_aggregation=st.sampled_from(LOSS_AGGREGATIONS),
    num_minibatches=st.integers(1, 4),
    dp_size=st.integers(1, 3),
    max_tokens_per_microbatch=st.one_of(st.none(), st.integers(1, 30)),
)


@FAST
@given(conversations())
def test_every_merged_call_sees_exactly_the_prompt_it_consumed(calls: list[Call]) -> None:
    kept = dedup_calls(calls)
    by_seq = {c.seq: c for c in kept}
    sequences, _ = merge_calls(kept)
    for s in sequences:
        mask = np.zeros(s.token_ids.size, dtype=bool)
        for seq, (start, end) in zip(s.call_seqs, s.response_spans, strict=True):
            c = by_seq[seq]
            assert s.token_ids[:start].tolist() == c.prompt.tolist()
            assert s.token_ids[start:end].tolist() == c.response.tolist()
            assert s.old_logprobs[start:end].tolist() == c.logprobs.tolist()  # type: ignore[union-attr]
            mask[start:end] = True
        assert s.loss_mask.tolist() == mask.tolist()
        assert s.response_spans[-1][1] == s.token_ids.size


@FAST
@given(conversations())
def test_every_kept_call_lands_in_exactly_one_sequence_in_order(calls: list[Call]) -> None:
    kept = dedup_calls(calls)
    sequences, splits = merge_calls(kept)
    placed = sorted(seq for s in sequences for seq in s.call_seqs)
    assert placed == sorted(c.seq for c in kept)
    assert all(list(s.call_seqs) == sorted(s.call_seqs) for s in sequences)
    assert [s.call_seqs[0] for s in sequences] == sorted(s.call_seqs[0] for s in sequences)
    assert len(splits) == len(sequences) - 1


@FAST
@given(conversations(max_calls=10))
def test_a_call_opens_a_sequence_only_when_it_continues_none(calls: list[Call]) -> None:
    """Merging is maximal: no call that opened a sequence continued the history (prompt +
    response) of any call before it that was, then, the last of its sequence."""
    kept = dedup_calls(calls)
    sequences, _ = merge_calls(kept)
    by_seq = {c.seq: c for c in kept}
    for opening in (s.call_seqs[0] for s in sequences):
        for s in sequences:
            before = [seq for seq in s.call_seqs if seq < opening]
            if not before:
                continue
            last = by_seq[before[-1]]
            history = [*last.prompt.tolist(), *last.response.tolist()]
            assert by_seq[opening].prompt.tolist()[: len(history)] != history


@FAST
@given(st.lists(st.sampled_from([(1,), (1, 2), (2, 1), (1, 2, 3)]), max_size=12))
def test_dedup_keeps_the_last_call_of_each_prompt(prompts: list[tuple[int, ...]]) -> None:
    calls = [call(list(p), [9], seq=i) for i, p in enumerate(prompts)]
    expected = [i for i, p in enumerate(prompts) if p not in prompts[i + 1 :]]
    assert [c.seq for c in dedup_calls(calls)] == expected


@FAST
@given(batches(), st.integers(1, 4))
def test_rollout_mean_gives_every_rollout_one_over_r_whatever_its_split(
    rollouts: list[RolloutRecord], num_minibatches: int
) -> None:
    batch = build_batch(rollouts, AdapterConfig(num_minibatches=num_minibatches))
    for mb in batch.minibatches:
        totals: dict[str, float] = defaultdict(float)
        for j in mb.sequences:
            s = batch.sequences[j]
            totals[s.rollout_id] += float(s.loss_weight.astype(np.float64).sum())
        for total in totals.values():
            np.testing.assert_allclose(total, 1 / len(totals), rtol=1e-5)


@FAST
@given(batches(), CONFIGS)
def test_planning_never_splits_a_rollout_across_minibatches(
    rollouts: list[RolloutRecord], cfg: AdapterConfig
) -> None:
    batch = build_batch(rollouts, cfg)
    home: dict[str, set[int]] = defaultdict(set)
    for s in batch.sequences:
        home[s.rollout_id].add(s.minibatch)
    assert all(len(m) == 1 for m in home.values())
    planned: list[int] = []
    for m, mb in enumerate(batch.minibatches):
        for rank in mb.micro_batches:
            for micro in rank:
                planned.extend(micro)
                sizes = [batch.sequences[j].token_ids.size for j in micro]
                bound = cfg.max_tokens_per_microbatch
                assert bound is None or sum(sizes) <= bound or len(micro) == 1
                assert {batch.sequences[j].minibatch for j in micro} == {m}
    assert sorted(planned) == list(range(len(batch.sequences)))


def _paper_loss(batch: Batch, seqs: list[int], losses: dict[int, np.ndarray], agg: str) -> float:
    """Paper eq. 14-16 written out over the rollouts of ``seqs``."""
    samples: dict[str, list[np.ndarray]] = defaultdict(list)  # rollout -> response losses
    for j in seqs:
        samples[batch.sequences[j].rollout_id].append(losses[j][batch.sequences[j].loss_mask])
    flat = [x for per in samples.values() for x in per]
    if agg == "token-mean":  # eq. 14
        return float(sum(x.sum() for x in flat) / sum(x.size for x in flat))
    if agg == "seq-mean-token-mean":  # eq. 15
        return float(sum(x.mean() for x in flat) / len(flat))
    # eq. 16
    per_rollout = [sum(x.sum() for x in per) / sum(x.size for x in per) for per in samples.values()]
    return float(sum(per_rollout) / len(samples))


@FAST
@given(batches(), CONFIGS, st.integers(0, 2**32 - 1))
def test_microbatch_sums_equal_the_one_batch_loss(
    rollouts: list[RolloutRecord], cfg: AdapterConfig, seed: int
) -> None:
    batch = build_batch(rollouts, cfg)
    rng = np.random.default_rng(seed)
    losses = {j: rng.normal(size=s.token_ids.size) for j, s in enumerate(batch.sequences)}
    for mb in batch.minibatches:
        accumulated = sum(
            float((batch.sequences[j].loss_weight * losses[j]).sum())
            for rank in mb.micro_batches
            for micro in rank
            for j in micro
        )
        expected = _paper_loss(batch, list(mb.sequences), losses, cfg.loss_aggregation)
        np.testing.assert_allclose(accumulated, expected, rtol=1e-5, atol=1e-6)


@FAST
@given(batches(), st.sampled_from(LOSS_AGGREGATIONS), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_any_split_of_the_tokens_sums_to_the_one_batch_loss(
    rollouts: list[RolloutRecord], aggregation: str, parts: int, seed: int
) -> None:
    batch = build_batch(rollouts, AdapterConfig(loss_aggregation=aggregation))  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    losses = {j: rng.normal(size=s.token_ids.size) for j, s in enumerate(batch.sequences)}
    totals = np.zeros(parts)
    for j, s in enumerate(batch.sequences):  # every token to a random part: ranks, micro-batches
        np.add.at(totals, rng.integers(0, parts, s.token_ids.size), s.loss_weight * losses[j])
    expected = _paper_loss(batch, list(range(len(batch.sequences))), losses, aggregation)
    np.testing.assert_allclose(totals.sum(), expected, rtol=1e-5, atol=1e-6)
