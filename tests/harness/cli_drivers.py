"""The coding-agent CLIs (Claude Code, Codex CLI, OpenCode) as multi-turn harnesses for
benchmarks/fidelity.py: each task resumes the few-shot session of tests/harness/cli_support.py
and runs the CLI `RUNS` times in that same session, each run one prompt (`List the files.`): the
CLI sends its whole transcript back at every call, so the rollout's calls are a multi-turn history
held by the CLI itself. The CLIs are run exactly as their tests run them (same options, homes,
network isolation), but on a rollout in `train` mode (temperature 1).

A task returns what the CLI showed it received when its output says that call by call (Claude
Code's `stream-json` assistant messages); None otherwise (Codex's and OpenCode's JSON events group
text and commands differently from calls): only the record-side check applies then.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from reins.agent import AgentContext
from reins.doctor.received import Answer
from tests.harness.cli_support import (
    TOOL_PROMPT,
    CliRollout,
    CliRun,
    claude_session,
    codex_session,
)
from tests.harness.cli_support import opencode_session as opencode_few_shot
from tests.harness.conftest import Rollout

RUNS = 2
"""CLI runs (prompts) per rollout, in one session."""


def cli_rollout(rollout: Rollout) -> CliRollout:
    """The CLI tests' view of a (train-mode) rollout attempt."""
    context = AgentContext(
        openai_base_url=rollout.base_url,
        api_key=rollout.token,
        gateway_url=rollout.gateway_url,
        rollout_id=rollout.rollout_id,
        attempt_id=1,
        mode=rollout.mode,
        input=None,
    )
    port = urlparse(rollout.gateway_url).port
    assert port is not None, rollout.gateway_url
    return CliRollout(context, rollout.engine, port)


def _failed(name: str, run: CliRun) -> RuntimeError:
    """The CLI's error: its stderr's end, else its last JSON event (Codex writes errors there)."""
    said = run.stderr.strip()[-300:] or (run.stdout.strip().splitlines() or [""])[-1][-300:]
    return RuntimeError(f"{name} exited {run.returncode}: {said}")


def claude_task(rollout: Rollout, workdir: Path) -> list[Answer] | None:
    from tests.harness import test_cli_claude as claude

    cli = cli_rollout(rollout)
    session = claude_session(workdir / "home", claude.workspace(workdir), cli.model)
    received: list[Answer] = []
    for _ in range(RUNS):
        run = claude.run_claude(cli, workdir, TOOL_PROMPT, "--bare", "--resume", session)
        if run.returncode != 0:
            raise _failed("claude", run)
        received += [Answer(a.text, a.tool_calls) for a in claude.received(run)]
        ids = {e.get("session_id") for e in run.json_lines() if e.get("session_id")}
        session = ids.pop() if len(ids) == 1 else session
    return received


def codex_task(rollout: Rollout, workdir: Path) -> list[Answer] | None:
    from tests.harness import test_cli_codex as codex

    cli = cli_rollout(rollout)
    env, cwd = codex.prepare(cli, workdir)
    thread = codex_session(Path(env["CODEX_HOME"]), cwd, cli.model)
    for _ in range(RUNS):
        run = codex.run_codex(cli, workdir, env, "resume", thread, TOOL_PROMPT)
        if run.returncode != 0:
            raise _failed("codex", run)
    return None


def opencode_task(rollout: Rollout, workdir: Path) -> list[Answer] | None:
    """OpenCode on its `chat` provider (an OpenAI-compatible endpoint)."""
    from tests.harness import test_cli_opencode as opencode

    cli = cli_rollout(rollout)
    env = opencode.prepare(cli, workdir, "chat")
    session, export = opencode_few_shot(workdir / "work", cli.model)
    (workdir / "few-shot.json").write_text(json.dumps(export))
    imported = opencode.run_opencode(cli, workdir, env, "import", str(workdir / "few-shot.json"))
    if imported.returncode != 0:
        raise _failed("opencode import", imported)
    for _ in range(RUNS):
        run = opencode.run_opencode(
            cli, workdir, env, "run", "--format", "json", "--session", session, TOOL_PROMPT
        )
        if run.returncode != 0:
            raise _failed("opencode", run)
    return None


TASKS: dict[str, Callable[[Rollout, Path], list[Answer] | None]] = {
    "claude": claude_task,
    "codex": codex_task,
    "opencode": opencode_task,
}
