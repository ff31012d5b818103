"""`reins doctor`'s report on recorded call data (no process, no model): a toy tokenizer.

Toy text: ids 0-25 are the letters a-z; 26 is "ab" (so "ab" has two tokenizations); 27 is " ";
then chat markers, which are special (dropped from the text a harness is shown).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from reins.doctor import Detokenizer, HarnessRun, build_report, render_text
from reins.doctor.received import Answer, matches, received_answer

AB, SPACE, EOS, USER, ASSISTANT = 26, 27, 28, 29, 30
SPECIAL = {EOS: "<eos>", USER: "<user>", ASSISTANT: "<assistant>"}
VOCAB = {i: chr(ord("a") + i) for i in range(26)} | {AB: "ab", SPACE: " "} | SPECIAL


class ToyTokenizer:
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(VOCAB[i] for i in token_ids if not (skip_special_tokens and i in SPECIAL))


DETOK = Detokenizer(ToyTokenizer())


def ids(text: str) -> list[int]:
    """Letters and spaces one token each."""
    return [SPACE if c == " " else ord(c) - ord("a") for c in text]


def record(
    prompt: list[int],
    response: list[int],
    *,
    shown: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A successful chat call as the proxy records it; the harness was shown `shown` (default:
    what the response tokens say)."""
    text = DETOK.shown(response) if shown is None else shown
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "prompt_token_ids": prompt,
        "response_token_ids": response,
        "response_logprobs": [-0.5] * len(response),
        "response": {"choices": [{"index": 0, "message": message}]},
        "status": 200,
        "kind": "chat",
        "finish_reason": "stop",
        "error": None,
        **extra,
    }


FIRST_PROMPT = [USER, *ids("name a fruit"), ASSISTANT]


def conversation(answer: list[int], sent_back: list[int] | None = None) -> list[dict[str, Any]]:
    """Two turns: the second prompt carries `sent_back` (default: the sampled answer) as the
    assistant turn."""
    first = record(FIRST_PROMPT, [*answer, EOS])
    back = answer if sent_back is None else sent_back
    second_prompt = [*FIRST_PROMPT, *back, EOS, USER, *ids("another"), ASSISTANT]
    return [first, record(second_prompt, [*ids("fig"), EOS])]


def run(calls: list[dict[str, Any]], name: str = "r1", returncode: int | None = 0) -> HarnessRun:
    return HarnessRun(name, calls, returncode, seconds=1.0)


def checks(report: Any) -> dict[str, str]:
    return {f.check: f.severity for f in report.findings}


def test_append_only_harness_merges_every_rollout_and_passes() -> None:
    report = build_report(
        [run(conversation(ids("kiwi")), "r1"), run(conversation(ids("plum")), "r2")], DETOK
    )
    assert report.ok is True
    assert (report.calls, report.trainable_calls, report.sequences) == (4, 4, 2)
    assert report.samples_per_rollout == 1.0
    assert report.one_sequence_ratio == 1.0
    assert report.splits == {}
    assert (report.fidelity_checked, report.fidelity_mismatched) == (4, 0)
    assert report.findings == []


def test_response_tokens_that_differ_from_what_the_harness_received_fail() -> None:
    calls = conversation(ids("kiwi"))
    calls[0] = record(FIRST_PROMPT, [*ids("kiwi"), EOS], shown="kiwi and the stop text")
    report = build_report([run(calls)], DETOK)
    assert report.ok is False
    assert report.fidelity_mismatched == 1
    assert checks(report) == {"mismatch": "error"}
    (finding,) = report.findings
    assert "r1 call 1" in finding.message and "'kiwi'" in finding.message
    assert "embedded engine" in finding.fix


