"""The harnesses `reins doctor NAME` can run by itself: names, driver programs, what each needs.

Each name is one row of docs/harnesses.md's table that reins can drive without the user's code:
a Python library (its driver is `python -m reins.doctor.harnesses.MODULE`, this interpreter), or a
coding-agent CLI found on PATH or in `--cli-dir` (driven by `harnesses.cli_agents`, which
writes its config for the rollout's proxy). Availability is read without importing anything
(`importlib.util.find_spec`, `shutil.which`), so `--list` is instant; a harness that is not
available is an error naming what to install, before any engine is loaded.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from reins.doctor.runner import DoctorError

DRIVERS = "reins.doctor.harnesses"
NPM_PACKAGES = {
    "claude": "@anthropic-ai/claude-code",
    "codex": "@openai/codex",
    "opencode": "opencode-ai",
}


@dataclass(frozen=True)
class NamedHarness:
    name: str
    description: str
    module: str
    """The driver, a module of `reins.doctor.harnesses`."""
    args: tuple[str, ...] = ()
    needs: tuple[tuple[str, str], ...] = ()
    """(import name, pip package) of each library the driver imports."""
    binary: str | None = None
    """The CLI's executable name, for CLI harnesses."""


HARNESSES: dict[str, NamedHarness] = {
    h.name: h
    for h in (
        NamedHarness("openai-chat", "openai SDK, chat completions, plain", "openai_chat",
                     needs=(("openai", "openai"),)),
        NamedHarness("openai-chat-stream", "openai SDK, chat completions, streamed",
                     "openai_chat", ("--stream",), needs=(("openai", "openai"),)),
        NamedHarness("openai-responses", "openai SDK, Responses API", "openai_responses",
                     needs=(("openai", "openai"),)),
        NamedHarness("anthropic-messages", "Anthropic SDK, Messages API", "anthropic_messages",
                     needs=(("anthropic", "anthropic"),)),
        NamedHarness("litellm", "litellm.completion, openai/ provider", "litellm_chat",
                     needs=(("litellm", "litellm"),)),
        NamedHarness("langgraph", "LangGraph create_react_agent on langchain-openai ChatOpenAI",
                     "langgraph_react",
                     needs=(("langgraph", "langgraph"), ("langchain_openai", "langchain-openai"))),
        NamedHarness("openai-agents", "OpenAI Agents SDK, default model (Responses API)",
                     "openai_agents",
                     needs=(("agents", "openai-agents"), ("openai", "openai"))),
        NamedHarness("mini-swe-agent", "mini-swe-agent's default agent, local environment",
                     "mini_swe_agent",
                     needs=(("minisweagent", "mini-swe-agent"), ("yaml", "PyYAML"))),
        NamedHarness("claude", "Claude Code `claude -p` (Messages API)", "cli_agents",
                     ("claude",), binary="claude"),
        NamedHarness("codex", "Codex CLI `codex exec` (Responses API)", "cli_agents",
                     ("codex",), binary="codex"),
        NamedHarness("opencode", "OpenCode `opencode run`, chat completions provider",
                     "cli_agents", ("opencode", "--provider", "chat"), binary="opencode"),
        NamedHarness("opencode-responses", "OpenCode `opencode run`, Responses provider",
                     "cli_agents", ("opencode", "--provider", "responses"), binary="opencode"),
        NamedHarness("opencode-messages", "OpenCode `opencode run`, Messages provider",
                     "cli_agents", ("opencode", "--provider", "messages"), binary="opencode"),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Availability:
    harness: NamedHarness
    available: bool
    detail: str
    """The binary found, or what is missing and how to install it."""


def find_binary(name: str, cli_dir: Path | None) -> Path | None:
    """`name` in `cli_dir` (or its `node_modules/.bin`, as `npm install` there leaves it), else
    on PATH."""
    if cli_dir is not None:
        for folder in (cli_dir, cli_dir / "node_modules" / ".bin"):
            found = shutil.which(name, path=str(folder.expanduser()))
            if found:
                return Path(found).absolute()
        return None
    found = shutil.which(name)
    return Path(found).absolute() if found else None


def availability(harness: NamedHarness, cli_dir: Path | None = None) -> Availability:
    if harness.binary is not None:
        binary = find_binary(harness.binary, cli_dir)
        if binary is None:
            where = f"in {cli_dir}" if cli_dir is not None else "on PATH"
            return Availability(
                harness,
                False,
                f"`{harness.binary}` not found {where}: npm install "
                f"{NPM_PACKAGES[harness.binary]} (then --cli-dir FOLDER or put it on PATH)",
            )
        return Availability(harness, True, str(binary))
    missing = [package for module, package in harness.needs if not _importable(module)]
    if missing:
        packages = " ".join(f"'{p}'" for p in missing)
        return Availability(harness, False, f"not installed: pip install {packages}")
    return Availability(harness, True, "installed")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def list_harnesses(cli_dir: Path | None = None) -> list[Availability]:
    return [availability(h, cli_dir) for h in HARNESSES.values()]


def render_list(rows: Sequence[Availability]) -> str:
    width = max(len(row.harness.name) for row in rows)
    lines = []
    for row in rows:
        state = "available" if row.available else "missing"
        lines.append(
            f"{row.harness.name.ljust(width)}  {state:9}  {row.harness.description}"
            + ("" if row.available and row.harness.binary is None else f" ({row.detail})")
        )
    return "\n".join(lines)


def harness_command(name: str, cli_dir: Path | None = None) -> list[str]:
    """The command that runs harness `name`; a DoctorError when it is unknown or missing."""
    harness = HARNESSES.get(name)
    if harness is None:
        raise DoctorError(
            f"no harness named {name!r}; the names are: {', '.join(HARNESSES)} "
            "(or run your own: reins doctor -- CMD ARGS...)"
        )
    found = availability(harness, cli_dir)
    if not found.available:
        raise DoctorError(f"harness {name} cannot run: {found.detail}")
    argv = [sys.executable, "-m", f"{DRIVERS}.{harness.module}", *harness.args]
    if harness.binary is not None:
        argv += ["--binary", found.detail]
    return argv
