"""Reading the commands a coding CLI ran from its JSON events (`reins.swe.cli_harness`), on
events shaped as Claude Code's stream-json and Codex's `--json` write them."""

from __future__ import annotations

from reins.swe.cli_harness import _claude_commands, _codex_commands


def test_claude_tool_uses_are_paired_with_their_results() -> None:
    events = [
        {"type": "system", "subtype": "init"},
        {"type": "assistant", "message": {"content": [
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}},
        ]}},
        {"type": "user", "message": {"content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "a.py\n", "is_error": False},
        ]}},
        {"type": "assistant", "message": {"content": [
            {"type": "tool_use", "id": "t2", "name": "Bash", "input": {"command": "git log"}},
        ]}},
        {"type": "user", "message": {"content": [{"type": "tool_result", "tool_use_id": "t2",
            "content": [{"type": "text", "text": "git: disabled"}], "is_error": True}]}},
        {"type": "assistant", "message": {"content": [
            {"type": "tool_use", "id": "t3", "name": "Bash", "input": {"command": "sleep 999"}},
        ]}},  # the session ended before its result
    ]  # fmt: skip
    assert _claude_commands(events) == [
        ("ls", "a.py\n", True), ("git log", "git: disabled", False), ("sleep 999", "", False)
    ]  # fmt: skip


def test_codex_commands_lose_their_shell_wrapper() -> None:
    def done(command: str, output: str, code: int) -> dict[str, object]:
        item = {"type": "command_execution", "command": command, "aggregated_output": output,
                "exit_code": code}  # fmt: skip
        return {"type": "item.completed", "item": item}

    events = [
        {"type": "item.started", "item": {"type": "command_execution", "command": "ls"}},
        done("/bin/bash -lc 'ls -a'", ".\n..\n", 0),
        {"type": "item.completed", "item": {"type": "agent_message", "text": "Done."}},
        done('echo "unbalanced', "", 1),  # not shell words: kept as shown
    ]
    assert _codex_commands(events) == [("ls -a", ".\n..\n", True), ('echo "unbalanced', "", False)]


def test_events_of_other_shapes_are_passed_over() -> None:
    """The session can write the events file (it is in the sandbox's home): one line such as
    `{"message": {"content": ["x"]}}` made the rollout's scoring fail (AttributeError)."""
    claude = [
        {"message": {"content": ["x", 3, None]}},
        {"message": {"content": [{"type": "tool_use", "id": "t1", "input": "ls"}]}},
        {"message": {"content": [{"type": "tool_result", "tool_use_id": "t1",
                                  "content": ["bare", {"text": "ok"}]}]}},
    ]  # fmt: skip
    assert _claude_commands(claude) == [("", "ok", True)]
    codex = [{"type": "item.completed", "item": "x"}, {"type": "item.completed", "item": None}]
    assert _codex_commands(codex) == []