def test_retokenized_and_transformed_splits_are_named_with_their_boundary() -> None:
    retokenized = conversation([AB, *ids("c")], sent_back=ids("abc"))  # "ab" re-encoded a|b
    transformed = conversation(ids("kiwi"), sent_back=ids("kiwi fruit"))  # the harness edited
    report = build_report([run(retokenized, "r1"), run(transformed, "r2")], DETOK)
    assert report.ok is True  # splits cost efficiency, not correctness
    assert report.splits == {"retokenized": 1, "transformed": 1}
    assert report.samples_per_rollout == 2.0
    assert report.one_sequence_ratio == 0.0
    example = report.split_examples["retokenized"]
    assert (example.rollout_id, example.call) == ("r1", 2)
    assert example.before[-1] == "<assistant>"
    assert example.recorded[:2] == ["ab", "c"]
    assert example.next_prompt[:3] == ["a", "b", "c"]
    edited = report.split_examples["transformed"]
    assert "".join(edited.before).endswith("kiwi")
    assert edited.recorded[0] == "<eos>" and edited.next_prompt[0] == " "
    assert checks(report) == {"split:retokenized": "warning", "split:transformed": "warning"}
    assert [r.splits for r in report.rollouts] == [["retokenized"], ["transformed"]]


def test_a_dropped_answer_is_reported_as_intended() -> None:
    first = record(FIRST_PROMPT, [*ids("bad"), EOS])
    retry_prompt = [USER, *ids("name a fruit"), USER, *ids("format"), ASSISTANT]
    report = build_report([run([first, record(retry_prompt, [*ids("fig"), EOS])])], DETOK)
    assert report.splits == {"dropped": 1}
    assert checks(report) == {"split:dropped": "info"}


def rewritten_history(first_request: Any, second_request: Any, kind: str) -> list[Any]:
    """Two calls whose token evidence is a `template` split (an earlier turn reads otherwise in
    the second prompt: "name a red fruit" where "name a fruit" was), with these requests."""
    first = record(FIRST_PROMPT, [*ids("kiwi"), EOS], request=first_request, kind=kind)
    second_prompt = [USER, *ids("name a red fruit"), ASSISTANT, *ids("kiwi"), EOS, USER]
    second = record([*second_prompt, *ids("another"), ASSISTANT], [*ids("fig"), EOS])
    if kind == "messages":  # the recorded answers in the Messages API's shape
        first["response"] = {"content": [{"type": "text", "text": "kiwi"}]}
        second["response"] = {"content": [{"type": "text", "text": "fig"}]}
    return [first, {**second, "request": second_request, "kind": kind}]


def chat(*messages: tuple[str, str]) -> dict[str, Any]:
    return {"model": "policy", "messages": [{"role": r, "content": c} for r, c in messages]}


def test_a_harness_that_rewrites_its_history_is_told_apart_from_the_template() -> None:
    """`split:template` covered both: its fix said "either the harness changed an earlier
    message or the template renders it differently". The requests say which: the harness that
    changed its first message is `edited`, with a fix of its own; the one that sent its history
    back unchanged leaves the template."""
    asked = ("user", "name a fruit")
    edited = rewritten_history(
        chat(asked),
        chat(("user", "name a red fruit"), ("assistant", "kiwi"), ("user", "another")),
        "chat",
    )
    unchanged = rewritten_history(
        chat(asked), chat(asked, ("assistant", "kiwi"), ("user", "another")), "chat"
    )
    report = build_report([run(edited, "r1"), run(unchanged, "r2")], DETOK)
    assert report.splits == {"template": 1, "edited": 1}
    assert [r.splits for r in report.rollouts] == [["edited"], ["template"]]
    assert report.split_examples["edited"].rollout_id == "r1"
    findings = {f.check: f for f in report.findings}
    assert set(findings) == {"split:template", "split:edited"}
    assert findings["split:edited"].severity == "warning"
    assert "the harness changed" in findings["split:edited"].fix
    assert "sent its history back unchanged" in findings["split:template"].fix
    assert "edited 1" in render_text(report, "agent")


def test_markers_and_spellings_of_the_same_messages_are_no_edit() -> None:
    """Claude Code moves its `cache_control` marker to the last message on every call, and an
    API may spell one message as a string or as text blocks: the engine is asked the same
    conversation, so a split there is the template's, not an edit."""
    marker = {"type": "ephemeral"}
    first = {
        "model": "policy",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "be brief", "cache_control": marker}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": marker}]}
        ],
    }
    second = {
        **first,
        "system": "be brief",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "kiwi"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "more", "cache_control": marker}],
            },
        ],
    }
    report = build_report([run(rewritten_history(first, second, "messages"))], DETOK)
    assert report.splits == {"template": 1}
    changed = {**second, "system": "be very brief"}
    report = build_report([run(rewritten_history(first, changed, "messages"))], DETOK)
    assert report.splits == {"edited": 1}


