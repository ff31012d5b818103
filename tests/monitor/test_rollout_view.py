"""The rollout page's data (`reins.monitor.rollout.attempt_view`), from events alone."""

from __future__ import annotations

import base64
import dataclasses
import math
from datetime import UTC, datetime
from typing import Any

import numpy as np

from reins.monitor.rollout import MAX_LOG_TAIL, attempt_view
from reins.packed import Base, pack, unpack_events
from reins.schemas import Event, PackedEvent
from tests.monitor.factory import chat_call
from tests.stub_engine import decode

USER = {"role": "user", "content": "hi"}


def events(*items: dict[str, Any], attempt: int = 1) -> list[Event]:
    return [
        Event(
            seq=i + 1,
            rollout_id="r",
            attempt_id=attempt,
            type=item["type"],
            data=item["data"],
            idempotency_key=f"k{i}",
            created_at=datetime.now(UTC),
        )
        for i, item in enumerate(items)
    ]


def test_a_continued_conversation_merges_and_shows_only_new_messages() -> None:
    second = [USER, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    view = attempt_view("r", 1, events(chat_call([USER], "hello"), chat_call(second, "ok")))
    first, then = view.calls
    assert (first.boundary.kind, then.boundary.kind) == ("first", "merge")
    assert then.boundary.sequence == 1
    assert then.earlier_messages == 2  # the user turn and the reply it got
    assert [m.text for m in then.messages] == ["more"]
    assert view.sequences == 1 and view.split_counts == {}


def test_a_changed_history_is_a_split_with_its_reason_and_is_shown_whole() -> None:
    changed = [USER, {"role": "assistant", "content": "HELLO"}, {"role": "user", "content": "?"}]
    fresh = [{"role": "user", "content": "a new task entirely, unrelated to the first"}]
    view = attempt_view(
        "r",
        1,
        events(chat_call([USER], "hello"), chat_call(changed, "x"), chat_call(fresh, "y")),
    )
    _, second, third = view.calls
    assert (second.boundary.kind, second.boundary.reason) == ("split", "unknown")
    assert (third.boundary.kind, third.boundary.reason) == ("split", "branch")
    assert view.split_counts == {"unknown": 1, "branch": 1}
    assert third.earlier_messages == 0


def test_split_reasons_come_from_text_when_a_decoder_is_given() -> None:
    changed = [USER, {"role": "assistant", "content": "HELLO"}, {"role": "user", "content": "?"}]
    view = attempt_view(
        "r",
        1,
        events(chat_call([USER], "hello"), chat_call(changed, "x")),
        decode=lambda ids: decode([int(i) for i in ids]),
    )
    assert view.calls[1].boundary.reason == "transformed"


def test_retried_and_failed_calls_say_why_they_are_not_trained_on() -> None:
    view = attempt_view(
        "r",
        1,
        events(
            chat_call([USER], "a"),
            chat_call([USER], "b"),
            chat_call([USER], "", status=500, error="boom"),
        ),
    )
    retried, kept, failed = view.calls
    assert retried.boundary.kind == "retry" and "call 2" in retried.boundary.text
    assert kept.boundary.kind == "first"
    assert failed.boundary.kind == "skipped" and "status 500" in failed.boundary.text
    assert failed.response[0].text == "boom"


def test_a_boundary_names_calls_by_the_numbers_the_page_shows_them_with() -> None:
    # Calls were named by their place among the calls trained on: after a failed call, "call 3"
    # named the page's call 4, and "as in call N" the call before, whatever it was.
    invalid = chat_call([USER], "z")
    invalid["data"]["status"] = "oops"
    second = [USER, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
    fresh = [{"role": "user", "content": "a new task entirely, unrelated to the first"}]
    view = attempt_view(
        "r",
        1,
        events(
            chat_call([USER], "a"),
            chat_call([USER], "", status=500, error="boom"),
            invalid,
            chat_call(second, "b"),
            chat_call(fresh, "c"),
            chat_call(fresh, "c"),
        ),
    )
    assert [c.index for c in view.calls] == [1, 2, 4, 5, 6]
    _, _, merged, retried, kept = view.calls
    assert "no valid call record" in view.items[2].pretty and "call 3" in view.items[2].pretty
    assert merged.boundary.kind == "merge"
    assert (merged.earlier_messages, merged.previous_index) == (1, 2)  # the user turn
    assert retried.boundary.text.startswith("dropped as a retry: call 6 ")
    assert kept.boundary.kind == "split"
    assert "with call 4's prompt + response" in kept.boundary.text


def test_low_probability_tokens_are_counted_and_carry_their_logprob() -> None:
    logprobs = [math.log(0.9), math.log(0.005), math.log(0.5)]
    view = attempt_view("r", 1, events(chat_call([USER], "abc", logprobs=logprobs)))
    (call,) = view.calls
    assert call.low_tokens == 1
    assert call.min_logprob == min(logprobs)
    assert [round(t.p or 0, 3) for t in call.tokens] == [0.9, 0.005, 0.5]
    assert all(t.is_id for t in call.tokens)  # no text known without a tokenizer


def test_token_text_comes_from_the_engines_logprobs_when_the_harness_asked() -> None:
    call = chat_call([USER], "ab")
    call["data"]["response"]["choices"][0]["logprobs"] = {
        "content": [{"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -0.2}]
    }
    (view,) = attempt_view("r", 1, events(call)).calls
    assert [t.text for t in view.tokens] == ["a", "b"]
    assert not any(t.is_id for t in view.tokens)


def test_a_tokenizer_names_the_tokens_otherwise() -> None:
    view = attempt_view(
        "r", 1, events(chat_call([USER], "ab")), token_texts=lambda ids: [chr(i) for i in ids]
    )
    assert [t.text for t in view.calls[0].tokens] == ["a", "b"]


def test_rewards_logs_and_custom_events_keep_their_order() -> None:
    view = attempt_view(
        "r",
        1,
        events(
            chat_call([USER], "a"),
            {"type": "tool_result", "data": {"exit": 0}},
            {"type": "reward", "data": {"value": 1.0, "reason": "ok"}},
            {"type": "agent_log", "data": {"outcome": "crashed", "exit_code": 137, "tail": "OOM"}},
        ),
    )
    assert [item.type for item in view.items] == [
        "model_request",
        "tool_result",
        "reward",
        "agent_log",
    ]
    assert view.rewards[0]["value"] == 1.0
    assert view.logs[0]["tail"] == "OOM"
    assert '"exit": 0' in view.items[1].pretty


def test_events_of_other_attempts_are_left_out() -> None:
    mixed = events(chat_call([USER], "a")) + events(chat_call([USER], "b"), attempt=2)
    for i, event in enumerate(mixed):
        event.seq = i + 1
    assert len(attempt_view("r", 2, mixed).calls) == 1


def test_a_call_whose_logprobs_do_not_match_its_tokens_is_shown_and_trained_without_them() -> None:
    """The trainer's rule (`reins.samples.records.call_of`): such logprobs are unknown, the
    call is trained; the page draws its tokens without logprobs."""
    broken = chat_call([USER], "abc", logprobs=[-0.1])
    view = attempt_view("r", 1, events(broken))
    assert view.samples_error is None
    assert [token.logprob for token in view.calls[0].tokens] == [None, None, None]
    assert view.calls[0].boundary.kind == "first"


def test_tool_uses_and_tool_calls_read_as_what_was_run_and_what_came_back() -> None:
    asked = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "run_shell", "arguments": '{"command": "wc -l data.csv"}'},
            }
        ],
    }
    answered = [USER, asked, {"role": "tool", "tool_call_id": "call_1", "content": "12 data.csv"}]
    view = attempt_view(
        "r",
        1,
        events(
            chat_call([USER], "<search>founder of Orlin Vale</search>"),
            {
                "type": "tool",
                "data": {
                    "name": "search",
                    "input": "founder of Orlin Vale",
                    "output": "Orlin Vale was founded by Maren Ostby.",
                    "ok": True,
                    "seconds": 0.004,
                },
            },
            {"type": "tool", "data": {"name": "run_shell", "input": {"command": "curl x"}}},
            chat_call(answered, "12"),
        ),
    )
    search, shell = (item.tool for item in view.items if item.tool is not None)
    assert search is not None and shell is not None
    assert (search.name, search.input.text, search.ok, search.seconds) == (
        "search",
        "founder of Orlin Vale",
        True,
        0.004,
    )
    assert search.output.text == "Orlin Vale was founded by Maren Ostby."
    assert shell.input.text == '{\n "command": "curl x"\n}' and shell.output.text == ""
    call_message, tool_message = view.calls[1].messages[-2:]
    assert call_message.text == '→ run_shell [call_1]\n{\n "command": "wc -l data.csv"\n}'
    assert (tool_message.role, tool_message.text) == ("tool [call_1]", "12 data.csv")


