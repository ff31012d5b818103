"""The Anthropic Messages translation (reins.gateway.wire.messages), pure, checked by value and
against the real `anthropic` SDK: its types, its SSE decoder and its stream accumulator (the SDK
runs offline over an httpx mock transport that answers with our bytes)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from reins.gateway.capture import CallFacts, StreamRecorder
from reins.gateway.wire import WireError
from reins.gateway.wire.messages import (
    KIND,
    Translation,
    count_tokens_request,
    error_body,
    translate,
)
from reins.gateway.wire.responses import translate as translate_responses

FIXTURES = Path(__file__).parent.parent / "fixtures" / "cli_requests"
EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)


def captured(name: str) -> list[dict[str, Any]]:
    """The bodies of the Messages API requests in a captured CLI session."""
    lines = (FIXTURES / name).read_text().splitlines()
    requests = [json.loads(line) for line in lines if line.strip()]
    return [
        r["body"]
        for r in requests
        if r["method"] == "POST" and r["path"].split("?")[0].endswith("/v1/messages")
    ]


def user(content: Any = "hi") -> dict[str, Any]:
    return {"role": "user", "content": content}


def body(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "policy", "max_tokens": 100, "messages": list(messages or [user()]), **fields}


TOOL_TURN = [
    user("List the files"),
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "call_7", "name": "Bash", "input": {"command": "ls"}},
        ],
    },
]
BASH = {"name": "Bash", "description": "Runs a command", "input_schema": {"type": "object"}}


# ---- requests: the captured CLIs --------------------------------------------------------------


def test_the_fixtures_hold_the_messages_requests_of_each_cli() -> None:
    assert [len(captured(name)) for name in ("claude.jsonl", "claude-tool.jsonl")] == [2, 2]
    assert len(captured("opencode-anthropic-tool.jsonl")) == 3


def test_claude_codes_first_request_keeps_system_blocks_and_its_system_role_message() -> None:
    sent = captured("claude.jsonl")[0]
    chat = translate(sent).chat_request()
    messages = chat["messages"]
    system_texts = [block["text"] for block in sent["system"]]
    assert system_texts[0].startswith("x-anthropic-billing-header: ")
    assert messages[0] == {"role": "system", "content": "\n".join(system_texts)}
    first_user = [block["text"] for block in sent["messages"][0]["content"]]
    assert messages[1] == {"role": "user", "content": "\n".join(first_user)}
    assert messages[2] == {"role": "system", "content": sent["messages"][1]["content"]}
    assert len(messages) == 3
    assert [t["function"]["name"] for t in chat["tools"]] == [t["name"] for t in sent["tools"]]
    assert [t["function"]["parameters"] for t in chat["tools"]] == [
        t["input_schema"] for t in sent["tools"]
    ]
    assert chat["tools"][1]["function"]["description"] == sent["tools"][1]["description"]
    assert chat["max_tokens"] == 64000
    assert chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True}
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert "model" not in chat and "tool_choice" not in chat


def test_claude_codes_request_notes_what_the_engine_ignores() -> None:
    translation = translate(captured("claude.jsonl")[0])
    notes = "\n".join(translation.notes)
    assert "thinking adaptive" in notes
    assert "output_config ignored (effort)" in notes
    assert "context_management ignored" in notes
    assert "unknown fields" not in notes
    assert translation.stream is True
    assert KIND == "messages"


def test_output_config_format_is_the_chat_response_format() -> None:
    """Structured output: the engine constrains the answer to the schema, as Anthropic does."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hi"}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "high"},
    }
    translation = translate(body)
    assert translation.chat_request()["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
    assert translation.notes == ["output_config ignored (effort)"]
    for config, param in [
        ("high", "output_config"),
        ({"format": {"type": "json_object"}}, "output_config.format"),
        ({"format": {"type": "json_schema", "schema": "{}"}}, "output_config.format.schema"),
    ]:
        with pytest.raises(WireError) as refused:
            translate({**body, "output_config": config})
        assert refused.value.param == param


@pytest.mark.parametrize("name", ["claude.jsonl", "claude-tool.jsonl"])
def test_claude_codes_tool_turn_answers_the_earlier_tool_use_with_a_tool_message(
    name: str,
) -> None:
    sent = captured(name)[1]
    tool_use = sent["messages"][2]["content"][0]
    result = sent["messages"][3]["content"][0]
    messages = translate(sent).chat_request()["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "system", "assistant", "tool"]
    call = messages[3]["tool_calls"][0]
    assert call["id"] == tool_use["id"] == result["tool_use_id"]
    assert call["function"]["name"] == "Bash"
    assert json.loads(call["function"]["arguments"]) == tool_use["input"]
    assert messages[3]["content"] == ""
    assert messages[4] == {
        "role": "tool",
        "tool_call_id": tool_use["id"],
        "content": "README.md\nhello.py",
    }


def test_opencodes_title_request_has_one_system_block_and_no_tools() -> None:
    sent = captured("opencode-anthropic-tool.jsonl")[0]
    chat = translate(sent).chat_request()
    assert chat["messages"] == [
        {"role": "system", "content": sent["system"][0]["text"]},
        {
            "role": "user",
            "content": 'Generate a title for this conversation:\n\n"List the files here"',
        },
    ]
    assert "tools" not in chat and chat["max_tokens"] == 32000


def test_opencodes_tool_turn_maps_tools_choice_and_the_tool_result() -> None:
    first, second = captured("opencode-anthropic-tool.jsonl")[1:]
    chat = translate(first).chat_request()
    assert chat["tool_choice"] == "auto"
    assert [t["function"]["name"] for t in chat["tools"]] == [t["name"] for t in first["tools"]]
    messages = translate(second).chat_request()["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    call_id = second["messages"][1]["content"][0]["id"]
    assert messages[2]["tool_calls"][0]["id"] == call_id
    assert json.loads(messages[2]["tool_calls"][0]["function"]["arguments"]) == {"command": "ls"}
    assert messages[3] == {
        "role": "tool",
        "tool_call_id": call_id,
        "content": "README.md\nhello.py\n",
    }


def test_count_tokens_request_is_the_conversation_and_tools_without_max_tokens() -> None:
    sent = dict(captured("opencode-anthropic-tool.jsonl")[2])
    del sent["max_tokens"]
    chat = count_tokens_request(sent)
    assert set(chat) == {"messages", "tools", "tool_choice"}
    called = translate({**sent, "max_tokens": 1}).chat_request()
    assert chat == {key: called[key] for key in ("messages", "tools", "tool_choice")}
    assert count_tokens_request({"model": "m", "messages": [user()]}) == {"messages": [user()]}


@pytest.mark.parametrize("model", [None, 7, {"name": "m"}], ids=repr)
def test_count_tokens_requires_a_model_name_as_the_call_does(model: Any) -> None:
    """Anthropic's `count_tokens` requires `model` (a 400 without it), as the call does: it was
    counted without one."""
    sent = {"messages": [user()]} | ({} if model is None else {"model": model})
    for refused in (
        lambda: count_tokens_request(sent),
        lambda: translate({**sent, "max_tokens": 1}),
    ):
        with pytest.raises(WireError, match="model's name") as raised:
            refused()
        assert raised.value.param == "model"


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [BASH], "tool_choice": {"type": "none"}},
        {"tools": [BASH], "tool_choice": {"type": "tool", "name": "Bash"}},
        {"thinking": {"type": "disabled"}},
        {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048},
    ],
    ids=["tool-choice-none", "tool-choice-named", "thinking-off", "thinking-on"],
)
def test_count_tokens_request_has_every_field_that_shapes_the_calls_prompt(
    fields: dict[str, Any],
) -> None:
    """The count is of the prompt the same request would get: the tool choice (the embedded
    engine renders no tools for `none`) and the thinking switch (a Qwen3-style template renders
    it) are sent to `/tokenize` as they are to the chat call; the sampling fields are not."""
    sent = body(user(), **fields, top_p=0.97, stop_sequences=["x"])
    called = translate(sent).chat_request()
    counted = count_tokens_request({k: v for k, v in sent.items() if k != "max_tokens"})
    prompt_fields = ("messages", "tools", "tool_choice", "chat_template_kwargs")
    assert counted == {key: called[key] for key in prompt_fields if key in called}


