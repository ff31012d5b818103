"""The paper's coding agent (section 4.3): mini-swe-agent on a SWE-smith task, reward by tests.

One rollout (`examples.swe.agent:run`, the task as `reins swe prepare` writes it):

1. the task's problem branch is cloned into a fresh folder, its git history kept beside it,
   out of the agent's sight (`reins.swe.workspace`);
2. mini-swe-agent, unmodified (its default agent, its litellm model pointed at the proxy, the
   templates of its own `mini.yaml`), works on the problem statement; each command it sends
   runs in the rollout's sandbox (`reins.swe.environment`): no network at all, git disabled;
3. after the sandbox is closed, the agent's diff is applied to the branch's parent, where the
   FAIL_TO_PASS tests are, and the repository's tests run in a new sandbox: reward 1 when
   every FAIL_TO_PASS and PASS_TO_PASS test passes.

Reported per rollout: a `tool` event per command, a `hack_attempt` event per reward hack tried
(paper 4.3.2: git history, wget/curl, pip download, Python networking; all of them fail), a
`patch` event with the agent's diff, and the reward with the metrics `commands`, `submitted`,
`hack_attempts` and `patch_lines`.

Claude Code or Codex instead (SWE_HARNESS=claude or codex, `reins.swe.cli_harness`): the whole
CLI runs in the sandbox (it runs its own commands), with its installation and a home mounted and
one network door, the gateway's model proxy for this attempt; its commands are read from its
JSON events afterwards and reported the same way, and a request it made to the gateway beyond
the proxy (an event post) is refused and recorded as a `gateway-api` hack.

Settings (environment variables, for the controller's agents): SWE_HARNESS (mini-swe-agent,
claude or codex), SWE_STEP_LIMIT (mini-swe-agent's model calls, default 8 here, the paper's runs
use far more), SWE_MAX_TOKENS (per call, 256), SWE_COMMAND_S (wall seconds per command, 30),
SWE_SESSION_S (wall seconds of a CLI's whole session, 600). Where the task's dependencies live
outside /usr (a SWE-smith image's conda environment): SWE_SANDBOX_MOUNTS (host folders shown
read-only in every sandbox, `:`-separated) and SWE_SANDBOX_PATH (the sandboxes' PATH). Read at
each rollout.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from reins.agent import AgentContext, emit_event, report_reward, report_tool
from reins.sandbox import CommandResult, Mount, Sandbox, SandboxLimits
from reins.swe.cli_harness import CLI_NAMES, CliHarness
from reins.swe.environment import SandboxEnvironment
from reins.swe.hacks import HACK_EVENT, HackAttempt
from reins.swe.instances import Instance, RepoSource
from reins.swe.workspace import GIT_DISABLED, TestReport, Workspace

# Before mini-swe-agent and litellm are imported (they read these then): no first-run prompt, no
# price table download, no cost errors for a model name they do not know. A refused call is the
# proxy's answer, not a network blip: three tries, not ten.
for _name, _value in {
    "MSWEA_CONFIGURED": "true",
    "MSWEA_COST_TRACKING": "ignore_errors",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "3",
}.items():
    os.environ.setdefault(_name, _value)

# Imported here, not per rollout: the controller's zygote imports this module once and forks
# each attempt from it, so litellm's seconds of import are paid once.
from minisweagent import package_dir  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.models.litellm_model import LitellmModel  # noqa: E402

MODEL = "policy"  # the gateway routes every name to the model being trained
PATCH_EVENT = "patch"
SHOWN_PATCH_CHARS = 20_000


def _setting(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


@dataclass
class Episode:
    exit_status: str = ""
    commands: int = 0
    hacks: list[HackAttempt] = field(default_factory=list)
    patch: str = ""
    report: TestReport | None = None

    @property
    def submitted(self) -> bool:
        return self.exit_status == "Submitted"

    def metrics(self) -> dict[str, float]:
        return {
            "commands": self.commands,
            "submitted": int(self.submitted),
            "hack_attempts": len(self.hacks),
            "patch_lines": sum(
                1
                for line in self.patch.splitlines()
                if line[:1] in "+-" and not line.startswith(("+++", "---"))
            ),
        }


def task_of(task: dict[str, Any]) -> tuple[Instance, RepoSource]:
    """The instance and its repository from a task's input (`reins swe prepare` writes both)."""
    repo = task["repo_source"]
    source = RepoSource(
        repo=task["instance"]["repo"],
        source=Path(repo["source"]),
        test_command=repo["test_command"],
        test_paths=tuple(repo["test_paths"]),
    )
    return Instance.from_record(task["instance"], task["instance"]["instance_id"]), source


