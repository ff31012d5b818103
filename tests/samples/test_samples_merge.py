"""Dedup of retried calls and best-effort merging (paper eq. 9, section 3.2)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from samples_factory import call, continuing

from reins.samples import Call, dedup_calls, merge_calls


def test_dedup_keeps_the_last_of_identical_prompts() -> None:
    calls = [call([1, 2], [3], seq=1), call([9], [9], seq=2), call([1, 2], [4], seq=3)]
    assert [c.seq for c in dedup_calls(calls)] == [2, 3]


def test_dedup_keeps_the_choice_the_harness_went_on_with() -> None:
    """A call with `n: 2` is two records with one prompt; the harness went on with choice 0.
    Keeping the last (choice 1) trained an answer nobody used and split the rollout there."""
    choice_0 = call([1, 2], [3, 4], seq=1)
    choice_1 = call([1, 2], [5, 6], seq=2)
    next_turn = continuing(choice_0, [7], [8], seq=3)
    kept = dedup_calls([choice_0, choice_1, next_turn])
    assert [c.seq for c in kept] == [1, 3]
    (sequence,), splits = merge_calls(kept)
    assert splits == [] and sequence.token_ids.tolist() == [1, 2, 3, 4, 7, 8]
    # Choice 1 taken, or a retry (the harness goes on with the last answer): the last is kept.
    went_on = continuing(choice_1, [7], [8], seq=3)
    assert [c.seq for c in dedup_calls([choice_0, choice_1, went_on])] == [2, 3]
    # Nothing after them continues either (the rollout ended there): the last, as before.
    assert [c.seq for c in dedup_calls([choice_0, choice_1, call([9], [9], seq=3)])] == [2, 3]


def test_the_last_call_of_an_n_request_keeps_its_first_choice() -> None:
    """Nothing continues a rollout's last call: of its `n: 3` choices the last (choice 2) was
    trained, while a harness that shows no other takes `choices[0]`. Retries (each choice 0)
    still keep the last."""
    choices = [replace(call([1, 2], [3 + k], seq=1 + k), choice=k) for k in range(3)]
    assert [c.seq for c in dedup_calls(choices)] == [1]
    earlier = call([1], [2], seq=0)
    assert [c.seq for c in dedup_calls([earlier, *choices])] == [0, 1]
    retries = [call([1, 2], [3 + k], seq=1 + k) for k in range(3)]
    assert [c.seq for c in dedup_calls(retries)] == [3]
    # A retry of an `n: 2` request: the last try's first choice.
    tries = [replace(call([1, 2], [10 + k], seq=1 + k), choice=k % 2) for k in range(4)]
    assert [c.seq for c in dedup_calls(tries)] == [3]


def test_dedup_keeps_each_answer_of_a_fan_out_that_was_gone_on_with() -> None:
    """Two threads of a harness ask the same thing and each goes on with its own answer: one
    was dropped as a retry, an answer the harness used never trained."""
    first_a = call([1, 2], [10, 11], seq=1)
    first_b = call([1, 2], [20, 21], seq=2)
    then_a = continuing(first_a, [7], [12], seq=3)
    then_b = continuing(first_b, [7], [22], seq=4)
    assert [c.seq for c in dedup_calls([first_a, first_b, then_a, then_b])] == [1, 2, 3, 4]
    # Two tries with the same answer, both gone on with: that answer once (the last).
    again = call([1, 2], [10, 11], seq=2)
    assert [c.seq for c in dedup_calls([first_a, again, then_a])] == [2, 3]


def test_interleaved_conversations_each_merge_into_their_own_sequence() -> None:
    """Two threads (a fan-out, or a sub-agent between its caller's turns): only consecutive
    calls merged, so A1 B1 A2 B2 made four sequences, each boundary a split ("transformed" for
    the second thread's first call, whose prompt is the first one's)."""
    first_a = call([1, 2], [10, 11], seq=1)
    first_b = call([1, 2], [20, 21], seq=2)
    then_a = continuing(first_a, [7], [12], seq=3)
    then_b = continuing(first_b, [7], [22], seq=4)
    last_a = continuing(then_a, [8], [13], seq=5)
    sequences, splits = merge_calls([first_a, first_b, then_a, then_b, last_a])
    assert [s.call_seqs for s in sequences] == [(1, 3, 5), (2, 4)]
    assert sequences[0].token_ids.tolist() == [1, 2, 10, 11, 7, 12, 8, 13]
    assert sequences[1].token_ids.tolist() == [1, 2, 20, 21, 7, 22]
    assert [(s.before_seq, s.after_seq, s.reason) for s in splits] == [(1, 2, "branch")]


def test_a_sub_agent_between_two_turns_leaves_its_caller_one_sequence() -> None:
    caller = call([1, 2, 3], [4], seq=1)
    sub_first = call([9, 9], [5], seq=2)
    sub_then = continuing(sub_first, [6], [7], seq=3)
    caller_then = continuing(caller, [5, 7], [8], seq=4)  # the sub-agent's answer as a result
    sequences, splits = merge_calls([caller, sub_first, sub_then, caller_then])
    assert [s.call_seqs for s in sequences] == [(1, 4), (2, 3)]
    assert [(s.before_seq, s.after_seq) for s in splits] == [(1, 2)]


def test_a_call_continuing_two_open_sequences_extends_the_longer() -> None:
    short = call([1], [2], seq=1)
    other = call([5], [6], seq=2)  # opens a second sequence
    longer = continuing(short, [3], [4], seq=3)  # [1, 2, 3, 4]
    detour = call([7], [8], seq=4)
    both = call([1, 2, 3, 4, 9], [10], seq=5)  # continues seq 3, which itself continues seq 1
    sequences, _ = merge_calls([short, other, longer, detour, both])
    assert [s.call_seqs for s in sequences] == [(1, 3, 5), (2,), (4,)]


def test_dedup_keeps_prompts_that_differ_only_in_a_token() -> None:
    calls = [call([1, 2], [3], seq=1), call([1, 5], [3], seq=2)]
    assert [c.seq for c in dedup_calls(calls)] == [1, 2]


def test_a_continuing_call_merges_into_one_sequence() -> None:
    c1 = call([1, 2, 3], [4, 5], seq=1)
    c2 = continuing(c1, [6, 7], [8], seq=2)
    (seq,), splits = merge_calls([c1, c2])
    assert splits == []
    assert seq.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert seq.loss_mask.tolist() == [False, False, False, True, True, False, False, True]


def test_merged_sequence_carries_logprobs_on_responses_and_zero_elsewhere() -> None:
    c1 = call([1], [2, 3], seq=1, logprobs=[-0.1, -0.2])
    c2 = continuing(c1, [4], [5], seq=2)
    c2.logprobs = np.array([-0.3], np.float32)
    (seq,), _ = merge_calls([c1, c2])
    assert seq.old_logprobs.dtype == np.float32
    assert seq.old_logprobs.tolist() == np.array([0, -0.1, -0.2, 0, -0.3], np.float32).tolist()


def test_a_call_without_logprobs_gets_nan_on_its_response_only() -> None:
    c1 = call([1], [2, 3], seq=1)
    c1.logprobs = None
    (seq,), _ = merge_calls([c1])
    assert seq.old_logprobs[0] == 0.0
    assert np.isnan(seq.old_logprobs[1:]).all()


def test_a_prompt_that_changes_a_sampled_token_starts_a_new_sequence() -> None:
    c1 = call([1, 2], [3, 4], seq=1)
    c2 = call([1, 2, 3, 99, 5], [6], seq=2)  # the response was re-encoded: 4 -> 99
    seqs, splits = merge_calls([c1, c2], rollout_id="r")
    assert [s.token_ids.tolist() for s in seqs] == [[1, 2, 3, 4], [1, 2, 3, 99, 5, 6]]
    assert (splits[0].before_seq, splits[0].after_seq, splits[0].shared_tokens) == (1, 2, 3)


def test_merge_never_stitches_the_sampled_response_into_a_later_prompt() -> None:
    c1 = call([1, 2], [3, 4], seq=1)
    c2 = call([1, 2, 3, 99, 5], [6], seq=2)
    seqs, _ = merge_calls([c1, c2])
    second = seqs[1]
    start = second.response_spans[0][0]
    assert second.token_ids[:start].tolist() == c2.prompt.tolist()


def test_merge_compares_against_the_whole_history_not_only_the_last_call() -> None:
    c1 = call([1], [2], seq=1)
    c2 = continuing(c1, [3], [4], seq=2)
    c3 = call([1, 2, 3, 4, 5], [6], seq=3)  # continues c1 + c2 token for token
    c4 = call([1, 9, 3, 4, 5, 6, 7], [8], seq=4)  # ends like the history, but differs early
    seqs, splits = merge_calls([c1, c2, c3, c4])
    assert [s.call_seqs for s in seqs] == [(1, 2, 3), (4,)]
    assert len(splits) == 1


def test_a_prompt_equal_to_the_history_merges_with_no_observation() -> None:
    c1 = call([1], [2], seq=1)
    c2 = call([1, 2], [3], seq=2)
    (seq,), _ = merge_calls([c1, c2])
    assert seq.token_ids.tolist() == [1, 2, 3]
    assert seq.response_spans == ((1, 2), (2, 3))


def test_a_shorter_prompt_starts_a_new_sequence() -> None:
    c1 = call([1, 2, 3], [4], seq=1)
    c2 = call([1, 2], [5], seq=2)
    seqs, _ = merge_calls([c1, c2])
    assert len(seqs) == 2


def test_sequences_keep_event_seqs_and_weight_versions_of_their_calls() -> None:
    c1 = call([1], [2], seq=10, version=3)
    c2 = continuing(c1, [3], [4], seq=12)
    c2.model_version = 4
    c3 = call([50], [51], seq=15, version=4)
    seqs, _ = merge_calls([c1, c2, c3])
    assert [(s.call_seqs, s.model_versions) for s in seqs] == [((10, 12), (3, 4)), ((15,), (4,))]


def test_calls_that_are_views_of_one_buffer_merge_only_where_their_tokens_continue() -> None:
    """The trainer's binary read lays a rollout's calls out in one buffer; the merge takes a
    view of the same memory as equal without comparing it, and compares everything else: a
    view that overlaps but starts elsewhere, or one not aligned to its values, is compared."""
    buffer = np.array([1, 2, 3, 4, 5, 6, 7, 8, 8, 9], dtype=np.int32)
    first = Call(prompt=buffer[0:3], response=buffer[3:5], seq=1)
    second = Call(prompt=buffer[0:7], response=buffer[7:8], seq=2)
    (merged,), splits = merge_calls([first, second])
    assert splits == [] and merged.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    # Same memory one token on: [2, 3, 4] is not [1, 2, 3].
    shifted = Call(prompt=buffer[1:8], response=buffer[8:9], seq=2)
    assert len(merge_calls([first, shifted])[0]) == 2
    # Overlapping views holding equal tokens ([8] at 7 and at 8) still merge: values decide.
    repeat = Call(prompt=buffer[7:8], response=buffer[9:10], seq=1)
    after = Call(prompt=buffer[8:10], response=buffer[9:10], seq=2)
    assert len(merge_calls([repeat, after])[0]) == 1
    # int32 values one byte off their alignment share their first bytes with the aligned view
    # of the same memory, not their values.
    raw = np.zeros(32, dtype=np.uint8)
    raw[4:24] = np.array([1, 2, 3, 4, 5], dtype="<i4").view(np.uint8)
    aligned, unaligned = raw[4:24].view(np.int32), raw[5:29].view(np.int32)
    assert aligned.flags.aligned and not unaligned.flags.aligned
    assert np.shares_memory(unaligned[:1], aligned[:1]) and unaligned[0] != aligned[0]
    first = Call(prompt=aligned[:3], response=aligned[3:5], seq=1)
    off = Call(prompt=unaligned, response=buffer[5:6], seq=2)
    assert np.shares_memory(off.prompt, raw)
    assert len(merge_calls([first, off])[0]) == 2