@pytest.mark.parametrize("empty", ["", [], [{"type": "text", "text": ""}]], ids=repr)
def test_an_empty_last_assistant_message_is_no_prefill_and_is_dropped(empty: Any) -> None:
    """Anthropic accepts an empty last assistant message: there is nothing to continue, so the
    answer is the new turn (noted), and the count is of that same prompt."""
    sent = body(user(), {"role": "assistant", "content": empty})
    translation = translate(sent)
    assert (
        translation.chat_request()["messages"] == translate(body(user())).chat_request()["messages"]
    )
    assert translation.notes == ["messages[1]: an empty last assistant message dropped"]
    assert count_tokens_request(sent)["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "last",
    [
        "The answer is",
        [{"type": "text", "text": "The answer is"}],
        [
            {"type": "thinking", "thinking": "hm", "signature": ""},
            {"type": "text", "text": "The answer is"},
        ],
    ],
    ids=["string", "text-block", "thinking-then-text"],
)
def test_a_last_assistant_message_with_text_is_a_prefill_the_engine_continues(last: Any) -> None:
    """A prefill (Anthropic continues the last assistant message's text) is asked of the engine
    as vLLM's `continue_final_message`, the prompt ending inside that message (it was a 400,
    though both engines can continue one)."""
    chat = translate(body(user(), {"role": "assistant", "content": last})).chat_request()
    assert chat["messages"][-1]["content"] == "The answer is"
    assert (chat["continue_final_message"], chat["add_generation_prompt"]) == (True, False)


def test_a_conversation_ending_with_a_user_message_opens_a_new_turn() -> None:
    chat = translate(body(user())).chat_request()
    assert "continue_final_message" not in chat and "add_generation_prompt" not in chat


def test_an_empty_assistant_message_after_an_assistant_one_leaves_that_one_the_prefill() -> None:
    """Anthropic joins consecutive messages of one role: the empty last one adds nothing, and
    the text before it is what the answer continues."""
    assistant = {"role": "assistant", "content": "The answer is"}
    translation = translate(body(user(), assistant, {"role": "assistant", "content": ""}))
    chat = translation.chat_request()
    assert chat["messages"][-1] == {"role": "assistant", "content": "The answer is"}
    assert chat["continue_final_message"] is True
    assert translation.notes == ["messages[2]: an empty last assistant message dropped"]


@pytest.mark.parametrize(
    ("last", "says"),
    [
        ([{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}], "tool_result"),
        ([{"type": "thinking", "thinking": "hm", "signature": ""}], "no text to continue"),
        ("The answer is ", "trailing whitespace"),
        ([{"type": "text", "text": "The answer is\n"}], "trailing whitespace"),
    ],
    ids=["tool_use", "thinking-alone", "trailing-space", "trailing-newline"],
)
def test_a_last_assistant_message_that_cannot_be_continued_is_refused(last: Any, says: str) -> None:
    """A tool_use waits for its result and a thinking block has no text to continue; a prefill
    that ends with whitespace is a 400 at Anthropic too."""
    with pytest.raises(WireError, match=says) as raised:
        translate(body(user(), {"role": "assistant", "content": last}))
    assert raised.value.param == "messages[1]"


def test_count_tokens_refuses_a_bad_thinking_field_as_the_call_does() -> None:
    with pytest.raises(WireError, match="thinking"):
        count_tokens_request({"model": "m", "messages": [user()], "thinking": "x"})


