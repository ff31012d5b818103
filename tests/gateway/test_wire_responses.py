"""The Responses API translation: captured Codex/OpenCode requests in, chat requests out; engine
answers and chunks in, `Response` objects and SSE events out, parsed with the openai SDK's types.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import (
    Response,
    ResponseCustomToolCall,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseReasoningItem,
    ResponseStreamEvent,
)

from reins.gateway.wire import WireError
from reins.gateway.wire.responses import KIND, error_body, translate

FIXTURES = Path(__file__).parent.parent / "fixtures" / "cli_requests"
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
NAMESPACE_TOOL = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for sub-agents.",
    "tools": [
        {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}},
        {"type": "custom", "name": "note", "description": "Free text."},
    ],
}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}
EXEC = {"type": "function", "name": "exec_command", "parameters": {"type": "object"}}


def captured(name: str) -> list[dict[str, Any]]:
    """The captured records of Responses API requests in a fixture file."""
    lines = (FIXTURES / name).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["path"].endswith("/responses")]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "qwen", "input": "Hi", **fields}


def chat_answer(
    content: str | None = "", *, calls: list[dict[str, Any]] | None = None, finish: str = "stop"
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "token_ids": [1]}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17},
        "prompt_token_ids": [1, 2],
    }


def call(name: str, arguments: str, call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chunk(finish: str | None = None, **delta: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": [7]}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}


USAGE_CHUNK = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}


def stream(request: dict[str, Any], chunks: list[dict[str, Any]]) -> tuple[list[Any], Any]:
    """Every event parsed by the SDK (checked against its SSE `event:` line), and the
    `Response` assembled afterwards."""
    translation = translate({**request, "stream": True})
    raw = [event for c in chunks for event in translation.stream_events(c)]
    raw += translation.stream_end()
    events = []
    for sse in raw:
        head, data, blank = sse.decode().split("\n", 2)
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}" and blank == "\n"
        events.append(EVENTS.validate_python(payload))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, Response.model_validate(translation.assembled())


def types(events: list[Any]) -> list[str]:
    return [event.type for event in events]


def replied_types(record: dict[str, Any]) -> list[str]:
    """The event types of a reply the CLI accepted (recorded by the capture's mock server)."""
    return [e.split("\n")[0].removeprefix("event: ") for e in record["reply"]["events"]]


# --- captured requests ------------------------------------------------------------------------


def test_the_fixtures_hold_the_expected_responses_requests() -> None:
    counts = {
        name: len(captured(name))
        for name in ("codex.jsonl", "codex-tool.jsonl", "opencode-responses-tool.jsonl")
    }
    assert counts == {"codex.jsonl": 2, "codex-tool.jsonl": 2, "opencode-responses-tool.jsonl": 3}
    assert captured("opencode.jsonl") == []  # OpenCode's chat-completions flavour


@pytest.mark.parametrize(
    ("name", "line"),
    [("codex.jsonl", 0), ("codex.jsonl", 1), ("codex-tool.jsonl", 0), ("codex-tool.jsonl", 1)]
    + [("opencode-responses-tool.jsonl", i) for i in range(3)],
)
def test_every_captured_request_translates(name: str, line: int) -> None:
    request = captured(name)[line]["body"]
    chat = translate(request).chat_request()
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert "model" not in chat
    users = [m["content"] for m in chat["messages"] if m["role"] == "user"]
    last_user = [i for i in request["input"] if i.get("role") == "user"][-1]
    assert users[-1] == last_user["content"][0]["text"]


def test_codex_tool_turn_maps_the_call_and_its_output_to_one_tool_call_id() -> None:
    request = captured("codex-tool.jsonl")[1]["body"]
    translation = translate(request)
    messages = translation.chat_request()["messages"]
    assert [m["role"] for m in messages] == [
        "system",
        "system",
        "user",
        "user",
        "assistant",
        "tool",
    ]
    developer = request["input"][1]["content"]
    assert messages[1]["content"] == developer[0]["text"] + "\n" + developer[1]["text"]
    (tool_call,) = messages[4]["tool_calls"]
    assert tool_call["id"] == messages[5]["tool_call_id"] == "call_edcce21f5d44486fb59072e2"
    assert tool_call["function"] == {"name": "exec_command", "arguments": '{"cmd": "ls"}'}
    assert messages[5]["content"] == request["input"][5]["output"]


def test_codex_tools_flatten_the_namespace_and_drop_web_search_with_a_note() -> None:
    translation = translate(captured("codex.jsonl")[0]["body"])
    chat = translation.chat_request()
    names = [tool["function"]["name"] for tool in chat["tools"]]
    nested = ["close_agent", "resume_agent", "send_input", "spawn_agent", "wait_agent"]
    assert names == [
        "exec_command",
        "write_stdin",
        "request_user_input",
        "view_image",
        *(f"multi_agent_v1__{name}" for name in nested),
        "get_goal",
        "create_goal",
        "update_goal",
    ]
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is True
    assert any("web_search" in note for note in translation.notes)
    assert any("include" in note for note in translation.notes)


def test_opencode_requests_keep_system_string_content_and_max_output_tokens() -> None:
    title, first, tool_turn = (r["body"] for r in captured("opencode-responses-tool.jsonl"))
    chat = translate(title).chat_request()
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "user"]
    assert chat["messages"][0]["content"] == title["input"][0]["content"]
    assert chat["max_tokens"] == 32000 and "tools" not in chat
    assert len(translate(first).chat_request()["tools"]) == 10
    messages = translate(tool_turn).chat_request()["messages"]
    assert messages[-2]["tool_calls"][0]["function"] == {
        "name": "bash",
        "arguments": '{"command":"ls"}',
    }
    assert messages[-1] == {
        "role": "tool",
        "tool_call_id": "call_3ebf4553da2a4fd8b9a56a6f",
        "content": "README.md\nhello.py\n",
    }


