"""`reins doctor NAME`: the named harnesses' registry, `--list`, and the errors for an unknown
name, a missing library or CLI, without a model (the fast tier)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reins.cli import app
from reins.doctor import named
from reins.doctor.harnesses import task
from reins.doctor.named import HARNESSES, NamedHarness, availability, harness_command
from reins.doctor.runner import DoctorError

DRIVERS = Path(named.__file__).parent / "harnesses"
EXPECTED = {
    "openai-chat", "openai-chat-stream", "openai-responses", "anthropic-messages", "litellm",
    "langgraph", "openai-agents", "mini-swe-agent", "claude", "codex", "opencode",
    "opencode-responses", "opencode-messages",
}  # fmt: skip


def fake_cli(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["doctor", *args])
    return result.exit_code, result.output


def test_the_registry_names_the_harnesses_of_the_docs_table() -> None:
    assert set(HARNESSES) == EXPECTED
    for harness in HARNESSES.values():
        assert (DRIVERS / f"{harness.module}.py").is_file(), harness.module


def test_no_driver_imports_the_tests() -> None:
    for source in DRIVERS.glob("*.py"):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "tests" or n.startswith("tests.") for n in names), source


def test_list_says_which_harnesses_can_run(tmp_path: Path) -> None:
    fake_cli(tmp_path / "node_modules" / ".bin", "codex")
    code, output = invoke("--list", "--cli-dir", str(tmp_path))
    assert code == 0
    lines = {line.split()[0]: line for line in output.splitlines() if line.strip()}
    assert set(lines) == EXPECTED
    assert lines["codex"].split()[1] == "available"
    assert str(tmp_path / "node_modules" / ".bin" / "codex") in lines["codex"]
    assert lines["claude"].split()[1] == "missing"
    assert "npm install @anthropic-ai/claude-code" in lines["claude"]
    assert lines["openai-chat"].split()[1] == "available"  # openai is a dev dependency


def test_an_unknown_name_is_an_error_that_lists_the_names() -> None:
    code, output = invoke("openai-chta")
    assert code == 2
    assert "no harness named 'openai-chta'" in output
    for name in ("openai-chat", "mini-swe-agent", "opencode-messages"):
        assert name in output


def test_options_after_the_name_are_refused_with_the_right_order() -> None:
    code, output = invoke("openai-chat", "--runs", "1")
    assert code == 2
    assert "reins doctor --runs 1 openai-chat" in output


def test_a_harness_whose_library_is_missing_names_the_package_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = NamedHarness(
        "fake", "a library nobody has", "openai_chat",
        needs=(("openai", "openai"), ("reins_no_such_module", "no-such-package")),
    )  # fmt: skip
    monkeypatch.setitem(HARNESSES, "fake", fake)
    found = availability(fake)
    assert (found.available, found.detail) == (
        False,
        "not installed: pip install 'no-such-package'",
    )
    code, output = invoke("fake")
    assert code == 2
    assert "harness fake cannot run: not installed: pip install 'no-such-package'" in output


def test_a_cli_harness_needs_its_binary_and_gets_its_absolute_path(tmp_path: Path) -> None:
    with pytest.raises(DoctorError, match=r"`opencode` not found in .*npm install opencode-ai"):
        harness_command("opencode-messages", tmp_path)
    binary = fake_cli(tmp_path, "opencode")
    argv = harness_command("opencode-messages", tmp_path)
    assert argv == [
        sys.executable, "-m", "reins.doctor.harnesses.cli_agents", "opencode",
        "--provider", "messages", "--binary", str(binary.absolute()),
    ]  # fmt: skip


def test_a_python_harness_runs_its_driver_with_this_interpreter() -> None:
    assert harness_command("openai-chat-stream") == [
        sys.executable, "-m", "reins.doctor.harnesses.openai_chat", "--stream",
    ]  # fmt: skip


def test_a_driver_without_its_library_exits_with_the_package_to_install() -> None:
    """The driver itself, with `openai` made unimportable: the message, and MISSING_EXIT."""
    hide = (
        "import runpy, sys; sys.modules['openai'] = None; "
        "runpy.run_module('reins.doctor.harnesses.openai_chat', run_name='__main__')"
    )
    env = {**os.environ, "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
    done = subprocess.run(
        [sys.executable, "-c", hide], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == task.MISSING_EXIT
    assert "needs the `openai` package" in done.stderr
    assert "pip install 'openai'" in done.stderr


def test_a_driver_outside_the_doctor_says_how_to_run_it() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_BASE_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "reins.doctor.harnesses.openai_responses"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 2
    assert "OPENAI_BASE_URL is not set: run this driver through `reins doctor NAME`" in done.stderr


def test_the_few_shot_histories_end_with_the_question_after_two_tool_calls() -> None:
    chat = task.chat_history()
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant", "user"]
    assert chat[-1]["content"] == task.QUESTION
    assert [c["function"]["name"] for m in chat[1::2][:2] for c in m["tool_calls"]] == [
        "get_weather", "get_weather",
    ]  # fmt: skip
    responses = task.responses_history()
    assert [i.get("type", "message") for i in responses].count("function_call") == 2
    messages = task.messages_history()
    assert [b["type"] for m in messages[1:4:2] for b in m["content"]] == ["tool_use", "tool_use"]
    assert task.chat_next({"tool_calls": [{"id": "c9"}]}, 0) == [
        {"role": "tool", "tool_call_id": "c9", "content": task.TOOL_RESULT}
    ]
    assert task.chat_next({"content": "Sunny."}, 1) == [
        {"role": "user", "content": task.FOLLOW_UPS[1]}
    ]


def test_the_cli_few_shot_sessions_hold_one_ls_call_per_listing(tmp_path: Path) -> None:
    from reins.doctor.harnesses import cli_sessions

    work = tmp_path / "work"
    session = cli_sessions.claude_session(tmp_path / "home", work, "policy")
    slug = "".join(c if c.isalnum() else "-" for c in str(work))
    lines = [
        json.loads(line)
        for line in (tmp_path / "home" / ".claude" / "projects" / slug / f"{session}.jsonl")
        .read_text()
        .splitlines()
    ]
    assert len(lines) == 4 * len(task.CLI_LISTINGS)
    assert [line["parentUuid"] for line in lines[1:]] == [line["uuid"] for line in lines[:-1]]
    uses = [b for line in lines if line["type"] == "assistant" for b in line["message"]["content"]
            if b["type"] == "tool_use"]  # fmt: skip
    assert [u["input"] for u in uses] == [{"command": "ls"}] * len(task.CLI_LISTINGS)

    thread = cli_sessions.codex_session(tmp_path / "codex", work, "policy")
    (path,) = (tmp_path / "codex" / "sessions").rglob(f"*{thread}.jsonl")
    items = [json.loads(line)["payload"] for line in path.read_text().splitlines()]
    assert items[0]["id"] == thread and items[1]["multi_agent_version"] == "disabled"
    calls = [i for i in items if i.get("type") == "function_call"]
    assert [json.loads(c["arguments"]) for c in calls] == [{"cmd": "ls"}] * len(task.CLI_LISTINGS)

    ident, export = cli_sessions.opencode_session(work, "policy")
    assert export["info"]["id"] == ident
    ids = [m["info"]["id"] for m in export["messages"]]
    assert ids == sorted(ids) and len(ids) == 3 * len(task.OPENCODE_LISTINGS)
    assert export["messages"][0]["parts"][0]["text"] == json.dumps(task.CLI_PROMPT)