def test_tool_call_arguments_show_their_text_as_written() -> None:
    # Arguments were shown as ASCII JSON: a model's "résumé" read "r\u00e9sum\u00e9", in
    # every API's tool calls (a chat call's string, a Messages `tool_use` block's object).
    asked = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "function": {"name": "write", "arguments": '{"text": "résumé 你好"}'}}
        ],
    }
    chat = chat_call([USER, asked, {"role": "user", "content": "ok"}], "done")
    block = {"type": "tool_use", "id": "t1", "name": "write", "input": {"text": "naïve ✓"}}
    messages = wire_call("messages", {"messages": [USER]}, {"content": [block]})
    view = attempt_view("r", 1, events(chat, messages))
    assert view.calls[0].messages[1].text == '→ write [c1]\n{\n "text": "résumé 你好"\n}'
    assert view.calls[1].response[0].text == '→ write [t1]\n{\n "text": "naïve ✓"\n}'


def as_stored(whole: list[Event]) -> list[PackedEvent]:
    """The events as the store keeps them: each call packed against the previous ones."""
    stored: list[PackedEvent] = []
    bases: list[Base] = []
    for event in whole:
        packed = pack(event.data, bases) if event.type == "model_request" else None
        data, blob = event.data, None
        if packed is not None:
            data, blob = packed.skeleton, base64.b64encode(packed.blob).decode()
            bases.append(packed.as_base(event.seq))
        stored.append(PackedEvent(**{**event.model_dump(), "data": data}, packed=blob))
    return stored