def test_calls_without_token_ids_or_logprobs_cannot_be_trained() -> None:
    no_ids = record([], [], error="the engine returned no token IDs", finish_reason="length")
    no_logprobs = record(FIRST_PROMPT, [*ids("kiwi"), EOS], response_logprobs=None)
    positive = record(FIRST_PROMPT, [*ids("fig"), EOS], response_logprobs=[0.5, -1.0, -1.0, -1.0])
    report = build_report([run([no_ids, no_logprobs, positive])], DETOK)
    assert report.ok is False
    assert (report.missing_token_ids, report.bad_logprobs, report.trainable_calls) == (1, 2, 0)
    assert checks(report) == {"no_token_ids": "error", "no_logprobs": "error"}


def test_every_call_failed_is_an_error_and_some_failed_a_warning() -> None:
    failed = {"status": 400, "error": "the prompt is too long", "kind": "chat", "response": {}}
    all_failed = build_report([run([failed, failed], returncode=1)], DETOK)
    assert all_failed.ok is False
    assert checks(all_failed) == {"failed": "error", "harness_exit": "error"}
    assert "status 400: the prompt is too long" in all_failed.findings[0].message
    some = build_report([run([failed, *conversation(ids("kiwi"))])], DETOK)
    assert some.ok is True
    assert checks(some) == {"failed": "warning"}
    assert some.sequences == 1  # the failed call takes no part in merging


def test_calls_of_which_none_can_be_trained_are_an_error() -> None:
    """Every call abandoned (a client timeout shorter than the engine's latency) and every run
    exiting 1: the verdict was OK, exit 0."""
    late = record(FIRST_PROMPT, [*ids("pear"), EOS], abandoned=True, status=499)
    empty = record(FIRST_PROMPT, [], finish_reason="stop", response_logprobs=[])
    report = build_report([run([late, late, empty], returncode=0)], DETOK)
    assert report.ok is False
    assert checks(report) == {"abandoned": "warning", "empty": "info", "no_trainable": "error"}
    (finding,) = [f for f in report.findings if f.check == "no_trainable"]
    assert finding.message == "none of the 3 calls can be trained on (2 abandoned, 1 empty answers)"
    assert report.rollouts[0].failed == 0  # abandoned calls are not failed ones
    crashed = build_report([run([late], returncode=1), run([late], "r2", None)], DETOK)
    assert checks(crashed) == {
        "abandoned": "warning",
        "harness_exit": "error",
        "no_trainable": "error",
    }
    some_crashed = build_report([run(conversation(ids("kiwi"))), run([late], "r2", 1)], DETOK)
    assert checks(some_crashed) == {"abandoned": "warning", "harness_exit": "warning"}


def test_a_call_recorded_without_a_status_is_read_as_200_as_the_trainer_reads_it() -> None:
    calls = conversation(ids("kiwi"))
    for call in calls:
        del call["status"]
    report = build_report([run(calls)], DETOK)
    assert (report.failed_calls, report.trainable_calls, report.sequences) == (0, 2, 1)
    assert report.rollouts[0].failed == 0


def test_calls_that_ask_for_several_models_are_warned_about() -> None:
    """The policy serves any name: a judge the harness meant as another model was merged into
    the policy's sequence and trained, and the doctor said nothing."""
    calls = conversation(ids("kiwi"))
    calls[0]["request"] = {"model": "policy", "messages": []}
    calls[1]["request"] = {"model": "gpt-4o-mini", "messages": []}
    report = build_report([run(calls)], DETOK)
    assert checks(report) == {"models": "warning"}
    (finding,) = report.findings
    assert finding.message == "the harness asked for 2 models: policy (1), gpt-4o-mini (1)"
    calls[1]["request"] = {"model": "policy", "messages": []}
    assert checks(build_report([run(calls)], DETOK)) == {}


