"""Batch metrics: what merging, dedup and splits did."""

from __future__ import annotations

import pytest
from samples_factory import call, continuing, record, separate_calls

from reins.samples import Batch, build_batch


def _batch() -> Batch:
    c1 = call([1, 2], [3], seq=1, version=1)
    c2 = continuing(c1, [4], [5, 6], seq=2)
    c2.model_version = 2
    retried = call([1, 2, 3, 4], [9], seq=3, version=2)  # c2's prompt, later: c2 was retried
    merged = record("merged", [c1, c2, retried])
    split = record("split", separate_calls([2, 2, 2]))
    return build_batch([merged, split])


def test_sample_counts_per_rollout() -> None:
    m = _batch().metrics
    assert (m.rollouts, m.sequences) == (2, 4)
    assert m.one_sample_rollout_ratio == 0.5
    assert m.samples_per_rollout == 2.0


def test_dedup_calls_are_counted() -> None:
    m = _batch().metrics
    assert (m.calls, m.dedup_calls) == (5, 1)


def test_tokens_in_calls_versus_tokens_trained() -> None:
    m = _batch().metrics
    # merged rollout: calls (2+1) + (4+1) = 8 tokens, one sequence of 5; split rollout: 3 x 5
    assert (m.call_tokens, m.trained_tokens) == (8 + 15, 5 + 15)
    assert m.merge_token_saving == pytest.approx(1 - 20 / 23)
    assert m.response_tokens == 2 + 6


def test_split_reasons_are_counted_for_every_reason() -> None:
    m = _batch().metrics
    assert m.split_reasons == {
        "retokenized": 0,
        "template": 0,
        "transformed": 0,
        "dropped": 0,
        "compacted": 0,
        "branch": 2,
        "unknown": 0,
    }


def test_sequences_served_by_two_weight_versions_are_counted() -> None:
    assert _batch().metrics.mixed_version_sequences == 1  # versions (1, 2); unknown ones ignored


def test_as_dict_is_flat_numbers() -> None:
    d = _batch().metrics.as_dict()
    assert d["samples/split/branch"] == 2.0
    assert d["samples/samples_per_rollout"] == 2.0
    assert all(isinstance(v, float) for v in d.values())
