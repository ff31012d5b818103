"""Claude Code or Codex as the coding harness of a rollout: the whole CLI runs in the rollout's
sandbox, because it runs its own tools (a CLI outside would run the agent's commands on the host).

What it sees inside: the checkout at /work (git disabled, no history), its own installation
read-only, a home of its own at /home/agent (config, sessions, TMPDIR), and one network door, the
gateway's port relayed to `reins.sandbox.gateway.GatewayDoor`, which passes only this attempt's
proxy paths: the model, and nothing else (no event posts, no other host, no DNS).

Claude Code runs `claude -p` with only its Bash tool (its `--tools`), thinking off and its output
capped; Codex runs `codex exec` with its lean configuration (`reins.agent.codex_config`) and its
own sandbox off (ours is the sandbox: it has no landlock or seccomp to set up in it), and no
cap on its output but the engine's context (Codex sends no `max_output_tokens` and has no setting
for it). Each writes
its JSON event stream to the home; `commands` reads what it ran from there.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from reins.agent import AgentContext, anthropic_base_url, cli_home_env, write_codex_config
from reins.sandbox import CommandResult, Mount, Sandbox
from reins.sandbox.gateway import GatewayDoor

CliName = Literal["claude", "codex"]
CLI_NAMES: tuple[CliName, ...] = ("claude", "codex")
HOME_INSIDE = "/home/agent"
EVENTS_FILE = "events.jsonl"
_PROMPT_FILE = "prompt.txt"


class CliNotFound(RuntimeError):
    """The CLI is not installed where reins looks for it."""


def find_cli(name: CliName) -> Path:
    """The CLI's executable: `REINS_CLI_HARNESSES/node_modules/.bin/NAME` (where
    `scripts/install-cli-harnesses.sh` puts it), else NAME on the PATH."""
    folder = os.environ.get("REINS_CLI_HARNESSES")
    if folder:
        candidate = Path(folder) / "node_modules" / ".bin" / name
        if candidate.exists():
            return candidate.absolute()
    found = shutil.which(name)
    if found:
        return Path(found).absolute()
    raise CliNotFound(
        f"{name} not found (REINS_CLI_HARNESSES={folder or 'unset'}, nor on the PATH): "
        "`make cli-harnesses` installs Claude Code and Codex into .cache/cli-harnesses; point "
        "REINS_CLI_HARNESSES there"
    )


def _installation(executable: Path) -> Path:
    """The folder to show inside: the npm tree that holds the executable (Codex's launcher is a
    node script that starts a binary from a sibling package), else the executable's folder."""
    real = executable.resolve()
    for parent in real.parents:
        if parent.name == "node_modules":
            return parent.parent
    return real.parent