def test_streams_have_the_event_sequence_the_clis_accepted() -> None:
    tool_reply, text_reply = captured("codex-tool.jsonl")
    request = captured("codex-tool.jsonl")[0]["body"]
    events, _ = stream(request, [chunk(role="assistant", content="Hello"), chunk("stop")])
    assert types(events) == replied_types(text_reply)
    last = chunk("tool_calls", tool_calls=[{"index": 0, **call("exec_command", '{"cmd":"ls"}')}])
    events, _ = stream(request, [last])
    assert types(events) == replied_types(tool_reply)


# --- the request ------------------------------------------------------------------------------


def test_instructions_and_a_string_input_become_system_and_user_messages() -> None:
    chat = translate(body(instructions="Be brief.", temperature=0.5, top_p=0.9)).chat_request()
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert (chat["temperature"], chat["top_p"], chat["stream"]) == (0.5, 0.9, False)


def test_calls_after_an_assistant_message_join_its_turn() -> None:
    items = [
        {"role": "user", "content": "Run both"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "OK"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "a", "name": "exec_command", "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "b", "name": "apply_patch", "input": "*** Begin"},
        {
            "type": "function_call_output",
            "call_id": "a",
            "output": [{"type": "input_text", "text": "x"}],
        },
        {"type": "custom_tool_call_output", "call_id": "b", "output": "done"},
    ]
    translation = translate(body(input=items, tools=[EXEC, APPLY_PATCH]))
    messages = translation.chat_request()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "OK"
    assert [c["function"] for c in messages[1]["tool_calls"]] == [
        {"name": "exec_command", "arguments": "{}"},
        {"name": "apply_patch", "arguments": json.dumps({"input": "*** Begin"})},
    ]
    assert [(m["tool_call_id"], m["content"]) for m in messages[2:]] == [("a", "x"), ("b", "done")]
    assert any("1 reasoning item(s) in `input` dropped" in note for note in translation.notes)


def test_a_custom_tool_becomes_a_function_with_one_string_input() -> None:
    translation = translate(
        body(tools=[APPLY_PATCH], tool_choice={"type": "custom", "name": "apply_patch"})
    )
    chat = translation.chat_request()
    (tool,) = chat["tools"]
    assert tool["function"]["name"] == "apply_patch"
    parameters = tool["function"]["parameters"]
    assert parameters["required"] == ["input"]
    assert parameters["properties"]["input"]["type"] == "string"
    assert 'start: "*** Begin Patch"' in parameters["properties"]["input"]["description"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}
    assert any("grammar" in note for note in translation.notes)


def test_a_namespaced_call_in_history_and_in_tool_choice_maps_to_the_flat_name() -> None:
    items = [
        {"role": "user", "content": "Spawn"},
        {
            "type": "function_call",
            "call_id": "c",
            "name": "spawn_agent",
            "namespace": "multi_agent_v1",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "c", "output": "ok"},
    ]
    choice = {"type": "function", "name": "spawn_agent"}
    chat = translate(body(input=items, tools=[NAMESPACE_TOOL], tool_choice=choice)).chat_request()
    assert chat["messages"][1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert chat["tool_choice"]["function"]["name"] == "multi_agent_v1__spawn_agent"
    described = chat["tools"][0]["function"]["description"]
    assert described == "Tools for sub-agents."


def test_allowed_tools_narrows_the_tools_given_to_the_engine() -> None:
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "exec_command"}],
    }
    chat = translate(body(tools=[EXEC, APPLY_PATCH], tool_choice=choice)).chat_request()
    assert chat["tool_choice"] == "required"
    assert [t["function"]["name"] for t in chat["tools"]] == ["exec_command"]