# ---- requests: each rule ---------------------------------------------------------------------


def test_tool_results_come_before_the_text_of_the_same_user_message() -> None:
    turn = user(
        [
            {"type": "text", "text": "and then?"},
            {
                "type": "tool_result",
                "tool_use_id": "call_7",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    messages = translate(body(*TOOL_TURN, turn)).chat_request()["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": "Looking.",
        "tool_calls": [
            {
                "id": "call_7",
                "type": "function",
                "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
            }
        ],
    }
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "call_7", "content": "a\nb"},
        {"role": "user", "content": "and then?"},
    ]


def test_consecutive_messages_of_one_role_are_one_turn_as_anthropic_joins_them() -> None:
    """Anthropic combines consecutive user (or assistant) messages into one turn; sent apart,
    a chat template renders two turns, and one that needs alternating roles refuses them."""
    split = [
        user("List the files"),
        user([{"type": "text", "text": "in /tmp"}]),
        {"role": "assistant", "content": "Looking."},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "call_7", "name": "Bash", "input": {"command": "ls"}}
            ],
        },
        user([{"type": "tool_result", "tool_use_id": "call_7", "content": "a"}]),
        user("and then?"),
    ]
    translation = translate(body(*split))
    assert translation.chat_request()["messages"] == [
        {"role": "user", "content": "List the files\nin /tmp"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "call_7",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "a"},
        {"role": "user", "content": "and then?"},
    ]
    assert [note.split(" joined")[0] for note in translation.notes] == [
        "messages[1]",
        "messages[3]",
        "messages[5]",
    ]
    # A system message between two user messages keeps them apart, as it is its own turn.
    apart = translate(body(user("a"), {"role": "system", "content": "s"}, user("b")))
    assert [m["role"] for m in apart.chat_request()["messages"]] == ["user", "system", "user"]
    # A refusal still names the block where it was sent.
    with pytest.raises(WireError) as raised:
        translate(body(user("hi"), user([{"type": "hologram"}])))
    assert raised.value.param == "messages[1].content[0]"


def test_an_error_tool_result_is_marked_in_its_content() -> None:
    turn = user(
        [
            {
                "type": "tool_result",
                "tool_use_id": "call_7",
                "content": "no such file",
                "is_error": True,
            }
        ]
    )
    messages = translate(body(*TOOL_TURN, turn)).chat_request()["messages"]
    assert messages[-1] == {
        "role": "tool",
        "tool_call_id": "call_7",
        "content": "Error: no such file",
    }


def test_thinking_in_the_history_becomes_reasoning_content_and_redacted_thinking_a_note() -> None:
    answer = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "The user greets.", "signature": ""},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Hello!"},
        ],
    }
    translation = translate(body(user(), answer, user("again")))
    assistant = translation.chat_request()["messages"][1]
    assert assistant == {
        "role": "assistant",
        "content": "Hello!",
        "reasoning_content": "The user greets.",
    }
    assert any("redacted_thinking dropped" in note for note in translation.notes)


def test_server_tools_are_dropped_and_tool_choice_is_mapped() -> None:
    tools = [
        BASH,
        {"type": "web_search_20250305", "name": "web_search"},
        {"type": "bash_20250124", "name": "bash"},
    ]
    cases = {
        "auto": "auto",
        "any": "required",
        "none": "none",
        "tool": {"type": "function", "function": {"name": "Bash"}},
    }
    for kind, expected in cases.items():
        choice = {"type": kind, "disable_parallel_tool_use": True}
        if kind == "tool":
            choice["name"] = "Bash"
        translation = translate(body(tools=tools, tool_choice=choice))
        chat = translation.chat_request()
        assert chat["tool_choice"] == expected
        assert chat["parallel_tool_calls"] is False
        assert chat["tools"] == [
            {
                "type": "function",
                "function": {
                    "name": "Bash",
                    "parameters": {"type": "object"},
                    "description": "Runs a command",
                },
            }
        ]
        dropped = [note for note in translation.notes if "server tool" in note]
        assert len(dropped) == 2 and "web_search_20250305" in dropped[0]


def test_sampling_fields_are_passed_on() -> None:
    sent = body(
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        stop_sequences=["</done>"],
        metadata={"user_id": "u"},
        service_tier="auto",
        mcp_servers=[{"type": "url", "url": "http://127.0.0.1:1", "name": "m"}],
        thinking={"type": "disabled"},
    )
    translation = translate(sent)
    chat = translation.chat_request()
    assert {k: chat[k] for k in ("temperature", "top_p", "top_k", "stop", "stream")} == {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "stop": ["</done>"],
        "stream": False,
    }
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert "stream_options" not in chat
    assert any("mcp_servers dropped" in note for note in translation.notes)
    assert translate(body(extra_field=1)).notes == ["unknown fields ignored: extra_field"]