def mini_swe_agent(context: AgentContext, environment: SandboxEnvironment) -> Any:
    """mini-swe-agent's DefaultAgent with its `mini.yaml` templates and its litellm model."""
    config = yaml.safe_load((Path(package_dir) / "config" / "mini.yaml").read_text())
    agent_config = {**config["agent"], "step_limit": _setting("SWE_STEP_LIMIT", 8), "cost_limit": 0}
    model = LitellmModel(
        model_name=f"openai/{MODEL}",
        model_kwargs={
            "api_base": context.openai_base_url,
            "api_key": context.api_key,
            "max_tokens": _setting("SWE_MAX_TOKENS", 256),
            "timeout": 900,
        },
        cost_tracking="ignore_errors",
    )
    return DefaultAgent(model, environment, **agent_config)


def image_options() -> dict[str, Any]:
    """`Sandbox` keywords for the task's environment beyond /usr (SWE_SANDBOX_MOUNTS and
    SWE_SANDBOX_PATH): the agent's sandbox and the tests' get the same."""
    options: dict[str, Any] = {}
    folders = [f for f in os.environ.get("SWE_SANDBOX_MOUNTS", "").split(":") if f]
    if folders:
        options["mounts"] = [Mount(Path(folder)) for folder in folders]
    if os.environ.get("SWE_SANDBOX_PATH"):
        options["env"] = {"PATH": os.environ["SWE_SANDBOX_PATH"]}
    return options


def play(
    instance: Instance,
    repo: RepoSource,
    run_agent: Any,
    *,
    on_command: Any = None,
    limits: SandboxLimits | None = None,
    sandbox_options: dict[str, Any] | None = None,
) -> Episode:
    """One episode in a fresh temporary folder: checkout, `run_agent(environment)` (returns
    mini-swe-agent's exit status), the tests. The folder is removed after. `sandbox_options`:
    more `Sandbox` keywords (a CLI harness's mounts and gateway door)."""
    limits = limits or SandboxLimits(wall_s=_setting("SWE_COMMAND_S", 30), memory_mb=1024)
    episode = Episode()
    with tempfile.TemporaryDirectory(prefix="reins-swe-") as root:
        workspace = Workspace(Path(root), repo, instance.instance_id)
        work = workspace.checkout()
        image = image_options()
        options = {**image, **(sandbox_options or {})}
        options["mounts"] = [*image.get("mounts", []), *(sandbox_options or {}).get("mounts", [])]
        with Sandbox(work, limits, **GIT_DISABLED, **options) as sandbox:
            environment = SandboxEnvironment(sandbox, on_command=on_command)
            try:
                episode.exit_status = run_agent(environment)
            finally:
                episode.commands, episode.hacks = environment.commands, list(environment.hacks)
        # Closed: nothing the agent started still runs while its work is diffed and tested.
        episode.patch = workspace.diff()
        episode.report = workspace.evaluate(instance, sandbox_options=image)
    return episode