def test_ignored_settings_are_noted_and_hosted_tools_dropped() -> None:
    request = body(
        store=True,
        text={"format": {"type": "json_schema", "name": "x", "schema": {}}, "verbosity": "low"},
        reasoning={"effort": "high"},
        tools=[{"type": "web_search_preview"}, {"type": "mcp", "server_label": "x"}, EXEC],
        prompt_cache_key="k",
        client_metadata={"a": "b"},
        bogus=1,
    )
    translation = translate(request)
    notes = " | ".join(translation.notes)
    for expected in (
        "store: true",
        "verbosity",
        "reasoning",
        "web_search_preview",
        "`mcp`",
        "bogus",
    ):
        assert expected in notes
    assert "prompt_cache_key" not in notes
    assert [t["function"]["name"] for t in translation.chat_request()["tools"]] == ["exec_command"]


SCHEMA = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}


@pytest.mark.parametrize(
    ("form", "expected"),
    [
        (
            {"type": "json_schema", "name": "Colour", "schema": SCHEMA, "strict": True},
            {
                "type": "json_schema",
                "json_schema": {"name": "Colour", "schema": SCHEMA, "strict": True},
            },
        ),
        (
            {"type": "json_schema", "name": "C", "schema": SCHEMA, "description": "one colour"},
            {
                "type": "json_schema",
                "json_schema": {"name": "C", "schema": SCHEMA, "description": "one colour"},
            },
        ),
        ({"type": "json_object"}, {"type": "json_object"}),
    ],
)
def test_a_structured_text_format_is_the_chat_response_format(
    form: dict[str, Any], expected: dict[str, Any]
) -> None:
    """Constrained decoding is kept, as a chat call's `response_format` is (docs/proxy.md): the
    engine is asked for it, so the harness can parse its answer."""
    translation = translate(body(text={"format": form}))
    assert translation.chat_request()["response_format"] == expected
    assert not any("text.format" in note for note in translation.notes)


@pytest.mark.parametrize("text", [None, {}, {"format": {"type": "text"}}, {"verbosity": "low"}])
def test_plain_text_asks_for_no_response_format(text: Any) -> None:
    assert "response_format" not in translate(body(text=text)).chat_request()


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"input": [{"role": "user", "content": "x"}, {"type": "web_search_call"}]},
            "input[1].type",
            "web_search_call",
        ),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
            "call_id",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
            "input[0].call_id",
            "`nope`",
        ),
        ({"input": 5}, "input", "`input` must be"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
            "text models",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "role"),
        ({"input": [{"content": "x"}]}, "input[0].type", "type"),
        ({"tools": "all"}, "tools", "`tools` must be a list"),
        ({"tools": [EXEC, EXEC]}, "tools[1].name", "exec_command"),
        ({"temperature": "hot"}, "temperature", "a number"),
        ({"max_output_tokens": True}, "max_output_tokens", "integer"),
        ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"stream": "yes"}, "stream", "true or false"),
        ({"metadata": {"a": 1}}, "metadata", "strings"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "store: false"),
        ({"background": True}, "background", "background"),
        ({"conversation": "conv_1"}, "conversation", "conversation"),
        (
            {"tool_choice": {"type": "function", "name": "ghost"}, "tools": [EXEC]},
            "tool_choice",
            "ghost",
        ),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
        ({"tool_choice": "required"}, "tool_choice", "required"),
        ({"input": []}, "input", "required"),
        # OpenAI's 400 too (a request without one was answered by the default model, with
        # `model: ""` in the Response).
        ({"model": None}, "model", "`model` is required"),
        ({"model": 7}, "model", "`model` is required"),
        ({"text": "json"}, "text", "`text` must be an object"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format", "yaml"),
        (
            {"text": {"format": {"type": "json_schema", "schema": SCHEMA}}},
            "text.format.name",
            "name",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format.schema",
            "schema",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": "{}"}}},
            "text.format.schema",
            "JSON schema object",
        ),
    ],
)
def test_a_request_that_cannot_be_served_is_a_400_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(WireError) as caught:
        translate(body(**fields))
    assert caught.value.status == 400
    assert caught.value.param == param
    assert words in caught.value.message