BAD_REQUESTS: dict[str, tuple[Callable[[dict[str, Any]], None], str, str]] = {
    "missing max_tokens": (lambda b: b.pop("max_tokens"), "max_tokens", "positive integer"),
    "metadata not an object": (lambda b: b.update(metadata="x"), "metadata", "an object"),
    "unknown block type": (
        lambda b: b["messages"][0]["content"].append({"type": "hologram"}),
        "messages[0].content[1]",
        "'hologram'",
    ),
    "tool_result for an unknown id": (
        lambda b: b["messages"][0]["content"].append(
            {"type": "tool_result", "tool_use_id": "toolu_nowhere", "content": "x"}
        ),
        "messages[0].content[1].tool_use_id",
        "'toolu_nowhere'",
    ),
    "messages not a list": (lambda b: b.update(messages="hi"), "messages", "list of messages"),
    "image block": (
        lambda b: b["messages"][0]["content"].insert(
            0,
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}},
        ),
        "messages[0].content[0]",
        "text models",
    ),
    "prefill ending with whitespace": (
        lambda b: b["messages"].append({"role": "assistant", "content": "The answer is "}),
        "messages[1]",
        "trailing whitespace",
    ),
    "tool_choice naming no tool": (
        lambda b: b.update(tools=[BASH], tool_choice={"type": "tool", "name": "Nope"}),
        "tool_choice.name",
        "'Nope'",
    ),
    "tool_use without input object": (
        lambda b: b["messages"].insert(
            0,
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "x", "input": []}],
            },
        ),
        "messages[0].content[0].input",
        "object",
    ),
    # The ranges and emptiness Anthropic's API refuses with a 400, refused here too: a harness
    # trained through the proxy meets the errors it meets when deployed.
    "temperature above 1": (lambda b: b.update(temperature=1.5), "temperature", "0 to 1"),
    "negative temperature": (lambda b: b.update(temperature=-0.1), "temperature", "0 to 1"),
    "top_p above 1": (lambda b: b.update(top_p=1.01), "top_p", "0 to 1"),
    "negative top_k": (lambda b: b.update(top_k=-1), "top_k", "0 or more"),
    "empty stop sequence": (
        lambda b: b.update(stop_sequences=["</done>", ""]),
        "stop_sequences",
        "non-whitespace",
    ),
    "whitespace stop sequence": (
        lambda b: b.update(stop_sequences=["\n"]),
        "stop_sequences",
        "non-whitespace",
    ),
    "thinking budget below 1024": (
        lambda b: b.update(thinking={"type": "enabled", "budget_tokens": 1000}, max_tokens=4000),
        "thinking.budget_tokens",
        "1024 or more",
    ),
    "thinking budget not below max_tokens": (
        lambda b: b.update(thinking={"type": "enabled", "budget_tokens": 2000}, max_tokens=2000),
        "max_tokens",
        "greater than thinking.budget_tokens (2000)",
    ),
    "thinking with a forced tool": (
        lambda b: b.update(
            thinking={"type": "enabled", "budget_tokens": 1024},
            max_tokens=4000,
            tools=[BASH],
            tool_choice={"type": "any"},
        ),
        "tool_choice",
        "forces tool use",
    ),
    "thinking with a temperature": (
        lambda b: b.update(
            thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=4000, temperature=0.2
        ),
        "temperature",
        "only be set to 1",
    ),
    "thinking with top_k": (
        lambda b: b.update(
            thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=4000, top_k=5
        ),
        "top_k",
        "may not be set",
    ),
    "thinking with a low top_p": (
        lambda b: b.update(
            thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=4000, top_p=0.9
        ),
        "top_p",
        "0.95 to 1",
    ),
    "empty user content": (
        lambda b: b["messages"].insert(0, user("")),
        "messages[0]",
        "non-empty content",
    ),
    "no blocks in an assistant message": (
        lambda b: b["messages"].extend([{"role": "assistant", "content": []}, user()]),
        "messages[1]",
        "non-empty content",
    ),
    "empty text block": (
        lambda b: b["messages"][0]["content"].append({"type": "text", "text": ""}),
        "messages[0].content[1].text",
        "must be non-empty",
    ),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_a_bad_request_is_refused_naming_the_field(case: str) -> None:
    change, param, words = BAD_REQUESTS[case]
    sent = body(user([{"type": "text", "text": "hi"}]))
    change(sent)
    with pytest.raises(WireError) as raised:
        translate(sent)
    assert raised.value.status == 400
    assert raised.value.param == param
    assert param in raised.value.message and words in raised.value.message


# ---- answers ----------------------------------------------------------------------------------


def engine_answer(
    content: str | None,
    *,
    calls: Sequence[tuple[str, str, str]] = (),
    finish: str = "stop",
    reasoning: str | None = None,
    **choice: Any,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls
        ]
    if reasoning:
        message["reasoning_content"] = reasoning
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
    }


def test_a_text_answer_is_a_message_the_sdk_reads() -> None:
    answer = translate(body()).answer(engine_answer("Hello there."))
    message = anthropic.types.Message.model_validate(answer)
    assert message.id.startswith("msg_") and message.model == "policy"
    assert [(b.type, getattr(b, "text", None)) for b in message.content] == [
        ("text", "Hello there.")
    ]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 7)
    assert answer["usage"]["cache_read_input_tokens"] == 0


def test_a_tool_call_answer_keeps_the_engines_call_id_and_parses_its_arguments() -> None:
    calls = [("call_abc", "Bash", '{"command": "ls -la"}'), ("call_def", "Read", "{}")]
    answer = translate(body(tools=[BASH])).answer(
        engine_answer("Let me look.", calls=calls, finish="tool_calls")
    )
    message = anthropic.types.Message.model_validate(answer)
    assert message.stop_reason == "tool_use"
    text, first, second = message.content
    assert isinstance(text, anthropic.types.TextBlock) and text.text == "Let me look."
    assert isinstance(first, anthropic.types.ToolUseBlock)
    assert (first.id, first.name, first.input) == ("call_abc", "Bash", {"command": "ls -la"})
    assert isinstance(second, anthropic.types.ToolUseBlock) and second.input == {}


def test_the_next_request_maps_an_answered_tool_use_back_to_the_same_call_id() -> None:
    answer = translate(body()).answer(
        engine_answer(None, calls=[("chatcmpl-tool-9", "Bash", '{"command": "ls"}')])
    )
    result = {"type": "tool_result", "tool_use_id": answer["content"][0]["id"], "content": "a.txt"}
    sent = body(user("go"), {"role": "assistant", "content": answer["content"]}, user([result]))
    messages = translate(sent).chat_request()["messages"]
    assert messages[1]["tool_calls"][0]["id"] == "chatcmpl-tool-9"
    assert messages[2] == {"role": "tool", "tool_call_id": "chatcmpl-tool-9", "content": "a.txt"}


