"""Codex CLI (`codex exec`), unmodified, against the gateway's Responses API proxy in front of the
embedded engine: a text turn and a tool turn, every call recorded token for token as Codex
received it, with no network beyond the proxy.

Codex ignores `OPENAI_BASE_URL`: it gets the proxy from the `config.toml` that
`reins.agent.write_codex_config` writes (provider `local`, `wire_api = "responses"`, the key from
`OPENAI_API_KEY`), checked by `--strict-config`. `lean=True` and a one-line instructions file
bring its request from 41k to about 4.6k characters. The tool turn resumes a few-shot rollout
(`cli_support.codex_session`); see cli_support for why.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from reins.agent import write_codex_config
from tests.embedded_support import ServedEngine
from tests.harness.cli_support import (
    FEW_SHOT_LISTINGS,
    TEXT_PROMPT,
    TOOL_PROMPT,
    Answer,
    CliGateway,
    CliRollout,
    CliRun,
    cli,
    cli_env,
    cli_gateway,
    codex_session,
    history_tool_calls,
    report,
    run_cli,
    workspace,
)

pytestmark = pytest.mark.slow

INSTRUCTIONS = "You are a coding agent. Be brief. Use exec_command to run shell commands.\n"


@pytest.fixture(scope="module")
def gateway(
    embedded: ServedEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CliGateway]:
    with cli_gateway(embedded, tmp_path_factory.mktemp("codex-gateway")) as served:
        yield served


def prepare(rollout: CliRollout, root: Path) -> tuple[dict[str, str], Path]:
    """The environment and working folder of a Codex run, its CODEX_HOME written."""
    env = cli_env(rollout, root / "home")
    instructions = root / "home" / "instructions.md"
    instructions.write_text(INSTRUCTIONS)
    write_codex_config(
        env["CODEX_HOME"],
        rollout.context.openai_base_url,
        rollout.model,
        instructions_file=instructions,
        lean=True,
    )
    return env, workspace(root)


def run_codex(rollout: CliRollout, root: Path, env: dict[str, str], *args: str) -> CliRun:
    argv: list[str | Path] = [cli("codex"), "exec", "--json", "--skip-git-repo-check"]
    argv += ["--strict-config", *args]
    return run_cli(argv, env=env, cwd=root / "work", port=rollout.port, scratch=root)


def shown(run: CliRun) -> list[tuple[str, str]]:
    """What Codex reports in `--json`, in order: its messages' text and the commands it ran."""
    seen = []
    for event in run.json_lines():
        item = event.get("item") or {}
        if event.get("type") != "item.completed":
            continue
        if item.get("type") == "agent_message":
            seen.append(("text", item["text"]))
        elif item.get("type") == "command_execution":
            seen.append(("command", shlex.split(item["command"])[-1]))
    return seen


def as_shown(answers: list[Answer]) -> list[tuple[str, str]]:
    """The recorded answers as Codex reports them: text, then each `exec_command`'s `cmd`."""
    seen = []
    for answer in answers:
        if answer.text.strip():
            seen.append(("text", answer.text))
        seen += [("command", arguments["cmd"]) for _, arguments in answer.tool_calls]
    return seen


def test_text_turn(gateway: CliGateway, tmp_path: Path) -> None:
    rollout = gateway.open_rollout()
    env, _ = prepare(rollout, tmp_path)
    run = run_codex(rollout, tmp_path, env, TEXT_PROMPT)
    run.check()
    answers = rollout.checked_calls("responses")
    report("codex text", run, rollout)

    assert answers[-1].tool_calls == () and answers[-1].text
    assert shown(run) == as_shown(answers)
    request = rollout.calls()[0]["request"]
    assert request["model"] == rollout.model and request["stream"] is True
    assert request["input"][0]["content"][0]["text"] == INSTRUCTIONS.strip()  # the file
    assert {tool.get("name") for tool in request["tools"]} >= {"exec_command"}


def test_tool_turn_runs_the_models_own_call(gateway: CliGateway, tmp_path: Path) -> None:
    rollout = gateway.open_rollout()
    env, cwd = prepare(rollout, tmp_path)
    thread = codex_session(Path(env["CODEX_HOME"]), cwd, rollout.model)
    run = run_codex(rollout, tmp_path, env, "resume", thread, TOOL_PROMPT)
    run.check()
    answers = rollout.checked_calls("responses")
    report("codex tool", run, rollout)

    request = rollout.calls()[0]["request"]
    assert history_tool_calls("responses", request) == len(FEW_SHOT_LISTINGS)
    (call,) = answers[0].tool_calls
    assert call == ("exec_command", {"cmd": "ls"})
    executed = [
        event["item"]
        for event in run.json_lines()
        if (event.get("item") or {}).get("type") == "command_execution"
        and event.get("type") == "item.completed"
    ]
    assert executed and "notes.txt" in executed[0]["aggregated_output"]  # Codex ran it
    assert len(answers) >= 2 and answers[-1].tool_calls == () and answers[-1].text
    assert shown(run) == as_shown(answers)