def test_error_body_has_the_openai_shape() -> None:
    assert error_body(400, "bad `input`") == {
        "error": {
            "message": "bad `input`",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    assert error_body(502, "engine down")["error"]["type"] == "server_error"
    assert error_body(404, "x", param="model")["error"]["param"] == "model"
    assert KIND == "responses"


# --- answers ----------------------------------------------------------------------------------


def test_a_text_answer_is_one_message_with_usage_and_echoed_settings() -> None:
    translation = translate(
        body(instructions="Be brief.", max_output_tokens=64, metadata={"k": "v"})
    )
    answer = translation.answer(chat_answer("Hello there"))
    response = Response.model_validate(answer)
    assert response.id.startswith("resp_") and response.object == "response"
    assert (response.status, response.model, response.output_text) == (
        "completed",
        "qwen",
        "Hello there",
    )
    (item,) = response.output
    assert isinstance(item, ResponseOutputMessage) and item.status == "completed"
    assert response.usage is not None
    assert (
        response.usage.input_tokens,
        response.usage.output_tokens,
        response.usage.total_tokens,
    ) == (12, 5, 17)
    assert (response.instructions, response.max_output_tokens, response.metadata) == (
        "Be brief.",
        64,
        {"k": "v"},
    )
    assert translation.assembled() == answer


def test_text_then_calls_answer_a_message_then_function_calls_keeping_call_ids() -> None:
    calls = [
        call("exec_command", '{"cmd":"ls"}', "call_a"),
        call("multi_agent_v1__spawn_agent", "{}", "call_b"),
    ]
    translation = translate(body(tools=[EXEC, NAMESPACE_TOOL]))
    response = Response.model_validate(
        translation.answer(chat_answer("Looking.", calls=calls, finish="tool_calls"))
    )
    message, first, second = response.output
    assert isinstance(message, ResponseOutputMessage) and message.content[0].text == "Looking."  # type: ignore[union-attr]
    assert isinstance(first, ResponseFunctionToolCall) and isinstance(
        second, ResponseFunctionToolCall
    )
    assert (first.call_id, first.name, first.arguments, first.namespace) == (
        "call_a",
        "exec_command",
        '{"cmd":"ls"}',
        None,
    )
    assert (second.call_id, second.name, second.namespace) == (
        "call_b",
        "spawn_agent",
        "multi_agent_v1",
    )
    assert first.id is not None and first.id.startswith("fc_") and first.status == "completed"
    assert response.status == "completed"


def test_calls_without_text_answer_no_message_item() -> None:
    translation = translate(body(tools=[EXEC]))
    answer = translation.answer(
        chat_answer(None, calls=[call("exec_command", "{}")], finish="tool_calls")
    )
    assert [item.type for item in Response.model_validate(answer).output] == ["function_call"]


def test_a_custom_tool_call_answers_its_input_string() -> None:
    translation = translate(body(tools=[APPLY_PATCH, NAMESPACE_TOOL]))
    calls = [
        call("apply_patch", json.dumps({"input": "*** Begin Patch\n"}), "call_p"),
        call("multi_agent_v1__note", '{"input": "hi"}', "call_n"),
    ]
    response = Response.model_validate(
        translation.answer(chat_answer("", calls=calls, finish="tool_calls"))
    )
    patch, note = response.output
    assert isinstance(patch, ResponseCustomToolCall) and isinstance(note, ResponseCustomToolCall)
    assert (patch.call_id, patch.name, patch.input, patch.namespace) == (
        "call_p",
        "apply_patch",
        "*** Begin Patch\n",
        None,
    )
    assert (note.name, note.input, note.namespace) == ("note", "hi", "multi_agent_v1")


def test_a_length_finish_answers_incomplete_for_max_output_tokens() -> None:
    response = Response.model_validate(
        translate(body()).answer(chat_answer("Half a sent", finish="length"))
    )
    assert response.status == "incomplete"
    assert (
        response.incomplete_details is not None
        and response.incomplete_details.reason == "max_output_tokens"
    )
    assert response.output[0].status == "incomplete"  # type: ignore[union-attr]


def test_engine_reasoning_becomes_a_reasoning_item_before_the_message() -> None:
    answer = chat_answer("42")
    answer["choices"][0]["message"]["reasoning_content"] = "Six times seven."
    reasoning, message = Response.model_validate(translate(body()).answer(answer)).output
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.content is not None
    assert reasoning.content[0].text == "Six times seven." and reasoning.summary == []
    assert isinstance(message, ResponseOutputMessage)


def test_reasoning_sent_back_is_its_assistant_turns_reasoning_content_again() -> None:
    """A harness sends the output items back as it got them (the Agents SDK, Codex): the engine's
    reasoning must come back as the turn's `reasoning_content`, as Messages sends a `thinking`
    block, not be dropped: a template that renders earlier reasoning (Qwen3's, within a tool
    loop) would otherwise prompt the next call with other text than was sampled."""
    answer = chat_answer("Let me look.", calls=[call("exec_command", '{"cmd": "ls"}', "c1")])
    answer["choices"][0]["message"]["reasoning_content"] = "List the files first."
    first = Response.model_validate(translate(body(tools=[EXEC])).answer(answer))
    sent_back = [item.model_dump(exclude_none=True) for item in first.output]
    assert [item["type"] for item in sent_back] == ["reasoning", "message", "function_call"]
    items = [
        {"role": "user", "content": "What is here?"},
        *sent_back,
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "opaque"},
    ]
    translation = translate(body(input=items, tools=[EXEC]))
    messages = translation.chat_request()["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "List the files first.",
        "tool_calls": [call("exec_command", '{"cmd": "ls"}', "c1")],
    }
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert any("1 reasoning item(s) in `input` dropped" in note for note in translation.notes)


# --- streams ----------------------------------------------------------------------------------


def test_a_text_stream_sends_deltas_and_completes_with_usage() -> None:
    chunks = [
        chunk(role="assistant", content="Hel"),
        chunk(content="lo"),
        chunk("stop"),
        USAGE_CHUNK,
    ]
    events, response = stream(body(), chunks)
    assert types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:8])
    assert events[6].text == "Hello"
    completed = events[-1].response
    assert completed.output_text == "Hello" and completed.usage.output_tokens == 4
    assert completed.usage.input_tokens == 9
    assert response == completed
    assert events[0].response.status == "in_progress" and events[0].response.id == completed.id