def test_requests_the_gateway_did_not_serve_are_summed_over_runs_and_warned_about() -> None:
    """An embeddings call got a 404 and left no event: the report said nothing of it."""
    embeddings, files = "POST …/openai/v1/embeddings (404)", "GET …/openai/v1/files (404)"
    first = HarnessRun("r1", conversation(ids("kiwi")), 0, 1.0, "", {embeddings: 2})
    second = HarnessRun("r2", conversation(ids("fig")), 0, 1.0, "", {embeddings: 1, files: 1})
    report = build_report([first, second], DETOK)
    assert report.unserved_requests == {
        "POST …/openai/v1/embeddings (404)": 3,
        "GET …/openai/v1/files (404)": 1,
    }
    assert checks(report) == {"unserved": "warning"}
    (finding,) = report.findings
    assert finding.count == 4
    assert finding.message == (
        "the gateway does not serve 4 requests the harness sent: "
        "POST …/openai/v1/embeddings (404) x3, GET …/openai/v1/files (404) x1"
    )
    assert report.to_json()["unserved_requests"] == report.unserved_requests
    assert checks(build_report([run(conversation(ids("kiwi")))], DETOK)) == {}


def test_the_unused_choices_of_an_n_call_are_not_counted_as_retries() -> None:
    """`n = 2`: one record per choice, the harness went on with the second; the table said the
    first was "retried"."""
    first_a = record(FIRST_PROMPT, [*ids("kiwi"), EOS], request={"n": 2}, choice_index=0)
    first_b = record(FIRST_PROMPT, [*ids("fig"), EOS], request={"n": 2}, choice_index=1)
    second = record([*FIRST_PROMPT, *ids("fig"), EOS, USER, *ids("more"), ASSISTANT], ids("yes"))
    report = build_report([run([first_a, first_b, second])], DETOK)
    assert (report.unused_choices, report.retried_calls, report.sequences) == (1, 0, 1)
    assert "0 retried, 1 unused choices)" in render_text(report)
    retried = record(FIRST_PROMPT, [*ids("kiwi"), EOS], request={"n": 1})
    report = build_report([run([retried, first_b | {"request": {}}, second])], DETOK)
    assert (report.unused_choices, report.retried_calls) == (0, 1)
    assert "0 abandoned, 1 retried)" in render_text(report)


def test_no_call_in_any_run_is_an_error() -> None:
    report = build_report([run([]), run([])], DETOK)
    assert report.ok is False
    assert checks(report) == {"no_calls": "error"}
    assert report.samples_per_rollout is None


def test_an_abandoned_call_is_left_out_and_warned_about() -> None:
    calls = conversation(ids("kiwi"))
    late = record(FIRST_PROMPT, [*ids("pear"), EOS], abandoned=True)
    report = build_report([run([late, *calls])], DETOK)
    assert (report.abandoned_calls, report.trainable_calls, report.sequences) == (1, 2, 1)
    assert checks(report) == {"abandoned": "warning"}


