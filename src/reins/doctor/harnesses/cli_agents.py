"""`reins doctor claude|codex|opencode[-responses|-messages]`: a coding-agent CLI, one run.

`python -m reins.doctor.harnesses.cli_agents CLI --binary PATH [--provider chat|responses|
messages]`: makes a home of its own in a temporary folder (`reins.agent.cli_home_env`: HOME,
TMPDIR, the XDG folders, every switch that stops the CLI's own outbound calls), writes the
CLI's config for the proxy in the rollout's environment (Codex: `write_codex_config`, lean;
OpenCode: `write_opencode_home`, the bash tool only) and a few-shot session in which it answered
`task.CLI_PROMPT` by running `ls` (`cli_sessions`), then resumes that session non-interactively
in a workspace holding one file, with the same prompt: the model calls the shell tool, the CLI
runs it and sends the result back (two calls or more). The CLI's exit status is this program's.
Small-context settings as in the harness tests (docs/harnesses.md): Claude Code with `--bare`
and the Bash tool alone, thinking off; Codex with short instructions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from reins.agent import cli_home_env, opencode_config, write_codex_config, write_opencode_home
from reins.doctor.harnesses import cli_sessions, task

MAX_TOKENS = 48
INSTRUCTIONS = "You are a coding agent. Be brief. Use exec_command to run shell commands.\n"
OPENCODE_PROMPT = "You are a coding agent. Be brief. Use bash to run shell commands."
CONTEXT = 4096
"""The context OpenCode is told the model has (the default model's)."""


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> int:
    try:
        return subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL).returncode
    except OSError as error:
        task.fail(f"cannot start {argv[0]}: {error}")


def claude(binary: str, env: dict[str, str], home: Path, work: Path) -> int:
    env = {**env, "CLAUDE_CODE_DISABLE_THINKING": "1",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_TOKENS)}  # fmt: skip
    session = cli_sessions.claude_session(home, work, task.MODEL)
    argv = [binary, "-p", task.CLI_PROMPT, "--model", task.MODEL, "--bare", "--resume", session]
    argv += ["--tools", "Bash", "--allowedTools", "Bash"]
    return _run([*argv, "--output-format", "stream-json", "--verbose"], env, work)


def codex(binary: str, env: dict[str, str], home: Path, work: Path) -> int:
    instructions = home / "instructions.md"
    instructions.write_text(INSTRUCTIONS)
    codex_home = Path(env["CODEX_HOME"])
    write_codex_config(
        codex_home, task.env("OPENAI_BASE_URL"), task.MODEL,
        instructions_file=instructions, lean=True,
    )  # fmt: skip
    thread = cli_sessions.codex_session(codex_home, work, task.MODEL)
    argv = [binary, "exec", "--json", "--skip-git-repo-check", "--strict-config"]
    return _run([*argv, "resume", thread, task.CLI_PROMPT], env, work)


def opencode(binary: str, env: dict[str, str], home: Path, work: Path, provider: str) -> int:
    config = opencode_config(
        provider,  # type: ignore[arg-type]
        task.env("OPENAI_BASE_URL"),
        task.MODEL,
        context_limit=CONTEXT,
        output_limit=MAX_TOKENS,
        prompt=OPENCODE_PROMPT,
        tools=["bash"],
    )
    write_opencode_home(home, config)
    session, export = cli_sessions.opencode_session(work, task.MODEL)
    exported = home / "few-shot.json"
    exported.write_text(json.dumps(export))
    imported = _run([binary, "import", str(exported)], env, work)
    if imported != 0:
        task.fail(f"`opencode import` of the few-shot session exited {imported}", imported)
    argv = [binary, "run", "--format", "json", "--session", session, task.CLI_PROMPT]
    return _run(argv, env, work)


def main() -> None:
    parser = argparse.ArgumentParser(description="One run of a coding-agent CLI.")
    parser.add_argument("cli", choices=["claude", "codex", "opencode"])
    parser.add_argument("--binary", required=True)
    parser.add_argument("--provider", default="chat", choices=["chat", "responses", "messages"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix=f"reins-doctor-{args.cli}-") as folder:
        home, work = Path(folder) / "home", Path(folder) / "work"
        work.mkdir()
        (work / "notes.txt").write_text("reins\n")
        env = {**os.environ, **cli_home_env(home)}
        if args.cli == "claude":
            code = claude(args.binary, env, home, work)
        elif args.cli == "codex":
            code = codex(args.binary, env, home, work)
        else:
            code = opencode(args.binary, env, home, work, args.provider)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
