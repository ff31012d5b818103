"""Shared by the coding-agent CLI tests (Claude Code, Codex CLI, OpenCode): a greedy gateway, the
CLIs' homes and few-shot sessions, a loopback-only runner, and the checks on what was recorded.

- **Gateway.** The session's embedded engine behind a gateway of its own whose `val` mode samples
  greedily (`temperature` 0, and at most `MAX_TOKENS` per call unless the CLI asks for fewer):
  every run is deterministic, and short.
- **Steering tool calls.** A 135M model does not call a tool on a CLI's system prompt alone, nor
  on instructions or examples written into it (tried: it echoes the prompt). It does copy a
  pattern of earlier turns: each CLI resumes a session written here, three turns in which the
  user asked "List the files." and the assistant ran `ls` through the CLI's own shell tool, saw
  the listing and answered "Done.". The session files are the CLIs' own formats (a Claude Code
  transcript, a Codex rollout, an OpenCode export imported with `opencode import`); each CLI
  sends the whole history with the new prompt, and the engine's own greedy answer is the tool
  call. Nothing on the engine or gateway side is scripted.
- **Offline.** Every CLI runs in a network namespace of its own (`netns.py`): only the gateway's
  port is reachable, and any DNS lookup or connection to ports 80/443 is logged; the tests assert
  there were none. Where namespaces are not allowed, runs go unisolated, kept offline only by the
  switches of `reins.agent.cli_home_env`, and the lookups are not checked.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from reins.agent import AgentContext, cli_home_env
from reins.doctor.harnesses.cli_sessions import claude_session as claude_session
from reins.doctor.harnesses.cli_sessions import codex_session as codex_session
from reins.doctor.harnesses.cli_sessions import opencode_session as opencode_session
from reins.doctor.harnesses.task import CLI_ANSWER, CLI_LISTINGS, CLI_PROMPT, OPENCODE_LISTINGS
from reins.engine.chat import parse_tool_calls
from reins.gateway import GatewaySettings
from reins.gateway.capture import SamplingPolicy
from tests.conftest import ADMIN_KEY
from tests.embedded_support import ServedEngine
from tests.harness import netns
from tests.harness.conftest import gateway_for, note_fidelity
from tests.required import missing

ROOT = Path(__file__).resolve().parents[2]
CLI_BIN = Path(os.environ.get("REINS_CLI_HARNESSES", ROOT / ".cache" / "cli-harnesses"))
CLI_BIN = CLI_BIN / "node_modules" / ".bin"
RUN_LIMIT_S = float(os.environ.get("REINS_CLI_RUN_LIMIT_S", "900"))
"""The time limit of one CLI run: a tool turn is two engine calls of 1-2k-token prompts, a few
seconds each on two idle cores, minutes when the cores are shared."""
MAX_TOKENS = 48
"""Most tokens one answer may have (`val` mode's cap): a tool call takes about 25."""

# The few-shot data and sessions are the doctor's named CLI harnesses' (one copy, in the package):
# OpenCode gets five turns, as its prompt names the test's folders and the date (with three the
# greedy choice between `<tool_call>` and `<tool_response>` flipped with them: margins 0.0-0.5;
# with five 2.4-2.6).
FEW_SHOT_PROMPT = CLI_PROMPT
FEW_SHOT_LISTINGS = CLI_LISTINGS
OPENCODE_FEW_SHOT_LISTINGS = OPENCODE_LISTINGS
FEW_SHOT_ANSWER = CLI_ANSWER
TOOL_PROMPT = FEW_SHOT_PROMPT
"""The prompt of the tool turns: the few-shot history's own question."""
TEXT_PROMPT = "Say hello."


def cli(name: str) -> Path:
    """The installed CLI `name` (claude, codex, opencode), or a skip (a failure under CI)."""
    path = CLI_BIN / name
    if not path.exists():
        missing(f"{path} is missing: `make cli-harnesses` installs the coding-agent CLIs")
    return path


# --- the gateway and the rollouts --------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One model answer: its text and its tool calls as (name, parsed arguments)."""

    text: str
    tool_calls: tuple[tuple[str, Any], ...] = ()


@dataclass
class CliRollout:
    """A `val` rollout attempt on the CLI gateway and the agent context a CLI runs with."""

    context: AgentContext
    engine: ServedEngine
    port: int

    @property
    def model(self) -> str:
        return self.engine.name

    def calls(self) -> list[dict[str, Any]]:
        """The `model_request` events' data, in call order."""
        response = httpx.get(
            f"{self.context.gateway_url}/api/rollouts/{self.context.rollout_id}/events",
            params={"type": "model_request"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=30,
        )
        response.raise_for_status()
        return [event["data"] for event in response.json()]

    def checked_calls(self, kind: str) -> list[Answer]:
        """Every call was recorded as `kind`, succeeded, and has its tokens and logprobs; its
        response token IDs decode to exactly the recorded answer. Returns the answers."""
        calls = self.calls()
        assert calls, "no model call was recorded"
        answers = []
        for number, call in enumerate(calls, start=1):
            where = f"call {number} of {len(calls)}"
            assert call["status"] == 200, f"{where}: {call.get('error')}"
            assert call.get("kind") == kind, f"{where} is {call.get('kind')}, not {kind}"
            assert call["error"] is None, f"{where}: {call['error']}"
            assert call["prompt_token_ids"], f"{where} has no prompt token IDs"
            tokens, logprobs = call["response_token_ids"], call["response_logprobs"]
            assert tokens, f"{where} has no response token IDs"
            assert logprobs is not None and len(logprobs) == len(tokens), where
            assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs), f"{where}: {logprobs}"
            assert call["model_version"] == self.engine.engine.weight_version, where
            answer = recorded_answer(kind, call["response"])
            assert decoded_answer(self.engine, tokens) == answer, where
            answers.append(answer)
        return answers


def recorded_answer(kind: str, response: dict[str, Any]) -> Answer:
    """The text and tool calls of a recorded answer, in the shape of its wire API."""
    texts: list[str] = []
    calls: list[tuple[str, Any]] = []
    if kind == "messages":
        for block in response["content"]:
            if block["type"] == "text":
                texts.append(block["text"])
            elif block["type"] == "tool_use":
                calls.append((block["name"], block["input"]))
    elif kind == "responses":
        for item in response["output"]:
            if item["type"] == "message":
                texts += [part["text"] for part in item["content"] if part["type"] == "output_text"]
            elif item["type"] == "function_call":
                calls.append((item["name"], json.loads(item["arguments"])))
    elif kind == "chat":
        message = response["choices"][0]["message"]
        texts.append(message.get("content") or "")
        for call in message.get("tool_calls") or ():
            calls.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return Answer("".join(texts), tuple(calls))


def history_tool_calls(kind: str, request: dict[str, Any]) -> int:
    """How many earlier tool calls a recorded request carries (the few-shot turns)."""
    if kind == "messages":
        blocks = [
            b for m in request["messages"] if isinstance(m["content"], list) for b in m["content"]
        ]
        return sum(block.get("type") == "tool_use" for block in blocks)
    if kind == "responses":
        return sum(item.get("type") == "function_call" for item in request["input"])
    return sum(len(message.get("tool_calls") or ()) for message in request["messages"])


def decoded_answer(engine: ServedEngine, token_ids: list[int]) -> Answer:
    """What the sampled tokens say: their text, or the tool calls parsed out of it (the text
    around the calls stripped, as every wire API drops whitespace-only text)."""
    text = engine.engine.decode(token_ids)
    content, calls = parse_tool_calls(text)
    if not calls:
        return Answer(text)
    parsed = tuple((c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls)
    return Answer(content or "", parsed)


@dataclass
class CliGateway:
    url: str
    port: int
    engine: ServedEngine

    def open_rollout(self) -> CliRollout:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        rollout_id = f"cli-{uuid.uuid4().hex[:12]}"
        httpx.post(
            f"{self.url}/api/rollouts",
            json=[{"rollout_id": rollout_id, "mode": "val"}],
            headers=admin,
        ).raise_for_status()
        attempt = httpx.post(f"{self.url}/api/rollouts/{rollout_id}/attempts", headers=admin)
        attempt.raise_for_status()
        context = AgentContext(
            openai_base_url=(f"{self.url}/proxy/rollout/{rollout_id}/attempt/1/mode/val/openai/v1"),
            api_key=attempt.json()["token"],
            gateway_url=self.url,
            rollout_id=rollout_id,
            attempt_id=1,
            mode="val",
            input=None,
        )
        return CliRollout(context, self.engine, self.port)


@contextlib.contextmanager
def cli_gateway(engine: ServedEngine, folder: Path) -> Iterator[CliGateway]:
    """A gateway (SQLite in `folder`) in front of `engine`, sampling `val` calls greedily."""
    greedy = SamplingPolicy(
        set={"temperature": 0.0, "max_tokens": MAX_TOKENS}, keep_harness=["max_tokens"]
    )
    settings = GatewaySettings(
        database_url=str(folder / "gateway.db"), api_key=ADMIN_KEY, val_sampling=greedy
    )
    with gateway_for(settings, engine) as (url, port):
        yield CliGateway(url, port, engine)


# --- running a CLI -------------------------------------------------------------------------------


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    outbound: list[dict[str, Any]] = field(default_factory=list)
    """DNS lookups and web connections the CLI tried (empty when not isolated: not checked)."""

    def json_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]

    def check(self) -> None:
        assert self.returncode == 0, f"exit {self.returncode}\n{self.stderr[-3000:]}"
        assert self.outbound == [], f"calls beyond the proxy: {self.outbound}"


def cli_env(rollout: CliRollout, home: Path, **extra: str) -> dict[str, str]:
    """A CLI's whole environment: the controller's contract for this rollout, a home of its
    own with every outbound switch off (`reins.agent.cli_home_env`), and `extra`."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    return {**base, **rollout.context.env(), **cli_home_env(home), **extra}


def run_cli(
    argv: Sequence[str | Path], *, env: dict[str, str], cwd: Path, port: int, scratch: Path
) -> CliRun:
    """Runs `argv` with its stdin closed and a time limit of `RUN_LIMIT_S`, in a network
    namespace of its own where only the gateway's `port` is reachable (when allowed)."""
    command = [str(part) for part in argv]
    started = time.monotonic()
    if not netns.available():
        try:
            done = subprocess.run(
                command,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=RUN_LIMIT_S,
            )
        except subprocess.TimeoutExpired as error:
            raise AssertionError(f"{command[0]} ran past {RUN_LIMIT_S} s") from error
        return CliRun(done.returncode, done.stdout, done.stderr, time.monotonic() - started)
    socket_path = scratch / f"gw-{uuid.uuid4().hex[:8]}.sock"
    log = scratch / f"outbound-{uuid.uuid4().hex[:8]}.json"
    bridge = netns.LoopbackBridge(socket_path, port)
    try:
        wrapped = netns.command(
            command, port=port, socket_path=socket_path, log=log, cwd=cwd, timeout_s=RUN_LIMIT_S
        )
        done = subprocess.run(
            wrapped,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_LIMIT_S + 60,
        )
    finally:
        bridge.close()
    seconds = time.monotonic() - started
    assert done.returncode != netns.TIMED_OUT, f"{command[0]} ran past {RUN_LIMIT_S} s"
    outbound = json.loads(log.read_text()) if log.exists() else [{"missing log": str(log)}]
    return CliRun(done.returncode, done.stdout, done.stderr, seconds, outbound)


def workspace(root: Path) -> Path:
    """The folder a CLI works in: one small file, so `ls` has something to show."""
    folder = root / "work"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("reins\n")
    return folder


def report(name: str, run: CliRun, rollout: CliRollout) -> None:
    """One line per run in the test output (`pytest -s`): time, and prompt/answer tokens."""
    isolation = "loopback only" if netns.available() else "not isolated"
    tokens = [
        f"{len(c['prompt_token_ids'])}+{len(c['response_token_ids'])}" for c in rollout.calls()
    ]
    print(f"[{name}] {run.seconds:.1f} s, calls (prompt+answer tokens) {tokens}, {isolation}")
    calls = rollout.calls()
    note_fidelity(str(calls[0].get("kind")) if calls else "?", calls, rollout.engine)
