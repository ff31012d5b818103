"""Split diagnosis rules on a toy vocabulary (real-tokenizer cases: test_samples_tokenizer.py).

Toy text: ids 0-25 are the letters a-z; 26 is "ab" (so "ab" has two tokenizations); then markers.
"""

from __future__ import annotations

import numpy as np
from samples_factory import call

from reins.samples import diagnose_split, merge_calls
from reins.samples.records import TokenArray

AB, THINK, END_THINK, EOS, SYS, USER, ASSISTANT = 26, 27, 28, 29, 30, 31, 32
VOCAB = {i: chr(ord("a") + i) for i in range(26)} | {
    AB: "ab",
    THINK: "<think>",
    END_THINK: "</think>",
    EOS: "<eos>",
    SYS: "<sys>",
    USER: "<user>",
    ASSISTANT: "<assistant>",
}


def decode(ids: TokenArray) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


def t(*ids: int) -> TokenArray:
    return np.asarray(ids, dtype=np.int32)


PROMPT = t(SYS, 7, 8, USER, 2, 3)  # "<sys>hi<user>cd"


def test_same_text_with_other_token_ids_is_retokenized() -> None:
    response = t(AB, EOS)  # sampled "ab" as one token
    next_prompt = np.concatenate([PROMPT, t(0, 1, EOS, USER, 4)])  # re-encoded as "a", "b"
    assert diagnose_split(PROMPT, response, next_prompt, decode) == "retokenized"


def test_response_text_changed_after_an_intact_prompt_is_transformed() -> None:
    response = t(0, 1, EOS)  # "ab"
    next_prompt = np.concatenate([PROMPT, t(1, 0, EOS, USER, 4)])  # the harness saw "ba"
    assert diagnose_split(PROMPT, response, next_prompt, decode) == "transformed"


def test_reasoning_dropped_from_the_response_is_template() -> None:
    response = t(THINK, 7, END_THINK, 0, EOS)  # "<think>h</think>a<eos>"
    next_prompt = np.concatenate([PROMPT, t(0, EOS, USER, 4)])  # "a<eos>..."
    assert diagnose_split(PROMPT, response, next_prompt, decode) == "template"


def test_without_elision_a_dropped_reasoning_block_reads_as_transformed() -> None:
    response = t(THINK, 7, END_THINK, 0, EOS)
    next_prompt = np.concatenate([PROMPT, t(0, EOS, USER, 4)])
    assert diagnose_split(PROMPT, response, next_prompt, decode, elide=None) == "transformed"


def test_history_rerendered_before_the_response_is_template() -> None:
    # an earlier assistant turn had a reasoning block; the next render drops it
    prompt = t(SYS, USER, 2, THINK, 8, END_THINK, 4, EOS, USER, 5)
    response = t(THINK, 9, END_THINK, 10, 11, EOS)  # "<think>j</think>kl<eos>"
    next_prompt = t(SYS, USER, 2, 4, EOS, USER, 5, 10, 11, EOS, USER, 3)
    assert diagnose_split(prompt, response, next_prompt, decode) == "template"


def test_a_prompt_that_does_not_carry_the_history_is_a_branch() -> None:
    response = t(0, 1, EOS)
    summary = t(SYS, USER, 18, 20, 12, EOS)  # "<sys><user>sum": a new context
    assert diagnose_split(PROMPT, response, summary, decode) == "branch"


def test_without_decode_an_intact_prompt_is_unknown() -> None:
    response = t(AB, EOS)
    next_prompt = np.concatenate([PROMPT, t(0, 1, EOS)])
    assert diagnose_split(PROMPT, response, next_prompt) == "unknown"


def test_without_decode_a_prompt_sharing_little_is_a_branch() -> None:
    assert diagnose_split(PROMPT, t(0, EOS), t(SYS, 20, 21, 22, 23)) == "branch"


def test_merge_reports_the_diagnosed_reason() -> None:
    c1 = call(PROMPT.tolist(), [AB, EOS], seq=1)
    c2 = call([*PROMPT.tolist(), 0, 1, EOS, USER, 4], [5], seq=2)
    _, splits = merge_calls([c1, c2], rollout_id="r-1", decode=decode)
    assert [(s.rollout_id, s.reason) for s in splits] == [("r-1", "retokenized")]


# -- harnesses that rewrite their history --------------------------------------------------------
# Chat-shaped toy prompts: each ends with the generation prompt `<assistant>`.

CHAT_PROMPT = t(SYS, 7, 8, USER, 2, 3, ASSISTANT)  # "<sys>hi<user>cd<assistant>"


def test_a_response_left_out_of_the_next_history_is_dropped() -> None:
    response = t(0, 1, EOS)  # rejected by the harness
    next_prompt = t(SYS, 7, 8, USER, 2, 3, USER, 4, 17, 17, ASSISTANT)  # "...<user>err<assistant>"
    assert diagnose_split(CHAT_PROMPT, response, next_prompt, decode) == "dropped"


def test_without_decode_a_response_left_out_of_the_next_history_is_dropped() -> None:
    response = t(0, 1, EOS)
    next_prompt = t(SYS, 7, 8, USER, 2, 3, USER, 4, 17, 17, ASSISTANT)
    assert diagnose_split(CHAT_PROMPT, response, next_prompt) == "dropped"


def test_a_response_moved_into_the_inserted_text_is_not_dropped() -> None:
    response = t(0, 1, EOS)
    next_prompt = t(SYS, 7, 8, USER, 2, 3, USER, 0, 1, EOS, ASSISTANT)  # quoted in a user turn
    assert diagnose_split(CHAT_PROMPT, response, next_prompt, decode) != "dropped"
    assert diagnose_split(CHAT_PROMPT, response, next_prompt) != "dropped"


def test_a_history_replaced_by_the_summary_the_response_wrote_is_compacted() -> None:
    # the previous call was asked for a summary of a long history; the next prompt keeps the
    # system turn and the summary only
    long_history = t(SYS, 7, 8, USER, 2, 3, *range(4, 20), USER, 18, 20, 12, ASSISTANT)
    summary = t(18, 20, 12, 12, 0, 17, 24, EOS)  # "summary"
    next_prompt = t(SYS, 7, 8, USER, 18, 20, 12, 12, 0, 17, 24, ASSISTANT)
    assert diagnose_split(long_history, summary, next_prompt, decode) == "compacted"


def test_earlier_turns_replaced_by_a_summary_with_the_last_turn_kept_is_compacted() -> None:
    prompt = t(SYS, 7, 8, USER, 2, 3, ASSISTANT, *range(4, 18), EOS, USER, 20, ASSISTANT)
    response = t(0, 1, EOS)
    # "<sys>hi<user>cd<user>sum<assistant>ab<eos><user>w<assistant>"
    next_prompt = t(SYS, 7, 8, USER, 2, 3, USER, 18, 20, 12, ASSISTANT, 0, 1, EOS, USER, 22)
    assert diagnose_split(prompt, response, next_prompt, decode) == "compacted"