def test_max_tokens_stop_sequence_and_abort_finishes() -> None:
    length = translate(body(max_tokens=7)).answer(engine_answer("cut sh", finish="length"))
    assert length["stop_reason"] == "max_tokens"
    stopped = translate(body(stop_sequences=["END"])).answer(
        engine_answer("done", stop_reason="END")
    )
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    translation = translate(body())
    assert translation.answer(engine_answer("x", finish="abort"))["stop_reason"] == "end_turn"
    assert any("aborted" in note for note in translation.notes)


def test_reasoning_is_a_thinking_block_only_when_the_request_enabled_thinking() -> None:
    on = translate(body(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048))
    message = anthropic.types.Message.model_validate(
        on.answer(engine_answer("4", reasoning="2+2=4"))
    )
    thinking, text = message.content
    assert isinstance(thinking, anthropic.types.ThinkingBlock)
    assert (thinking.thinking, thinking.signature, text.type) == ("2+2=4", "", "text")
    off = translate(body())
    assert [b["type"] for b in off.answer(engine_answer("4", reasoning="2+2=4"))["content"]] == [
        "text"
    ]
    assert any("reasoning dropped" in note for note in off.notes)


def test_arguments_that_are_not_a_json_object_are_shown_as_text() -> None:
    translation = translate(body())
    answer = translation.answer(
        engine_answer(None, calls=[("c1", "Bash", '{"command": ')], finish="tool_calls")
    )
    assert answer["content"] == [{"type": "text", "text": '{"command": '}]
    assert answer["stop_reason"] == "end_turn"
    assert any("not a JSON object" in note for note in translation.notes)


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_bodies_use_anthropics_type_names(status: int, kind: str) -> None:
    assert error_body(status, "nope") == {
        "type": "error",
        "error": {"type": kind, "message": "nope"},
    }
    assert error_body(status, "nope", "api_error")["error"]["type"] == "api_error"


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [(404, "model_not_found", "not_found_error"), (503, "paused", "overloaded_error")],
)
def test_the_proxys_own_error_codes_become_anthropics_types(
    status: int, code: str, kind: str
) -> None:
    """The proxy names some failures with OpenAI-style codes; the Anthropic shape has only its
    own types (the SDK's `ErrorResponse` refuses any other)."""
    body = error_body(status, "nope", code)
    assert body == {"type": "error", "error": {"type": kind, "message": "nope"}}
    TypeAdapter(anthropic.types.ErrorResponse).validate_python(body)


# ---- the real SDK over a mock transport ---------------------------------------------------------


def sdk(handler: Callable[[httpx2.Request], httpx2.Response]) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="test",
        base_url="http://127.0.0.1:9",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )


def test_the_sdk_sends_a_request_we_translate_and_reads_our_answer() -> None:
    seen: list[Any] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        translation = translate(json.loads(request.content))
        seen.append(translation.chat_request())
        answer = engine_answer(
            "Hi!", calls=[("call_1", "Bash", '{"command": "pwd"}')], finish="tool_calls"
        )
        return httpx2.Response(200, json=translation.answer(answer))

    message = sdk(handler).messages.create(
        model="policy",
        max_tokens=50,
        system="Be brief.",
        messages=[{"role": "user", "content": "where am I?"}],
        tools=[{"name": "Bash", "input_schema": {"type": "object"}}],
    )
    assert seen[0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "where am I?"},
    ]
    assert message.stop_reason == "tool_use"
    assert message.content[1].type == "tool_use" and message.content[1].input == {"command": "pwd"}


def test_the_sdk_raises_our_error_body_with_its_message() -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        try:
            translate(json.loads(request.content))
        except WireError as error:
            return httpx2.Response(error.status, json=error_body(error.status, error.message))
        raise AssertionError("the request should have been refused")

    with pytest.raises(anthropic.BadRequestError) as raised:
        sdk(handler).messages.create(
            model="policy", max_tokens=0, messages=[{"role": "user", "content": "x"}]
        )
    assert raised.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "max_tokens" in raised.value.message


# ---- streams ------------------------------------------------------------------------------------


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "delta": delta or {},
        "finish_reason": finish,
        "token_ids": [5] if delta else [],
    }
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice], **extra}


USAGE = {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 9}}


def stream(translation: Translation, chunks: list[dict[str, Any]]) -> list[bytes]:
    events = [event for c in chunks for event in translation.stream_events(c)]
    return events + translation.stream_end()


def parsed(events: list[bytes]) -> list[dict[str, Any]]:
    """Each event's data, checked: one `event:` line named as its type, valid for the SDK."""
    out = []
    for event in events:
        name_line, data_line, *rest = event.decode().split("\n")
        assert (
            rest == ["", ""] and name_line.startswith("event: ") and data_line.startswith("data: ")
        )
        data = json.loads(data_line[len("data: ") :])
        assert name_line[len("event: ") :] == data["type"]
        if data["type"] != "error":
            EVENT.validate_python(data)
        out.append(data)
    return out


