"""Reading the commands a coding CLI ran from its JSON events (`reins.swe.cli_harness`), on
events shaped as Claude Code's stream-json and Codex's `--json` write them."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from reins.agent import POSTED_CHARS, AgentContext
from reins.sandbox import CommandResult, Sandbox, SandboxLimits
from reins.swe.cli_harness import EVENTS_FILE, CliHarness, _claude_commands, _codex_commands
from reins.swe.environment import SandboxEnvironment
from reins.swe.hacks import HackAttempt
from tests.swe.conftest import needs_sandbox


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


CODEX_EVENT = (
    '{"type": "item.completed", "item": {"type": "command_execution", "command": "ls", '
    '"aggregated_output": "", "exit_code": 0}}\n'
)


def _harness(home: Path) -> CliHarness:
    context = AgentContext(
        "http://127.0.0.1:9/proxy/rollout/r/attempt/1/mode/val/openai/v1",
        *("token", "http://127.0.0.1:9", "r", 1, "val", None),
    )
    return CliHarness("codex", context, home, executable=Path("/bin/true"))


def _commands_within(harness: CliHarness, seconds: float) -> list[tuple[str, str, bool]] | None:
    """`harness.commands()`, or None when it has not returned within `seconds`."""
    answer: list[list[tuple[str, str, bool]]] = []
    thread = threading.Thread(target=lambda: answer.append(harness.commands()), daemon=True)
    thread.start()
    thread.join(seconds)
    return answer[0] if answer else None


def test_the_events_file_is_read_as_the_session_left_it_never_through_a_link(
    tmp_path: Path,
) -> None:
    """The home is writable inside the sandbox: a command of the session could replace the
    events file with a link, which the host followed (to a host file; to `/dev/zero`, read
    until the host's memory ran out), or with a FIFO, whose read waited forever."""
    outside = tmp_path / "host-file.jsonl"
    outside.write_text(CODEX_EVENT)
    harness = _harness(tmp_path / "home")
    events = tmp_path / "home" / EVENTS_FILE
    try:
        events.write_text(CODEX_EVENT)
        assert _commands_within(harness, 10) == [("ls", "", True)]
        events.unlink()
        events.symlink_to(outside)
        assert _commands_within(harness, 10) == []
        events.unlink()
        events.symlink_to("/dev/zero")
        assert _commands_within(harness, 10) == []
        events.unlink()
        os.mkfifo(events)
        assert _commands_within(harness, 10) == []
    finally:
        harness.close()


def test_a_huge_output_or_command_is_posted_as_head_and_tail_its_hacks_found_in_all(
    tmp_path: Path,
) -> None:
    """A Codex command's `aggregated_output` went whole into its `tool` event: one of 40 MB
    made an event larger than the gateway takes in a post (32 MB), and the rollout failed
    before its reward. Now what is posted is cut as the sandbox cuts an output (head and tail,
    a note in place of the middle), and so is a command's text (the session can write the
    events file itself); the hacks are still looked for in the whole of both."""
    needs_sandbox()
    output = "first line\n" + "y" * 20_000_000 + "\nNetwork is unreachable\n"
    output += "y" * 20_000_000 + "\nlast line"
    command = "echo " + "z" * 300_000 + "\ngit log\n" + "z" * 300_000
    event = {"type": "item.completed", "item": {"type": "command_execution",
             "command": command, "aggregated_output": output, "exit_code": 0}}  # fmt: skip
    harness = _harness(tmp_path / "home")
    posted: list[tuple[str, CommandResult, list[HackAttempt]]] = []
    (tmp_path / "work").mkdir()
    try:
        (tmp_path / "home" / EVENTS_FILE).write_text(json.dumps(event) + "\n" + CODEX_EVENT)
        with Sandbox(tmp_path / "work", SandboxLimits()) as box:
            environment = SandboxEnvironment(box, on_command=lambda *done: posted.append(done))
            for ran, text, ok in harness.commands():
                environment.record(ran, CommandResult(0 if ok else 1, text, None, 0.0))
    finally:
        harness.close()
    (shown_command, shown, hacks), small = posted
    assert (small[0], small[1].output, small[2]) == ("ls", "", [])
    assert shown.output.startswith("first line\n") and shown.output.endswith("\nlast line")
    note = f"[... output truncated: {len(output)} characters in all, the middle left out ...]"
    assert note in shown.output
    assert len(shown.output) == POSTED_CHARS + len(note) + 2
    assert shown_command.startswith("echo zzz") and f"{len(command)} characters" in shown_command
    assert len(shown_command) < POSTED_CHARS + 200
    assert [hack.kind for hack in hacks] == ["git-history", "python-network"]
    assert [hack.kind for hack in environment.hacks] == ["git-history", "python-network"]
