"""Batch planning: mini-batches keep rollouts whole; micro-batches balance tokens over ranks."""

from __future__ import annotations

import numpy as np
import pytest
from samples_factory import record, separate_calls

from reins.samples import (
    AdapterConfig,
    assign_ranks,
    build_batch,
    pack_microbatches,
    plan_minibatches,
)


def test_minibatches_take_whole_rollouts_in_equal_counts() -> None:
    owner = np.array([0, 0, 0, 1, 2, 2, 3])
    assert plan_minibatches(owner, 2) == [[0, 1], [2, 3]]


def test_fewer_rollouts_than_minibatches_gives_fewer_minibatches() -> None:
    assert plan_minibatches(np.array([0, 0, 1]), 5) == [[0], [1]]


def test_longest_first_onto_the_least_loaded_rank_balances_tokens() -> None:
    lengths = np.array([8, 7, 6, 5, 4])
    ranks = assign_ranks(range(5), lengths, 2)
    assert ranks == [[0, 3, 4], [1, 2]]  # 17 and 13 tokens
    assert sorted(sum(int(lengths[i]) for i in r) for r in ranks) == [13, 17]


def test_microbatches_respect_the_token_bound() -> None:
    lengths = np.array([6, 5, 4, 3, 2])
    micro, oversize = pack_microbatches(range(5), lengths, 8)
    assert oversize == 0
    assert all(sum(int(lengths[i]) for i in mb) <= 8 for mb in micro)
    assert sorted(i for mb in micro for i in mb) == [0, 1, 2, 3, 4]
    assert len(micro) == 3  # 20 tokens need at least 3 bins of 8


def test_a_sequence_over_the_bound_is_a_microbatch_of_its_own() -> None:
    lengths = np.array([20, 3, 3])
    micro, oversize = pack_microbatches(range(3), lengths, 8)
    assert oversize == 1
    assert (0,) in micro


def test_build_batch_plans_every_sequence_exactly_once() -> None:
    rollouts = [record(f"r{i}", separate_calls([3 + i, 5, 2 * i + 1])) for i in range(6)]
    batch = build_batch(
        rollouts, AdapterConfig(num_minibatches=2, dp_size=3, max_tokens_per_microbatch=12)
    )
    planned = [j for mb in batch.minibatches for rank in mb.micro_batches for m in rank for j in m]
    assert sorted(planned) == list(range(len(batch.sequences)))
    for m, mb in enumerate(batch.minibatches):
        assert {batch.sequences[j].minibatch for j in mb.sequences} == {m}
        assert len(mb.micro_batches) == 3


def test_invalid_dp_size_is_refused() -> None:
    with pytest.raises(ValueError, match="dp_size must be at least 1"):
        assign_ranks([0], np.array([1]), 0)
