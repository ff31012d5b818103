"""Claude Code (`claude -p`), unmodified, against the gateway's Anthropic Messages proxy in front of
the embedded engine: a text turn and a tool turn, every call recorded token for token as Claude
Code received it, with no network beyond the proxy.

Claude Code gets exactly the controller's environment (`ANTHROPIC_BASE_URL`, the scoped token in
`ANTHROPIC_AUTH_TOKEN` and `ANTHROPIC_API_KEY`: it sends both headers) plus
`reins.agent.cli_home_env`. Its prompt is kept small with its own options: `--tools Bash` (one
tool), thinking off and `CLAUDE_CODE_MAX_OUTPUT_TOKENS`; the text turn keeps its default system
prompt (about 9k characters of request), the tool turn adds `--bare` (about 2.6k) and resumes a
few-shot session (`cli_support.claude_session`; see cli_support for why).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.embedded_support import ServedEngine
from tests.harness.cli_support import (
    FEW_SHOT_LISTINGS,
    MAX_TOKENS,
    TEXT_PROMPT,
    TOOL_PROMPT,
    Answer,
    CliGateway,
    CliRollout,
    CliRun,
    claude_session,
    cli,
    cli_env,
    cli_gateway,
    history_tool_calls,
    report,
    run_cli,
    workspace,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(
    embedded: ServedEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CliGateway]:
    with cli_gateway(embedded, tmp_path_factory.mktemp("claude-gateway")) as served:
        yield served


def run_claude(rollout: CliRollout, root: Path, prompt: str, *options: str) -> CliRun:
    home, cwd = root / "home", workspace(root)
    env = cli_env(
        rollout,
        home,
        CLAUDE_CODE_DISABLE_THINKING="1",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(MAX_TOKENS),
    )
    argv: list[str | Path] = [cli("claude"), "-p", prompt, "--model", rollout.model]
    argv += ["--tools", "Bash", "--allowedTools", "Bash"]
    argv += ["--output-format", "stream-json", "--verbose", *options]
    return run_cli(argv, env=env, cwd=cwd, port=rollout.port, scratch=root)


def received(run: CliRun) -> list[Answer]:
    """Each API answer as Claude Code shows it in `stream-json`: its assistant messages (one
    event per content block, grouped by the message id), text and `tool_use` blocks."""
    blocks: dict[str, list[dict[str, Any]]] = {}
    for event in run.json_lines():
        if event.get("type") == "assistant":
            message = event["message"]
            blocks.setdefault(message["id"], []).extend(message["content"])
    answers = []
    for content in blocks.values():
        text = "".join(block["text"] for block in content if block["type"] == "text")
        calls = tuple(
            (block["name"], block["input"]) for block in content if block["type"] == "tool_use"
        )
        answers.append(Answer(text, calls))
    return answers


def result(run: CliRun) -> dict[str, Any]:
    (final,) = [event for event in run.json_lines() if event.get("type") == "result"]
    return final


def tool_results(run: CliRun) -> list[str]:
    """The tool results Claude Code sent back, as text."""
    found = []
    for event in run.json_lines():
        if event.get("type") != "user":
            continue
        for block in event["message"]["content"]:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                content = block["content"]
                found.append(content if isinstance(content, str) else str(content))
    return found


def test_text_turn(gateway: CliGateway, tmp_path: Path) -> None:
    rollout = gateway.open_rollout()
    run = run_claude(rollout, tmp_path, TEXT_PROMPT)  # its default system prompt (5.4k chars)
    run.check()
    answers = rollout.checked_calls("messages")
    report("claude text", run, rollout)

    assert received(run) == answers
    assert answers[-1].tool_calls == () and answers[-1].text
    assert result(run)["result"] == answers[-1].text
    request = rollout.calls()[0]["request"]
    assert [tool["name"] for tool in request["tools"]] == ["Bash"]
    assert request["model"] == rollout.model and request["stream"] is True


def test_tool_turn_runs_the_models_own_call(gateway: CliGateway, tmp_path: Path) -> None:
    rollout = gateway.open_rollout()
    session = claude_session(tmp_path / "home", workspace(tmp_path), rollout.model)
    run = run_claude(rollout, tmp_path, TOOL_PROMPT, "--bare", "--resume", session)
    run.check()
    answers = rollout.checked_calls("messages")
    report("claude tool", run, rollout)

    request = rollout.calls()[0]["request"]
    assert history_tool_calls("messages", request) == len(FEW_SHOT_LISTINGS)
    assert received(run) == answers
    (call,) = answers[0].tool_calls
    assert call[0] == "Bash" and call[1]["command"] == "ls"
    assert any("notes.txt" in output for output in tool_results(run))  # Claude Code ran it
    assert len(answers) >= 2 and answers[-1].tool_calls == ()
    assert answers[-1].text and result(run)["result"] == answers[-1].text


def test_a_prompt_beyond_the_context_is_one_claude_code_understands(
    gateway: CliGateway, tmp_path: Path
) -> None:
    """The proxy says an overflow in Anthropic's words: Claude Code reads the engine's count and
    context from them (its compaction works from those; a first turn has nothing to compact)."""
    rollout = gateway.open_rollout()
    limit = rollout.engine.engine.max_model_len
    run = run_claude(rollout, tmp_path, "Summarize: " + "word " * limit)
    assert run.returncode == 1 and run.outbound == []
    (call,) = rollout.calls()
    assert call["status"] == 400
    prompt = int(call["error"].split("the prompt has ")[1].split(".")[0])
    final = result(run)
    assert final["is_error"] is True and final["api_error_status"] == 400
    assert final["result"].startswith(f"Prompt is too long · the request is ~{prompt} tokens "
                                      f"(limit {limit})")  # fmt: skip