def sdk_final(events: list[bytes]) -> anthropic.types.Message:
    """What the SDK's own stream helper assembles from our events."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(
            200, content=b"".join(events), headers={"content-type": "text/event-stream"}
        )

    with sdk(handler).messages.stream(
        model="policy", max_tokens=9, messages=[{"role": "user", "content": "x"}]
    ) as s:
        return s.get_final_message()


def check_stream(
    translation: Translation, chunks: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], anthropic.types.Message]:
    events = stream(translation, chunks)
    datas = parsed(events)
    final = sdk_final(events)
    assembled = anthropic.types.Message.model_validate(translation.assembled())
    assert final.model_dump(exclude_none=True) == assembled.model_dump(exclude_none=True)
    return datas, final


def test_a_streamed_text_answer() -> None:
    chunks = [
        chunk({"role": "assistant", "content": "Hel"}, prompt_token_ids=[1, 2, 3]),
        chunk({"content": "lo."}),
        chunk({"content": ""}, "stop"),
        USAGE,
    ]
    datas, final = check_stream(translate(body(stream=True)), chunks)
    assert [d["type"] for d in datas] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert datas[0]["message"]["usage"]["input_tokens"] == 3
    assert [b.text for b in final.content if b.type == "text"] == ["Hello."]
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        "end_turn",
        30,
        9,
    )


def test_a_streamed_tool_call_sent_whole_in_the_last_chunk_as_the_embedded_engine_does() -> None:
    call = {
        "index": 0,
        "id": "call_x1",
        "type": "function",
        "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
    }
    chunks = [
        chunk({"role": "assistant", "content": "Listing."}),
        chunk({"content": None, "tool_calls": [call]}, "tool_calls"),
    ]
    datas, final = check_stream(translate(body(stream=True)), chunks)
    starts = [d["content_block"] for d in datas if d["type"] == "content_block_start"]
    assert starts == [
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "call_x1", "name": "Bash", "input": {}},
    ]
    text, tool = final.content
    assert text.type == "text" and text.text == "Listing."
    assert isinstance(tool, anthropic.types.ToolUseBlock)
    assert (tool.id, tool.name, tool.input) == ("call_x1", "Bash", {"command": "ls"})
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == 2  # no usage chunk: the token IDs the chunks carried


def test_vllm_style_incremental_tool_call_deltas() -> None:
    def piece(index: int, arguments: str, **head: Any) -> dict[str, Any]:
        function = {
            "arguments": arguments,
            **({"name": head.pop("name")} if "name" in head else {}),
        }
        return chunk({"tool_calls": [{"index": index, **head, "function": function}]})

    chunks = [
        chunk({"role": "assistant", "content": ""}),
        piece(0, "", id="chatcmpl-tool-a", type="function", name="Bash"),
        piece(0, '{"command": '),
        piece(0, '"ls -la", "timeout": 5}'),
        piece(1, "", id="chatcmpl-tool-b", type="function", name="Read"),
        piece(1, '{"file_path": "/tmp/ü.txt"}'),
        chunk({}, "tool_calls"),
        USAGE,
    ]
    datas, final = check_stream(translate(body(stream=True)), chunks)
    pieces = [
        d["delta"]["partial_json"]
        for d in datas
        if d["type"] == "content_block_delta" and d["index"] == 0
    ]
    assert pieces == ['{"command": "ls -la", "timeout": 5}']  # the input, parsed and written
    assert [
        (b.type, b.id, b.name, b.input)
        for b in final.content
        if isinstance(b, anthropic.types.ToolUseBlock)
    ] == [
        ("tool_use", "chatcmpl-tool-a", "Bash", {"command": "ls -la", "timeout": 5}),
        ("tool_use", "chatcmpl-tool-b", "Read", {"file_path": "/tmp/ü.txt"}),
    ]
    assert len(final.content) == 2 and final.stop_reason == "tool_use"


BASH_TOOL = {"name": "Bash", "input_schema": {"type": "object"}}


@pytest.mark.parametrize("first", [" ", "\n", "\t "])
def test_arguments_that_start_with_whitespace_are_read_by_the_sdk(first: str) -> None:
    """The SDK's accumulator parses the joined `partial_json` after every delta, and whitespace
    alone is no JSON it can read (it raised "Unable to parse tool parameter JSON")."""
    head = {"index": 0, "id": "call_w", "type": "function"}
    chunks = [
        chunk({"tool_calls": [{**head, "function": {"name": "Bash", "arguments": first}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"command": "ls"}'}}]}),
        chunk({}, "tool_calls"),
    ]
    _, final = check_stream(translate(body(stream=True, tools=[BASH_TOOL])), chunks)
    assert [(b.type, b.id, b.input) for b in final.content] == [  # type: ignore[union-attr]
        ("tool_use", "call_w", {"command": "ls"})
    ]
    blank = [chunk({"tool_calls": [{**head, "function": {"name": "Bash", "arguments": first}}]})]
    _, final = check_stream(translate(body(stream=True, tools=[BASH_TOOL])), blank)
    assert [(b.type, b.input) for b in final.content] == [("tool_use", {})]  # type: ignore[union-attr]


@pytest.mark.parametrize("arguments", ['{"x": NaN}', '{"x": -Infinity}', '{"x": 1e400}'])
def test_arguments_json_cannot_carry_are_shown_as_text(arguments: str) -> None:
    """Python's `json` reads these; no answer can carry them (the SDK's JSON is RFC 8259's, the
    store refuses them): they are no JSON object, as any other bad arguments."""
    for streamed in (False, True):
        translation = translate(body(stream=streamed, tools=[BASH_TOOL]))
        answer = engine_answer(None, calls=[("c1", "Bash", arguments)], finish="tool_calls")
        if streamed:
            call = {"index": 0, "id": "c1", "function": {"name": "Bash", "arguments": arguments}}
            _, final = check_stream(translation, [chunk({"tool_calls": [call]}, "tool_calls")])
            message = final.model_dump(exclude_none=True)
        else:
            message = translation.answer(answer)
        assert message["content"] == [{"type": "text", "text": arguments}]
        assert message["stop_reason"] == "end_turn"
        assert any("not a JSON object" in note for note in translation.notes)


def test_tool_call_deltas_without_an_index_join_the_last_call_in_every_reader() -> None:
    """One rule for the Messages and Responses streams and the recorded call: a delta without
    an `index` belongs to the call the last delta added to (a plain answer's calls, which
    have none, stay one call each)."""
    head = {"id": "call_a", "type": "function", "function": {"name": "Bash", "arguments": ""}}
    pieces = [{"function": {"arguments": '{"command": '}}, {"function": {"arguments": '"ls"}'}}]
    chunks = [chunk({"tool_calls": [call]}) for call in [head, *pieces]]
    chunks = [chunk({"role": "assistant", "content": ""}), *chunks, chunk({}, "tool_calls")]
    _, final = check_stream(translate(body(user("run ls"), tools=[BASH_TOOL])), chunks)
    assert [(b.type, b.id, b.input) for b in final.content] == [  # type: ignore[union-attr]
        ("tool_use", "call_a", {"command": "ls"})
    ]
    responses = translate_responses({"model": "m", "input": "run ls", "stream": True})
    for c in chunks:
        responses.stream_events(c)
    responses.stream_end()
    (item,) = responses.assembled()["output"]
    assert (item["call_id"], item["arguments"]) == ("call_a", '{"command": "ls"}')
    facts = CallFacts(
        kind="chat", mode="train", request={}, model="m", endpoint="", model_version=None,
        latency_s=0.0, stream=True,
    )  # fmt: skip
    recorder = StreamRecorder(facts)
    for c in [{**chunks[0], "prompt_token_ids": [1]}, *chunks[1:]]:
        recorder.feed(c)
    (record,) = recorder.records()
    (recorded,) = record.response["choices"][0]["message"]["tool_calls"]
    assert (recorded["id"], recorded["function"]["arguments"]) == ("call_a", '{"command": "ls"}')
    two = engine_answer(None, calls=[("c1", "Bash", "{}"), ("c2", "Bash", "{}")])
    answered = translate(body(user("run ls"), tools=[BASH_TOOL])).answer(two)
    assert [block["id"] for block in answered["content"]] == ["c1", "c2"]


def test_a_stop_sequence_after_tool_calls_is_a_tool_use_answer_naming_no_sequence() -> None:
    """Anthropic names `stop_sequence` only with `stop_reason: stop_sequence`."""
    call = {"index": 0, "id": "c1", "function": {"name": "Bash", "arguments": "{}"}}
    stopped = chunk({"tool_calls": [call]}, "stop")
    stopped["choices"][0]["stop_reason"] = "END"
    translation = translate(body(stream=True, tools=[BASH_TOOL], stop_sequences=["END"]))
    datas, final = check_stream(translation, [stopped])
    assert datas[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert (final.stop_reason, final.stop_sequence) == ("tool_use", None)
    answer = translate(body(tools=[BASH_TOOL], stop_sequences=["END"])).answer(
        engine_answer(None, calls=[("c1", "Bash", "{}")], stop_reason="END")
    )
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("tool_use", None)


def test_a_streamed_answer_cut_by_max_tokens() -> None:
    chunks = [
        chunk({"role": "assistant", "content": "a long"}),
        chunk({"content": " answ"}, "length"),
        USAGE,
    ]
    datas, final = check_stream(translate(body(stream=True, max_tokens=7)), chunks)
    assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert final.stop_reason == "max_tokens" and final.content[0].text == "a long answ"  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_a_length_finish_short_of_max_tokens_is_the_context_windows_end(stream: bool) -> None:
    """The engine ends an answer at its context's end with `length`, as at `max_tokens`: fewer
    tokens than the limit the engine got tell them apart, as Anthropic's newer models do (Claude
    Code then says the context is full, not that the answer passed its 64k `max_tokens`). A
    mode's lower limit is the one the engine got (`sent_to_engine`)."""

    def stop_reason(harness_max: int, engine_max: int | None) -> Any:
        translation = translate(body(stream=stream, max_tokens=harness_max))
        if engine_max is not None:
            translation.sent_to_engine({**translation.chat_request(), "max_tokens": engine_max})
        if not stream:
            return translation.answer(engine_answer("a long answ", finish="length"))["stop_reason"]
        chunks = [
            chunk({"role": "assistant", "content": "a long"}),
            chunk({"content": " answ"}, "length"),
            USAGE,
        ]
        datas, final = check_stream(translation, chunks)
        assert datas[-2]["delta"]["stop_reason"] == final.stop_reason
        return final.stop_reason

    made = 9 if stream else 7  # the completion tokens of the engine's usage
    assert stop_reason(64000, None) == "model_context_window_exceeded"
    assert stop_reason(64000, made) == "max_tokens"  # a mode's limit met
    assert stop_reason(64000, made + 1) == "model_context_window_exceeded"
    assert stop_reason(made, None) == "max_tokens"


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_an_answer_the_engine_cut_at_its_tool_calls_is_max_tokens_not_the_context(
    stream: bool,
) -> None:
    """The embedded engine keeps a turn's whole tool calls and drops a next call that
    `max_tokens` cut short: `length`, with fewer tokens than the limit and its `stop_reason`
    naming where it cut. That is `max_tokens` (it was `model_context_window_exceeded`: Claude
    Code would take a small prompt for a full context)."""
    translation = translate(body(stream=stream, max_tokens=40, tools=[BASH]))
    call = ("call_1", "Bash", '{"command": "ls"}')
    if stream:
        piece = {"index": 0, "id": "call_1", "function": {"name": "Bash", "arguments": call[2]}}
        last = chunk({"tool_calls": [piece]}, "length", usage={"completion_tokens": 35})
        last["choices"][0]["stop_reason"] = "</tool_call>"
        datas, final = check_stream(translation, [chunk({"role": "assistant"}), last])
        answer = final.model_dump(exclude_none=True)
        assert datas[-2]["delta"]["stop_reason"] == "max_tokens"
    else:
        engine = engine_answer(None, calls=[call], finish="length", stop_reason="</tool_call>")
        answer = translation.answer({**engine, "usage": {"completion_tokens": 35}})
    assert answer["stop_reason"] == "max_tokens"
    assert [block["type"] for block in answer["content"]] == ["tool_use"]