def test_tool_call_round_trip_and_stop_truncation_are_counted() -> None:
    tool_ids = ids("zzz")  # stands for the call's text; without a tokenizer text is not read
    shown_call = [{"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]
    first = record(FIRST_PROMPT, [*tool_ids, EOS], shown="", tool_calls=shown_call)
    first["finish_reason"] = "tool_calls"
    first["stop_reason"] = "</tool_call>"
    second_prompt = [*FIRST_PROMPT, *tool_ids, EOS, USER, *ids("seen"), ASSISTANT]
    second = record(second_prompt, [*ids("done"), EOS], stop_reason="observation")
    third_prompt = [*second_prompt, *ids("done"), *ids("observation"), EOS, ASSISTANT]
    third = record(third_prompt, [*ids("ok"), EOS])
    report = build_report([run([first, second, third])], None)  # token evidence only
    assert (report.tool_call_turns, report.tool_call_merged) == (1, 1)
    assert (report.stop_truncated, report.stop_followed_by_split) == (1, 1)
    assert report.fidelity_checked == 0
    assert checks(report) == {
        "split:unknown": "warning",
        "stop": "warning",
        "no_tokenizer": "warning",
    }


def test_counts_of_one_take_the_singular() -> None:
    """`reins doctor --runs 1` said "1 runs", "1 calls" and "1 runs made no call"."""
    one_call = record(FIRST_PROMPT, [*ids("kiwi"), EOS])
    text = render_text(build_report([run([one_call])], DETOK), "agent")
    assert text.startswith("reins doctor: 1 run of `agent`")
    assert "r1: exit 0, 1.0 s, 1 call (0 failed) -> 1 sequence" in text
    silent = build_report([run([one_call]), run([], "r2"), run([one_call], "r3")], DETOK)
    assert [f.message for f in silent.findings if f.check == "no_calls"] == ["1 run made no call"]
    two = build_report([run([one_call, one_call]), run([one_call], "r2")], DETOK)
    assert "reins doctor: 2 runs" in render_text(two) and "2 calls (0 failed)" in render_text(two)


def test_text_and_json_show_the_same_figures() -> None:
    report = build_report(
        [run(conversation(ids("kiwi"), sent_back=ids("kiwi fruit"))), run([], "r2", None)], DETOK
    )
    text = render_text(report, "python agent.py")
    assert "of `python agent.py`" in text
    assert "samples per rollout           2.00" in text
    assert "transformed 1" in text
    assert "r2: timed out" in text
    assert "sampled:   '…" in text and "‖" in text
    assert text.rstrip().endswith("verdict: OK, this harness can be trained (exit 0)")
    data = json.loads(json.dumps(report.to_json()))
    assert data["ok"] is True
    assert data["samples_per_rollout"] == 2.0
    assert data["splits"] == {"transformed": 1}
    assert data["split_examples"]["transformed"]["call"] == 2
    assert [f["check"] for f in data["findings"]] == [
        "no_calls",
        "harness_exit",
        "split:transformed",
    ]


@pytest.mark.parametrize(
    ("kind", "response", "expected"),
    [
        ("completions", {"choices": [{"text": "kiwi"}]}, Answer("kiwi")),
        (
            "responses",
            {
                "output": [
                    {"type": "message", "content": [{"type": "output_text", "text": "ok"}]},
                    {"type": "function_call", "name": "look", "arguments": '{"a": 1}'},
                ]
            },
            Answer("ok", (("look", {"a": 1}),)),
        ),
        (
            "messages",
            {"content": [{"type": "tool_use", "name": "look", "input": {"a": 1}}]},
            Answer("", (("look", {"a": 1}),)),
        ),
    ],
)
def test_each_wire_api_answer_is_read(
    kind: str, response: dict[str, Any], expected: Answer
) -> None:
    assert received_answer(kind, response) == expected


def test_tool_calls_match_as_json_values_not_as_text() -> None:
    sampled = 'Let me look.\n<tool_call>\n{"name": "look", "arguments": {"a": 1}}\n</tool_call>'
    assert matches(sampled, Answer("Let me look.", (("look", {"a": 1}),))) is True
    assert matches(sampled, Answer("Let me look.", (("look", {"a": 2}),))) is False
    assert matches(sampled, Answer("Let me look.\n", (("look", {"a": 1}),))) is False
    assert matches("kiwi", Answer("kiwi ")) is False


def test_prompts_as_int32_arrays_give_the_same_report_as_lists() -> None:
    """The dashboard's fidelity page restores stored calls with each prompt an array
    (`reins.monitor.fidelity.harness_runs`): the report must be the one `reins doctor` makes
    from the JSON lists."""
    empty = record(FIRST_PROMPT, [], finish_reason="stop")  # an empty answer, not missing IDs
    no_ids = record([], [*ids("fig"), EOS])
    cases = [
        [run(conversation(ids("kiwi")), "r1"), run([empty, no_ids], "r2")],
        [run(conversation([AB, *ids("c")], sent_back=ids("abc")), "r3")],
    ]
    for runs in cases:
        arrays = [
            run(
                [
                    {**c, "prompt_token_ids": np.array(c["prompt_token_ids"], np.int32)}
                    for c in r.calls
                ],
                r.rollout_id,
            )
            for r in runs
        ]
        expected = build_report(runs, DETOK).to_json()
        assert build_report(arrays, DETOK).to_json() == expected
    assert (expected["trainable_calls"], expected["splits"]) == (2, {"retokenized": 1})