def test_the_view_of_prompts_restored_as_arrays_is_the_view_of_the_lists() -> None:
    """The rollout page restores stored calls with `token_arrays` (a long rollout's prompts as
    lists were 13 M Python ints); what it shows must not change."""
    second = [USER, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    changed = [USER, {"role": "assistant", "content": "HELLO"}, {"role": "user", "content": "?"}]
    invalid = chat_call([USER], "z")
    invalid["data"]["status"] = "oops"
    whole = events(
        chat_call([USER], "hello"),
        chat_call(second, "ok"),
        chat_call(changed, "x"),
        chat_call([USER], "", status=500, error="boom"),
        invalid,
    )
    restored = unpack_events(as_stored(whole), token_arrays=True)
    assert sum(isinstance(e.data.get("prompt_token_ids"), np.ndarray) for e in restored) == 5
    expected, got = attempt_view("r", 1, whole), attempt_view("r", 1, restored)
    assert [c.prompt_tokens for c in got.calls] == [c.prompt_tokens for c in expected.calls]
    assert [c.prompt_tokens for c in got.calls][:2] == [
        len(e.data["prompt_token_ids"]) for e in whole[:2]
    ]
    assert [dataclasses.astuple(c.boundary) for c in got.calls] == [
        dataclasses.astuple(c.boundary) for c in expected.calls
    ]
    assert [(c.messages, c.earlier_messages, c.tokens) for c in got.calls] == [
        (c.messages, c.earlier_messages, c.tokens) for c in expected.calls
    ]
    assert (got.sequences, got.split_counts) == (expected.sequences, expected.split_counts)
    # Nor is the array made a list again: pydantic validates an array element by element
    # (~37 ms for a 64k-token prompt here, 40x the list's time).
    assert [c.record.prompt_token_ids for c in got.calls] == [[]] * 4
    (shown,) = [item for item in got.items if item.type == "invalid"]
    assert shown.data == whole[-1].data  # lists again: the page prints it as JSON


def wire_call(kind: str, request: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """A call recorded from another wire API: `request` and `response` in its shape."""
    call = chat_call([USER], "ok")
    call["data"].update(kind=kind, request=request, response=response)
    return call


def shown(messages: list[Any]) -> list[tuple[str, str]]:
    return [(m.role, m.text) for m in messages]


FILES = {"role": "user", "content": [{"type": "input_text", "text": "list the files"}]}
LS = {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "ls"}'}
LS_OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "a.py"}
ANSWER = [
    {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "one to read"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "One."}]},
    {"type": "function_call", "call_id": "c2", "name": "read", "arguments": '{"path": "a.py"}'},
]