@dataclass
class CliHarness:
    """One CLI session in a sandbox. Use `sandbox_options()` to create the sandbox, then `run`."""

    name: CliName
    context: AgentContext
    home: Path
    """A host folder of its own for this run (shown inside as /home/agent, writable)."""
    model: str = "policy"
    max_tokens: int = 256
    """Claude Code's output cap per call (CLAUDE_CODE_MAX_OUTPUT_TOKENS); Codex has none."""
    executable: Path = field(default=Path())

    def __post_init__(self) -> None:
        if self.name not in CLI_NAMES:
            raise ValueError(f"harness must be one of {', '.join(CLI_NAMES)}, not {self.name!r}")
        if self.executable == Path():
            self.executable = find_cli(self.name)
        self.home.mkdir(parents=True, exist_ok=True)
        self.door = GatewayDoor(self.context.openai_base_url)

    def sandbox_options(self) -> dict[str, Any]:
        """`Sandbox(...)` keywords: the installation and the home mounted, the gateway's door."""
        # Called by its real path (`command`), which is inside the installation.
        installation = _installation(self.executable)
        mounts = [Mount(installation), Mount(self.home, HOME_INSIDE, writable=True)]
        return {"mounts": mounts, "relays": self.door.relays}

    def env(self) -> dict[str, str]:
        """The CLI's variables inside: the proxy (no gateway URL: it may not post events), a
        home inside the sandbox with every outbound switch off, the output cap."""
        base_url = self.door.inside_url(self.context.openai_base_url)
        home = {
            key: value.replace(str(self.home.resolve()), HOME_INSIDE)
            for key, value in cli_home_env(self.home).items()
        }
        return {
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": self.context.api_key,
            "ANTHROPIC_BASE_URL": anthropic_base_url(base_url),
            "ANTHROPIC_AUTH_TOKEN": self.context.api_key,
            **home,
            "CLAUDE_CODE_DISABLE_THINKING": "1",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(self.max_tokens),
        }

    def command(self) -> str:
        """The shell command that runs one session on the prompt file, its events to a file."""
        home = HOME_INSIDE
        prompt = f'"$(cat {home}/{_PROMPT_FILE})"'
        if self.name == "claude":
            argv = [str(self.executable.resolve()), "-p", "PROMPT", "--model", self.model]
            argv += ["--tools", "Bash", "--allowedTools", "Bash"]
            argv += ["--output-format", "stream-json", "--verbose"]
        else:
            write_codex_config(
                self.home / ".codex",
                self.door.inside_url(self.context.openai_base_url),
                self.model,
                lean=True,
            )
            argv = [str(self.executable.resolve()), "exec", "--json", "--skip-git-repo-check"]
            argv += ["--strict-config", "--dangerously-bypass-approvals-and-sandbox"]
            argv += ["PROMPT"]  # (no setting caps its output: the engine's context does)
        line = " ".join(prompt if part == "PROMPT" else shlex.quote(part) for part in argv)
        return f"{line} > {home}/{EVENTS_FILE}"

    def run(self, sandbox: Sandbox, prompt: str, *, timeout_s: float) -> CommandResult:
        """The session, whole: returns when the CLI exits or `timeout_s` ends it."""
        (self.home / _PROMPT_FILE).write_text(prompt)
        return sandbox.run(self.command(), env=self.env(), timeout_s=timeout_s)

    def commands(self) -> list[tuple[str, str, bool]]:
        """(command, output, succeeded) of each command the CLI ran, from its events."""
        events = []
        for line in _read_events(self.home / EVENTS_FILE).splitlines():
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    events.append(event)
        return _claude_commands(events) if self.name == "claude" else _codex_commands(events)

    def close(self) -> None:
        self.door.close()


EVENTS_MAX_BYTES = 64 * 1024 * 1024
"""The most of the events file read back: the session writes it, so it is read bounded."""


def _read_events(path: Path) -> str:
    """The events file as the session left it, '' when it is no regular file. The home is
    writable inside, so a command of the session could put a link there (`/dev/zero`, read
    on the host until its memory ran out; a host file), or a FIFO (the read waited forever):
    the file is opened without following a link or waiting, and read up to a bound."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # missing, or a link
        return ""
    with open(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            return ""
        return file.read(EVENTS_MAX_BYTES).decode(errors="replace")


def _claude_commands(events: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, bool]]:
    """Claude Code's stream-json: `tool_use` blocks in assistant messages, their `tool_result`s
    in the user messages that follow."""
    calls: dict[str, str] = {}
    ran = []
    for event in events:
        message = event.get("message")
        if not isinstance(message, dict) or not isinstance(message.get("content"), list):
            continue
        # The session can write this file too (it is in the sandbox's home): anything not of
        # the expected shape is passed over, rather than failing the rollout's scoring.
        for block in message["content"]:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "tool_use":
                given = block.get("input")
                command = given.get("command", "") if isinstance(given, dict) else ""
                calls[str(block.get("id", ""))] = str(command)
            elif block.get("type") == "tool_result" and block.get("tool_use_id") in calls:
                content = block.get("content")
                if isinstance(content, list):
                    content = "".join(
                        str(part.get("text", "")) for part in content if isinstance(part, dict)
                    )
                ran.append(
                    (calls.pop(block["tool_use_id"]), str(content), not block.get("is_error"))
                )
    return ran + [(command, "", False) for command in calls.values()]


def _codex_commands(events: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, bool]]:
    """Codex's `--json`: each completed `command_execution` item."""
    ran = []
    for event in events:
        item = event.get("item")
        if not isinstance(item, dict):
            continue
        if event.get("type") == "item.completed" and item.get("type") == "command_execution":
            command = str(item.get("command", ""))
            try:
                with_shell = shlex.split(command)
            except ValueError:  # not shell words: kept as Codex showed it
                with_shell = []
            if len(with_shell) == 3 and with_shell[1] in ("-c", "-lc"):
                command = with_shell[2]  # Codex runs `bash -lc CMD`: the model's CMD
            output = str(item.get("aggregated_output", ""))
            ran.append((command, output, item.get("exit_code") == 0))
    return ran