def run_mini_swe_agent(context: AgentContext, instance: Instance) -> Any:
    def run_agent(environment: SandboxEnvironment) -> str:
        agent = mini_swe_agent(context, environment)
        try:
            result = agent.run(instance.problem_statement)
        except Exception as error:  # litellm's ContextWindowExceededError and the like
            if "context" not in type(error).__name__.lower():
                raise  # the proxy unreachable after retries: the attempt fails (retried)
            return "ContextWindowExceeded"
        return str(result.get("exit_status", ""))

    return run_agent


CLI_LIMITS = SandboxLimits(wall_s=600, cpu_s=1200, memory_mb=2048, processes=256)
"""A CLI session's sandbox: the CLI and every command it runs share it (Claude Code alone is a
245 MB binary; Codex starts node and a Rust binary)."""


def play_cli(
    name: str, context: AgentContext, instance: Instance, repo: RepoSource, *, on_command: Any
) -> Episode:
    """One episode with Claude Code or Codex as the harness (`reins.swe.cli_harness`)."""
    if name not in CLI_NAMES:
        raise ValueError(f"SWE_HARNESS must be mini-swe-agent or one of {CLI_NAMES}, not {name!r}")
    session_s = _setting("SWE_SESSION_S", 600)
    with tempfile.TemporaryDirectory(prefix="reins-swe-cli-") as home:
        cli = CliHarness(
            name,
            context,
            Path(home),
            model=MODEL,
            max_tokens=_setting("SWE_MAX_TOKENS", 256),
        )
        try:

            def run_agent(environment: SandboxEnvironment) -> str:
                result = cli.run(
                    environment.sandbox, instance.problem_statement, timeout_s=session_s
                )
                for command, output, ok in cli.commands():
                    environment.record(command, CommandResult(0 if ok else 1, output, None, 0.0))
                for request in cli.door.refused:
                    hack = HackAttempt("gateway-api", request[:200])
                    environment.hacks.append(hack)
                    if on_command is not None:
                        on_command(f"(gateway request) {request}", _REFUSED, [hack])
                if result.limit is not None:
                    return f"stopped by the {result.limit} limit"
                if result.exit_code != 0:  # its stderr's end says why
                    return f"{name} exited {result.exit_code}: {result.output.strip()[-300:]}"
                return "Submitted"

            limits = dataclasses.replace(CLI_LIMITS, wall_s=session_s)
            return play(
                instance,
                repo,
                run_agent,
                on_command=on_command,
                limits=limits,
                sandbox_options=cli.sandbox_options(),
            )
        finally:
            cli.close()


_REFUSED = CommandResult(None, "refused by the sandbox's gateway door (403)", None, 0.0)


def post_command(command: str, result: CommandResult, hacks: list[HackAttempt]) -> None:
    report_tool("bash", {"command": command}, result.output, ok=result.ok, seconds=result.seconds)
    for hack in hacks:
        emit_event(
            HACK_EVENT, {"kind": hack.kind, "evidence": hack.evidence, "command": command[:2000]}
        )


def report(episode: Episode) -> None:
    emit_event(
        PATCH_EVENT, {"diff": episode.patch[:SHOWN_PATCH_CHARS], "chars": len(episode.patch)}
    )
    assert episode.report is not None
    reason = f"{episode.report.reason}; agent ended: {episode.exit_status or 'no exit status'}"
    if episode.hacks:
        kinds = sorted({hack.kind for hack in episode.hacks})
        reason += f"; attempted hacks (all blocked): {', '.join(kinds)}"
    report_reward(episode.report.reward, reason=reason, metrics=episode.metrics())


def run(task: dict[str, Any]) -> None:
    """The agent the controller runs (`examples.swe.agent:run`); it reports its own reward."""
    context = AgentContext.from_env()
    instance, repo = task_of(task)
    harness = os.environ.get("SWE_HARNESS", "mini-swe-agent")
    if harness == "mini-swe-agent":
        agent = run_mini_swe_agent(context, instance)
        episode = play(instance, repo, agent, on_command=post_command)
    else:
        episode = play_cli(harness, context, instance, repo, on_command=post_command)
    report(episode)