def test_streamed_reasoning_is_a_thinking_block_before_the_text_when_enabled() -> None:
    chunks = [
        chunk({"reasoning_content": "Two and "}),
        chunk({"reasoning_content": "two."}),
        chunk({"content": "4"}, "stop"),
    ]
    _, final = check_stream(translate(body(stream=True, thinking={"type": "adaptive"})), chunks)
    assert [(b.type, getattr(b, "thinking", getattr(b, "text", None))) for b in final.content] == [
        ("thinking", "Two and two."),
        ("text", "4"),
    ]
    off = translate(body(stream=True))
    _, final = check_stream(off, chunks)
    assert [b.type for b in final.content] == ["text"]
    assert sum("reasoning dropped" in note for note in off.notes) == 1


def test_an_engine_error_chunk_ends_the_stream_with_an_error_event() -> None:
    translation = translate(body(stream=True))
    events = stream(
        translation,
        [
            chunk({"content": "par"}),
            {"error": {"message": "CUDA out of memory"}},
            chunk({"content": "x"}),
        ],
    )
    datas = parsed(events)
    assert [d["type"] for d in datas][-2:] == ["content_block_delta", "error"]
    assert datas[-1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "CUDA out of memory"},
    }
    assert translation.assembled() == datas[-1]
    with pytest.raises(anthropic.APIStatusError) as raised:
        sdk_final(events)
    assert "CUDA out of memory" in str(raised.value)