def entry(token: str, logprob: float) -> dict[str, Any]:
    """A chat logprobs entry with one alternative."""
    top = [{"token": token, "logprob": logprob, "bytes": list(token.encode())}]
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": top}


LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}


def test_included_logprobs_ask_the_engine_for_them_and_ignore_other_includes() -> None:
    chat = translate(body(**LOGPROBS)).chat_request()
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 1)
    plain = translate(body(include=["reasoning.encrypted_content"], top_logprobs=3))
    assert "logprobs" not in plain.chat_request() and "top_logprobs" not in plain.chat_request()
    assert plain.notes == [
        "`include` reasoning.encrypted_content ignored: no encrypted reasoning or extra fields "
        "are returned",
        "`top_logprobs` is ignored: `include` does not name message.output_text.logprobs",
    ]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"include": "message.output_text.logprobs"}, "`include` must be a list of strings"),
        ({"include": [1]}, "`include` must be a list of strings"),
        ({"top_logprobs": 21}, "`top_logprobs` must be from 0 to 20, not 21"),
        ({"top_logprobs": 1.5}, "`top_logprobs` must be an integer from 0 to 20"),
        # OpenAI's ranges, refused in every mode (train mode then samples with its own).
        ({"temperature": -1}, "`temperature` must be a number from 0 to 2"),
        ({"temperature": 2.5}, "`temperature` must be a number from 0 to 2"),
        ({"top_p": 5}, "`top_p` must be a number from 0 to 1"),
    ],
)
def test_settings_that_cannot_be_served_are_400s(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(WireError, match=re.escape(says)):
        translate(body(**fields))


def test_an_answer_with_included_logprobs_shows_them_on_its_text() -> None:
    answer = chat_answer("Hello")
    entries = [entry("Hel", -0.5), entry("lo", -0.25)]
    answer["choices"][0]["logprobs"] = {"content": entries}
    shown = Response.model_validate(translate(body(**LOGPROBS)).answer(answer))
    text = shown.output[0].content[0]
    assert [e.model_dump() for e in text.logprobs or []] == entries
    hidden = Response.model_validate(translate(body()).answer(answer))
    assert hidden.output[0].content[0].logprobs == []


def test_streamed_logprobs_go_with_their_text_and_equal_the_whole_answers() -> None:
    first, second, last = entry("Hel", -0.5), entry("lo", -0.25), entry("<|im_end|>", -0.01)

    def scored(entries: list[dict[str, Any]], finish: str | None = None, **delta: Any) -> Any:
        piece = chunk(finish, **delta)
        piece["choices"][0]["logprobs"] = {"content": entries}
        return piece

    chunks = [
        scored([first], role="assistant", content="Hel"),
        scored([second], content="lo"),
        scored([last], "stop"),  # the end-of-turn token: no text
        USAGE_CHUNK,
    ]
    events, response = stream(body(**LOGPROBS), chunks)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [[x.model_dump() for x in e.logprobs] for e in deltas] == [[first], [second]]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [x.model_dump() for x in done.logprobs] == [first, second, last]
    streamed = response.output[0].content[0]
    whole = chat_answer("Hello")
    whole["choices"][0]["logprobs"] = {"content": [first, second, last]}
    answered = Response.model_validate(translate(body(**LOGPROBS)).answer(whole))
    assert streamed == answered.output[0].content[0]
    assert [x.model_dump() for x in streamed.logprobs or []] == [first, second, last]


def test_text_then_a_whole_tool_call_in_the_last_chunk_embedded_style() -> None:
    whole = [{"index": 0, **call("exec_command", '{"cmd": "ls"}', "call_e")}]
    chunks = [
        chunk(role="assistant", content="Let me look."),
        chunk(content="\n"),
        chunk("tool_calls", content=None, tool_calls=whole),
    ]
    events, response = stream(body(tools=[EXEC]), chunks)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "message"), (1, "function_call")]
    (arguments,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (arguments.output_index, arguments.arguments) == (1, '{"cmd": "ls"}')
    message, function = response.output
    assert message.content[0].text == "Let me look.\n"
    assert (function.call_id, function.name, function.arguments) == (
        "call_e",
        "exec_command",
        '{"cmd": "ls"}',
    )
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]


