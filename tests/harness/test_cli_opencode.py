"""OpenCode (`opencode run`), unmodified, against the gateway proxy in front of the embedded engine
through each of its three providers (chat completions, the Responses API, Anthropic Messages): a
text turn and a tool turn each, every call recorded token for token as OpenCode received it,
with no network beyond the proxy.

Its config is `reins.agent.opencode_config` in a home seeded by `write_opencode_home` (which stops
its background npm install); the agent prompt is replaced and only the `bash` tool kept, so a
request is about 6k characters instead of 31k. `--title` skips the title-generation call (one
engine call fewer per run). The tool turn imports a few-shot session
(`cli_support.opencode_session`) and continues it; see cli_support for why.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from reins.agent import OpenCodeProvider, opencode_config, write_opencode_home
from tests.embedded_support import ServedEngine
from tests.harness.cli_support import (
    MAX_TOKENS,
    OPENCODE_FEW_SHOT_LISTINGS,
    TEXT_PROMPT,
    TOOL_PROMPT,
    Answer,
    CliGateway,
    CliRollout,
    CliRun,
    cli,
    cli_env,
    cli_gateway,
    history_tool_calls,
    opencode_session,
    report,
    run_cli,
    workspace,
)

pytestmark = pytest.mark.slow

PROMPT = "You are a coding agent. Be brief. Use bash to run shell commands."
PROVIDERS: list[OpenCodeProvider] = ["chat", "responses", "messages"]


@pytest.fixture(scope="module")
def gateway(
    embedded: ServedEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CliGateway]:
    with cli_gateway(embedded, tmp_path_factory.mktemp("opencode-gateway")) as served:
        yield served


def prepare(rollout: CliRollout, root: Path, provider: OpenCodeProvider) -> dict[str, str]:
    """The environment of an OpenCode run, its home written and seeded."""
    env = cli_env(rollout, root / "home")
    config = opencode_config(
        provider,
        rollout.context.openai_base_url,
        rollout.model,
        context_limit=rollout.engine.engine.max_model_len,
        output_limit=MAX_TOKENS,
        prompt=PROMPT,
        tools=["bash"],
    )
    write_opencode_home(env["HOME"], config)
    workspace(root)
    return env


def run_opencode(rollout: CliRollout, root: Path, env: dict[str, str], *args: str) -> CliRun:
    argv: list[str | Path] = [cli("opencode"), *args]
    return run_cli(argv, env=env, cwd=root / "work", port=rollout.port, scratch=root)


def shown(run: CliRun) -> list[tuple[str, object]]:
    """What OpenCode reports with `--format json`, in order: text parts and tool calls."""
    seen: list[tuple[str, object]] = []
    for event in run.json_lines():
        part = event.get("part") or {}
        if event.get("type") == "text":
            seen.append(("text", part["text"]))
        elif event.get("type") == "tool_use":
            seen.append(("tool", (part["tool"], part["state"]["input"])))
    return seen


def as_shown(answers: list[Answer]) -> list[tuple[str, object]]:
    seen: list[tuple[str, object]] = []
    for answer in answers:
        if answer.text.strip():
            seen.append(("text", answer.text))
        seen += [("tool", call) for call in answer.tool_calls]
    return seen


@pytest.mark.parametrize("provider", PROVIDERS)
def test_text_turn(gateway: CliGateway, tmp_path: Path, provider: OpenCodeProvider) -> None:
    rollout = gateway.open_rollout()
    env = prepare(rollout, tmp_path, provider)
    run = run_opencode(
        rollout, tmp_path, env, "run", "--format", "json", "--title", "t", TEXT_PROMPT
    )
    run.check()
    answers = rollout.checked_calls(provider)
    report(f"opencode {provider} text", run, rollout)

    assert answers[-1].tool_calls == () and answers[-1].text
    assert shown(run) == as_shown(answers)
    request = rollout.calls()[0]["request"]
    assert request["model"] == rollout.model and request["stream"] is True


@pytest.mark.parametrize("provider", PROVIDERS)
def test_tool_turn_runs_the_models_own_call(
    gateway: CliGateway, tmp_path: Path, provider: OpenCodeProvider
) -> None:
    rollout = gateway.open_rollout()
    env = prepare(rollout, tmp_path, provider)
    session, export = opencode_session(tmp_path / "work", rollout.model)
    (tmp_path / "few-shot.json").write_text(json.dumps(export))
    imported = run_opencode(rollout, tmp_path, env, "import", str(tmp_path / "few-shot.json"))
    imported.check()
    run = run_opencode(
        rollout, tmp_path, env, "run", "--format", "json", "--session", session, TOOL_PROMPT
    )
    run.check()
    answers = rollout.checked_calls(provider)
    report(f"opencode {provider} tool", run, rollout)

    request = rollout.calls()[0]["request"]
    assert request["stream"] is True
    assert history_tool_calls(provider, request) == len(OPENCODE_FEW_SHOT_LISTINGS)
    (call,) = answers[0].tool_calls
    assert call[0] == "bash" and call[1]["command"] == "ls"
    outputs = [
        (event["part"]["state"].get("output") or "")
        for event in run.json_lines()
        if event.get("type") == "tool_use"
    ]
    assert outputs and "notes.txt" in outputs[0]  # OpenCode ran it
    assert len(answers) >= 2 and answers[-1].tool_calls == () and answers[-1].text
    assert shown(run) == as_shown(answers)