def test_an_empty_stream_is_a_complete_empty_message() -> None:
    datas, final = check_stream(translate(body(stream=True)), [])
    assert [d["type"] for d in datas] == ["message_start", "message_delta", "message_stop"]
    assert (final.content, final.stop_reason, final.usage.output_tokens) == ([], "end_turn", 0)


# ---- fuzz ---------------------------------------------------------------------------------------

# fmt: off
FIELDS = [
    "type", "text", "role", "content", "id", "name", "input", "tool_use_id", "is_error",
    "messages", "system", "max_tokens", "model", "tools", "tool_choice", "input_schema",
    "thinking", "stream", "stop_sequences", "temperature", "top_k", "disable_parallel_tool_use",
]
WORDS = [
    "text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document",
    "user", "assistant", "system", "auto", "any", "tool", "none", "enabled", "adaptive",
    "custom", "web_search_20250305", "Bash",
]
# fmt: on
KEYS = st.sampled_from(FIELDS) | st.text(max_size=3)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 100_000)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(WORDS)
    | st.text(max_size=4)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=40,
)


def mostly(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually the shaped value, sometimes any JSON (so both the checks and what lies past
    them are reached)."""
    return st.integers(0, 7).flatmap(lambda n: JSON if n == 0 else strategy)


def shaped(
    required: dict[str, st.SearchStrategy[Any]], **optional: st.SearchStrategy[Any]
) -> st.SearchStrategy[Any]:
    """An object with these fields (each usually shaped), or any JSON."""
    return mostly(
        st.fixed_dictionaries(
            {name: mostly(strategy) for name, strategy in required.items()},
            optional={name: mostly(strategy) for name, strategy in optional.items()},
        )
    )


WORD = st.sampled_from(WORDS)
TEXT_BLOCK = shaped({"type": st.just("text"), "text": st.text(max_size=2)})
CALL_ID = st.sampled_from(["t1", "t2"])
BLOCKS_T1 = [
    {"type": "tool_use", "id": "t1", "name": "Bash", "input": {}},
    {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
]
BLOCK = st.one_of(
    TEXT_BLOCK,
    shaped(
        {"type": st.just("tool_use"), "id": CALL_ID, "name": WORD},
        input=st.dictionaries(st.text(max_size=2), JSON, max_size=2),
    ),
    shaped(
        {"type": st.just("tool_result"), "tool_use_id": CALL_ID},
        content=st.text(max_size=3) | st.lists(TEXT_BLOCK, max_size=2),
        is_error=st.booleans(),
    ),
    shaped({"type": st.sampled_from(["thinking", "redacted_thinking"])}, thinking=st.text()),
    shaped({"type": WORD}, text=st.text(max_size=3)),
)
MESSAGE = shaped(
    {
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.text(max_size=3) | st.lists(BLOCK, max_size=4),
    }
)
EXCHANGE = st.tuples(st.lists(BLOCK, max_size=2), st.lists(BLOCK, max_size=2)).map(
    lambda blocks: [
        user(),
        {"role": "assistant", "content": [BLOCKS_T1[0], *blocks[0]]},
        {"role": "user", "content": [*blocks[1], BLOCKS_T1[1]]},
    ]
)
TOOL = shaped({"name": WORD, "input_schema": JSON}, type=WORD, description=st.text(max_size=3))
BODY = shaped(
    {
        "model": st.just("m"),
        "max_tokens": st.integers(0, 10),
        "messages": st.lists(MESSAGE, min_size=1, max_size=5) | EXCHANGE,
    },
    system=st.text(max_size=3) | st.lists(TEXT_BLOCK, max_size=3),
    tools=st.lists(TOOL, max_size=3),
    tool_choice=shaped({"type": WORD}, name=WORD, disable_parallel_tool_use=st.booleans()),
    thinking=shaped(
        {"type": st.sampled_from(["enabled", "adaptive", "disabled"])},
        budget_tokens=st.integers(0, 9),
    ),
    stream=st.booleans(),
    stop_sequences=st.lists(st.text(max_size=2), max_size=2),
    temperature=st.floats(0, 1),
    top_k=st.integers(0, 5),
    output_config=JSON,
)
ANY_OBJECT = st.dictionaries(KEYS, JSON, max_size=8)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 7).flatmap(lambda n: ANY_OBJECT if n == 0 else BODY))
def test_translate_raises_only_wire_errors_on_any_json_object(sent: Any) -> None:
    for function in (translate, count_tokens_request):
        try:
            result = function(sent)
        except WireError as error:
            assert error.status == 400 and error.message
            continue
        if isinstance(result, Translation):
            assert result.chat_request()["messages"]
            assert result.stream_end()[-1].startswith(b"event: message_stop")