def test_a_responses_call_reads_as_a_chat_call() -> None:
    request = {"instructions": "Be brief.", "input": [FILES, LS, LS_OUTPUT]}
    call = wire_call("responses", request, {"output": ANSWER, "status": "completed"})
    (view,) = attempt_view("r", 1, events(call)).calls
    assert shown(view.messages) == [
        ("instructions", "Be brief."),
        ("user", "list the files"),
        ("assistant", '→ shell [c1]\n{\n "cmd": "ls"\n}'),
        ("tool [c1]", "a.py"),
    ]
    assert shown(view.response) == [
        (
            "assistant",
            '[reasoning]\none to read\n[/reasoning]\nOne.\n→ read [c2]\n{\n "path": "a.py"\n}',
        )
    ]


def test_a_responses_call_that_sends_the_answer_back_shows_only_what_is_new() -> None:
    first = {"instructions": "Be brief.", "input": [FILES, LS, LS_OUTPUT]}
    output = {"type": "function_call_output", "call_id": "c2", "output": "print(1)"}
    second = {"instructions": "Be brief.", "input": [FILES, LS, LS_OUTPUT, *ANSWER, output]}
    calls = events(
        wire_call("responses", first, {"output": ANSWER}),
        wire_call("responses", second, {"output": [ANSWER[1]]}),
    )
    then = attempt_view("r", 1, calls).calls[1]
    assert then.earlier_messages == 5  # the four of the first call and its answer
    assert shown(then.messages) == [("tool [c2]", "print(1)")]
    assert shown(then.response) == [("assistant", "One.")]


def test_an_anthropic_messages_call_reads_as_a_chat_call() -> None:
    request = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "fix it"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "look first", "signature": ""},
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "no such dir"},
                    {"type": "text", "text": "go on"},
                ],
            },
        ],
    }
    response = {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Done."},
            {"type": "tool_use", "id": "t2", "name": "bash", "input": {"cmd": "pytest"}},
        ],
        "stop_reason": "tool_use",
    }
    (view,) = attempt_view("r", 1, events(wire_call("messages", request, response))).calls
    assert shown(view.messages) == [
        ("system", "Be brief."),
        ("user", "fix it"),
        (
            "assistant",
            '[reasoning]\nlook first\n[/reasoning]\nLooking.\n→ bash [t1]\n{\n "cmd": "ls"\n}',
        ),
        ("tool [t1]", "no such dir"),
        ("user", "go on"),
    ]
    assert shown(view.response) == [("assistant", 'Done.\n→ bash [t2]\n{\n "cmd": "pytest"\n}')]


def test_an_anthropic_tool_result_that_is_an_error_says_so() -> None:
    result = {"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": "denied"}
    request = {"messages": [{"role": "user", "content": [result]}]}
    response = {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}
    (view,) = attempt_view("r", 1, events(wire_call("messages", request, response))).calls
    assert shown(view.messages) == [("tool (error) [t1]", "denied")]


def test_an_answer_recorded_with_a_capture_problem_is_shown_with_the_problem() -> None:
    problem = "the engine returned no token IDs; this call cannot be trained on"
    call = chat_call([USER], "hello", error=problem)
    call["data"].update(response_token_ids=[], response_logprobs=None)
    (view,) = attempt_view("r", 1, events(call)).calls
    assert shown(view.response) == [("assistant", "hello"), ("capture problem", problem)]


def test_a_long_agent_log_tail_is_cut_to_its_end() -> None:
    tail = "x" * 10 + "y" * MAX_LOG_TAIL
    log = {"type": "agent_log", "data": {"outcome": "failed", "exit_code": 1, "tail": tail}}
    view = attempt_view("r", 1, events(log))
    assert view.logs[0]["tail"] == "y" * MAX_LOG_TAIL
    assert view.logs[0]["tail_cut"] == 10


def test_token_text_comes_from_a_responses_answers_logprobs() -> None:
    logprobs = [{"token": "o", "logprob": -0.1}, {"token": "k", "logprob": -0.2}]
    part = {"type": "output_text", "text": "ok", "logprobs": logprobs}
    output = [{"type": "message", "role": "assistant", "content": [part]}]
    call = wire_call("responses", {"input": "hi"}, {"output": output})
    (view,) = attempt_view("r", 1, events(call)).calls
    assert [t.text for t in view.tokens] == ["o", "k"]