def test_incremental_tool_call_deltas_vllm_style() -> None:
    chunks = [
        chunk(role="assistant", content="\n\n"),  # whitespace before the calls: no message item
        chunk(
            tool_calls=[
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": ""},
                }
            ]
        ),
        chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"cmd": '}}]),
        chunk(tool_calls=[{"index": 0, "function": {"arguments": '"ls"}'}}]),
        chunk(
            tool_calls=[
                {
                    "index": 1,
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "multi_agent_v1__spawn_agent", "arguments": "{}"},
                }
            ]
        ),
        chunk("tool_calls"),
        USAGE_CHUNK,
    ]
    events, response = stream(body(tools=[EXEC, NAMESPACE_TOOL]), chunks)
    deltas = [
        (e.output_index, e.delta)
        for e in events
        if e.type == "response.function_call_arguments.delta"
    ]
    assert deltas == [(0, '{"cmd": '), (0, '"ls"}'), (1, "{}")]
    first, second = response.output
    assert (first.call_id, first.arguments) == ("call_1", '{"cmd": "ls"}')
    assert (second.call_id, second.name, second.namespace) == (
        "call_2",
        "spawn_agent",
        "multi_agent_v1",
    )
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.output_index, e.item.status) for e in done] == [(0, "completed"), (1, "completed")]
    # the first call is closed before the second is opened
    items = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item")]
    assert items == [
        ("response.output_item.added", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.output_item.done", 1),
    ]


def interleavings(*runs: list[Any]) -> list[list[Any]]:
    """Every merge of the runs that keeps each run's own order."""
    if not any(runs):
        return [[]]
    merged = []
    for position, run in enumerate(runs):
        if run:
            rest = [*runs[:position], run[1:], *runs[position + 1 :]]
            merged += [[run[0], *tail] for tail in interleavings(*rest)]
    return merged


def outline(response: Any) -> list[tuple[Any, ...]]:
    """The output items without their generated ids."""
    return [
        (item.type, getattr(item, "status", None), getattr(item, "call_id", None),
         getattr(item, "name", None),
         getattr(item, "arguments", None) or getattr(item, "input", None),
         item.content[0].text if item.type == "message" else None)
        for item in response.output
    ]  # fmt: skip


@pytest.mark.parametrize("finish", ["tool_calls", "length"])
def test_streamed_parallel_calls_answer_as_the_plain_answer_however_their_pieces_interleave(
    finish: str,
) -> None:
    """vLLM streams the heads of parallel calls, then argument pieces alternating by index,
    and text may come between them: the streamed answer, its delta events included, is the
    non-streamed one for every order."""
    request = body(tools=[EXEC, APPLY_PATCH])

    def head(index: int, name: str) -> dict[str, Any]:
        function = {"name": name, "arguments": ""}
        return {"index": index, "id": f"call_{index}", "type": "function", "function": function}

    def piece(index: int, arguments: str) -> dict[str, Any]:
        return {"index": index, "function": {"arguments": arguments}}

    first = [head(0, "exec_command"), piece(0, '{"cmd": '), piece(0, '"ls"}')]
    second = [head(1, "apply_patch"), piece(1, '{"input": '), piece(1, '"*** Begin Patch"}')]
    text = ["Let me ", "look."]
    plain = translate(request).answer(
        chat_answer(
            "Let me look.",
            calls=[
                call("exec_command", '{"cmd": "ls"}', "call_0"),
                call("apply_patch", '{"input": "*** Begin Patch"}', "call_1"),
            ],
            finish=finish,
        )
    )
    expected = outline(Response.model_validate(plain))
    assert [item[0] for item in expected] == ["message", "function_call", "custom_tool_call"]
    orders = interleavings(first, second, text)
    assert len(orders) == 560
    for order in orders:
        chunks = [
            chunk(content=part) if isinstance(part, str) else chunk(tool_calls=[part])
            for part in order
        ]
        events, response = stream(request, [*chunks, chunk(finish), USAGE_CHUNK])
        assert outline(response) == expected, order
        deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
        assert "".join(e.delta for e in deltas) == '{"cmd": "ls"}', order
        assert {e.output_index for e in deltas} == {1}, order


def test_a_streamed_custom_tool_call_sends_its_input() -> None:
    pieces = ['{"input": "*** Begin', ' Patch\\n"}']
    chunks = [
        chunk(
            tool_calls=[
                {
                    "index": 0,
                    "id": "call_p",
                    "function": {"name": "apply_patch", "arguments": pieces[0]},
                }
            ]
        ),
        chunk("tool_calls", tool_calls=[{"index": 0, "function": {"arguments": pieces[1]}}]),
    ]
    events, response = stream(body(tools=[APPLY_PATCH]), chunks)
    assert "response.function_call_arguments.delta" not in types(events)
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done.input == "*** Begin Patch\n"
    assert (
        "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
        == done.input
    )
    (item,) = response.output
    assert isinstance(item, ResponseCustomToolCall) and (item.call_id, item.input) == (
        "call_p",
        "*** Begin Patch\n",
    )


def test_a_length_finish_ends_the_stream_incomplete() -> None:
    events, response = stream(body(), [chunk(content="Half"), chunk("length")])
    assert events[-1].type == "response.incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


def test_an_engine_error_chunk_fails_the_response_and_ends_the_stream() -> None:
    translation = translate(body(stream=True))
    sent = translation.stream_events(chunk(content="Hi"))
    failed = translation.stream_events(
        {"error": {"message": "CUDA out of memory", "type": "InternalServerError"}}
    )
    assert translation.stream_events(chunk(content="more")) == [] and translation.stream_end() == []
    events = [
        EVENTS.validate_python(json.loads(s.decode().split("data: ", 1)[1])) for s in sent + failed
    ]
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.message == "CUDA out of memory"
    assert events[-1].response.error.code == "server_error"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    response = Response.model_validate(translation.assembled())
    assert response.status == "failed" and response.output[0].content[0].text == "Hi"  # type: ignore[union-attr]


def test_a_refused_stream_fails_with_a_code_the_sdk_knows_and_says_why() -> None:
    """The attempt closed while the answer streamed: `response.failed` in place of
    `response.completed`, its error code one of the SDK's `ResponseError.code` values."""
    translation = translate(body(stream=True))
    sent = translation.stream_events(chunk(content="Hi"))
    closing = translation.stream_end()  # built (to assemble the answer), then not sent
    assert closing[-1].startswith(b"event: response.completed")
    refused = translation.stream_refusal("attempt 1 of r is closed; this answer was not recorded")
    events = [
        EVENTS.validate_python(json.loads(s.decode().split("data: ", 1)[1])) for s in sent + refused
    ]
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "server_error"
    assert "this answer was not recorded" in events[-1].response.error.message
    # Numbered after the last event sent: the closing events that were not sent leave no gap.
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_an_empty_stream_still_completes_with_an_empty_response() -> None:
    events, response = stream(body(), [])
    assert types(events) == ["response.created", "response.in_progress", "response.completed"]
    assert response.output == [] and response.status == "completed"
    assert response.usage is not None and response.usage.total_tokens == 0


def test_streamed_reasoning_is_a_reasoning_item_ahead_of_the_text() -> None:
    chunks = [
        chunk(reasoning_content="Think"),
        chunk(reasoning_content="ing."),
        chunk(content="Done."),
        chunk("stop"),
    ]
    events, response = stream(body(), chunks)
    reasoning, message = response.output
    assert reasoning.content[0].text == "Thinking." and message.content[0].text == "Done."
    assert [e.delta for e in events if e.type == "response.reasoning_text.delta"] == [
        "Think",
        "ing.",
    ]


# --- fuzz -------------------------------------------------------------------------------------

WORDS = st.sampled_from(
    [
        "type",
        "role",
        "content",
        "input",
        "tools",
        "name",
        "call_id",
        "arguments",
        "output",
        "namespace",
        "message",
        "user",
        "assistant",
        "developer",
        "function",
        "custom",
        "function_call",
        "function_call_output",
        "custom_tool_call",
        "reasoning",
        "input_text",
        "input_image",
        "text",
        "tool_choice",
        "auto",
        "required",
        "allowed_tools",
        "mode",
        "format",
        "grammar",
        "definition",
        "instructions",
        "max_output_tokens",
        "stream",
        "metadata",
        "previous_response_id",
        "temperature",
        "web_search",
    ]
)
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-3, 10**6)
    | st.floats(allow_nan=False)
    | WORDS
    | st.text(max_size=5)
)
JSON = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(WORDS | st.text(max_size=3), inner, max_size=5)
    ),
    max_leaves=15,
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the shaped value, sometimes any JSON: the code's deep paths and its guards."""
    return st.integers(0, 19).flatmap(lambda n: JSON if n == 0 else strategy)


def objects(
    need: tuple[str, ...] = ("type",), **fields: st.SearchStrategy[Any]
) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with the `need` keys (when among `fields`) and any of the others."""
    return st.fixed_dictionaries(
        {k: maybe(v) for k, v in fields.items() if k in need},
        optional={k: maybe(v) for k, v in fields.items() if k not in need},
    )


IDS = st.sampled_from(["a", "b", ""])
PARTS = st.lists(
    objects(
        type=st.sampled_from(["input_text", "output_text", "input_image", "refusal"]),
        text=st.text(max_size=3),
        refusal=st.text(max_size=3),
    ),
    max_size=3,
)
ITEMS = objects(
    type=st.sampled_from(
        [
            "message",
            "function_call",
            "function_call_output",
            "custom_tool_call",
            "custom_tool_call_output",
            "reasoning",
            "item_reference",
            "web_search_call",
        ]
    ),
    role=st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
    content=st.text(max_size=3) | PARTS,
    call_id=IDS,
    name=st.sampled_from(["f", "apply_patch", "spawn_agent"]),
    namespace=st.sampled_from(["ns", "multi_agent_v1"]),
    arguments=st.text(max_size=3),
    input=st.text(max_size=3),
    output=st.text(max_size=3) | PARTS,
)
FUNCTIONS = objects(
    type=st.sampled_from(["function", "custom"]),
    name=st.text("fgh_", min_size=1, max_size=3),
    parameters=st.just({"type": "object"}),
    format=objects(type=st.just("grammar"), syntax=st.just("lark"), definition=st.text(max_size=3)),
)
TOOLS = st.lists(
    FUNCTIONS
    | objects(
        type=st.sampled_from(["namespace", "web_search"]),
        name=st.just("ns"),
        tools=st.lists(FUNCTIONS, max_size=3),
    ),
    max_size=4,
)
CHOICES = st.sampled_from(["auto", "none", "required"]) | objects(
    type=st.sampled_from(["function", "custom", "allowed_tools", "mcp"]),
    name=st.sampled_from(["f", "spawn_agent"]),
    mode=st.just("auto"),
    tools=st.lists(objects(type=st.just("function"), name=st.just("f")), max_size=2),
)
REQUESTS = objects(
    ("input",),
    input=st.text(max_size=3) | st.lists(ITEMS, max_size=6),
    tools=TOOLS,
    tool_choice=CHOICES,
    instructions=st.text(max_size=3),
    max_output_tokens=st.integers(-1, 9),
    stream=st.booleans(),
    background=st.just(False),
    metadata=st.just({"k": "v"}),
    text=st.just({"format": {"type": "json_object"}}),
)
CALLS = st.lists(
    objects(
        index=st.integers(0, 2),
        id=IDS,
        function=objects(
            name=st.sampled_from(["f", "apply_patch", "ns__g"]), arguments=st.text(max_size=4)
        ),
    ),
    max_size=2,
)
DELTAS = objects(
    role=st.just("assistant"),
    content=st.text(max_size=3),
    reasoning_content=st.text(max_size=3),
    tool_calls=CALLS,
)
CHUNKS = objects(
    choices=st.lists(
        objects(
            index=st.integers(0, 1),
            delta=DELTAS,
            finish_reason=st.sampled_from(["stop", "length", "tool_calls", "abort"]),
        ),
        max_size=2,
    ),
    usage=objects(prompt_tokens=st.integers(0, 9), completion_tokens=st.integers(0, 9)),
    error=objects(message=st.text(max_size=3)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(REQUESTS | st.dictionaries(WORDS, JSON, max_size=6))
def test_translate_raises_only_wire_errors(request: dict[str, Any]) -> None:
    try:
        translation = translate(request)
    except WireError as error:
        assert error.status == 400 and error.message
        return
    assert translation.chat_request()["messages"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(CHUNKS, max_size=4))
def test_any_engine_chunks_make_events_the_sdk_parses(chunks: list[dict[str, Any]]) -> None:
    tools = [EXEC, APPLY_PATCH, NAMESPACE_TOOL]
    events, response = stream(body(tools=tools), chunks)  # parses every event and the Response
    assert events[-1].type in ("response.completed", "response.incomplete", "response.failed")
    assert events[-1].response == response
