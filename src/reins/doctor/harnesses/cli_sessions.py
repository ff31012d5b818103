"""Few-shot sessions in each coding-agent CLI's own format, so that a CLI resumes a conversation
in which it answered `task.CLI_PROMPT` by running `ls` (its own shell tool) a few times: the
small default model then calls the tool too. Each writer puts the session where its CLI looks
for it and returns the id to resume. The formats are the ones of the versions
`reins.agent.CLI_VERSIONS` names (the harness tests check them against the real CLIs)."""

from __future__ import annotations

import json
import random
import string
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from reins.agent import CLI_VERSIONS
from reins.doctor.harnesses.task import CLI_ANSWER, CLI_LISTINGS, CLI_PROMPT, OPENCODE_LISTINGS


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _jsonl(lines: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(line) + "\n" for line in lines)


def claude_session(home: Path, cwd: Path, model: str) -> str:
    """A Claude Code transcript (its `Bash` tool) for `--resume`, under
    `~/.claude/projects/<cwd with every non-alphanumeric character as ->`."""
    session = str(uuid.uuid4())
    slug = "".join(c if c.isalnum() else "-" for c in str(cwd))
    folder = home / ".claude" / "projects" / slug
    folder.mkdir(parents=True, exist_ok=True)
    lines: list[dict[str, Any]] = []

    def add(kind: str, message: dict[str, Any]) -> None:
        lines.append(
            {
                "parentUuid": lines[-1]["uuid"] if lines else None,
                "isSidechain": False,
                "type": kind,
                "message": message,
                "uuid": str(uuid.uuid4()),
                "timestamp": _now(),
                "userType": "external",
                "entrypoint": "sdk-cli",
                "cwd": str(cwd),
                "sessionId": session,
                "version": CLI_VERSIONS["@anthropic-ai/claude-code"],
            }
        )

    def said(content: list[dict[str, Any]], stop: str) -> dict[str, Any]:
        return {
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }

    for listing in CLI_LISTINGS:
        call = f"toolu_{uuid.uuid4().hex[:24]}"
        add("user", {"role": "user", "content": CLI_PROMPT})
        use = {"type": "tool_use", "id": call, "name": "Bash", "input": {"command": "ls"}}
        add("assistant", said([use], "tool_use"))
        result = {"type": "tool_result", "tool_use_id": call, "content": listing}
        add("user", {"role": "user", "content": [{**result, "is_error": False}]})
        add("assistant", said([{"type": "text", "text": CLI_ANSWER}], "end_turn"))
    (folder / f"{session}.jsonl").write_text(_jsonl(lines))
    return session


def codex_session(codex_home: Path, cwd: Path, model: str) -> str:
    """A Codex rollout (its `exec_command` tool) for `codex exec resume`: Responses API input
    items, as Codex re-sends them, under `CODEX_HOME/sessions/YYYY/MM/DD`."""
    thread = str(uuid.uuid4())
    stamp = datetime.now(UTC)
    folder = codex_home / "sessions" / stamp.strftime("%Y/%m/%d")
    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "id": thread,
        "timestamp": _now(),
        "cwd": str(cwd),
        "originator": "codex_exec",
        "cli_version": CLI_VERSIONS["@openai/codex"],
        "source": "exec",
        "model_provider": "local",
    }
    # A resumed thread takes its multi-agent mode from the last turn context, not from the
    # config: without it Codex adds its 12k-character multi-agent tool on resume.
    turn = {
        "turn_id": str(uuid.uuid4()),
        "cwd": str(cwd),
        "approval_policy": "never",
        "sandbox_policy": {"type": "read-only"},
        "model": model,
        "summary": "none",
        "multi_agent_version": "disabled",
    }
    lines: list[dict[str, Any]] = [
        {"timestamp": _now(), "type": "session_meta", "payload": meta},
        {"timestamp": _now(), "type": "turn_context", "payload": turn},
    ]

    def item(payload: dict[str, Any]) -> None:
        lines.append({"timestamp": _now(), "type": "response_item", "payload": payload})

    for listing in CLI_LISTINGS:
        call = f"call_{uuid.uuid4().hex[:24]}"
        item({"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": CLI_PROMPT}]})  # fmt: skip
        item({"type": "function_call", "name": "exec_command",
              "arguments": json.dumps({"cmd": "ls"}), "call_id": call})  # fmt: skip
        output = f"Process exited with code 0\nOutput:\n{listing}\n"
        item({"type": "function_call_output", "call_id": call, "output": output})
        answer = {"type": "output_text", "text": CLI_ANSWER}
        item({"type": "message", "role": "assistant", "content": [answer]})
    name = f"rollout-{stamp.strftime('%Y-%m-%dT%H-%M-%S')}-{thread}.jsonl"
    (folder / name).write_text(_jsonl(lines))
    return thread


def opencode_session(cwd: Path, model: str) -> tuple[str, dict[str, Any]]:
    """An OpenCode session export (its `bash` tool) for `opencode import`, then `opencode run
    --session`; its id and the export. OpenCode orders messages by their ids, which start with
    the creation time (ms x 4096 + a counter, 12 hex digits): these are a minute old, so the
    resumed turn sorts after them. OpenCode wraps a `run` prompt in quotes: so are these."""
    counter = iter(range(1, 1 << 12))
    alphabet = string.ascii_letters + string.digits

    def ident(prefix: str, ms: int) -> str:
        tail = "".join(random.choice(alphabet) for _ in range(14))
        return f"{prefix}_{ms * 0x1000 + next(counter):012x}{tail}"

    ms = int(time.time() * 1000) - 60_000
    session = ident("ses", ms)
    who = {"providerID": "local", "modelID": model}
    messages: list[dict[str, Any]] = []

    def message(info: dict[str, Any], part: dict[str, Any]) -> None:
        nonlocal ms
        ms += 1000
        info = {**info, "id": ident("msg", ms), "sessionID": session}
        done = info["role"] == "assistant"
        info["time"] = {"created": ms, "completed": ms + 10} if done else {"created": ms}
        part = {**part, "id": ident("prt", ms), "sessionID": session, "messageID": info["id"]}
        messages.append({"info": info, "parts": [part]})

    for listing in OPENCODE_LISTINGS:
        message(
            {"role": "user", "agent": "build", "model": who},
            {"type": "text", "text": json.dumps(CLI_PROMPT)},
        )
        reply = {
            "parentID": messages[-1]["info"]["id"],
            "role": "assistant",
            "mode": "build",
            "agent": "build",
            "path": {"cwd": str(cwd), "root": str(cwd)},
            "cost": 0,
            "tokens": {"input": 0, "output": 0, "reasoning": 0, "cache": {"read": 0, "write": 0}},
            **who,
        }
        state = {
            "status": "completed",
            "input": {"command": "ls"},
            "output": listing,
            "metadata": {"output": listing, "exit": 0, "truncated": False},
            "title": "ls",
            "time": {"start": ms, "end": ms + 5},
        }
        call = f"call_{uuid.uuid4().hex[:24]}"
        message(
            {**reply, "finish": "tool-calls"},
            {"type": "tool", "tool": "bash", "callID": call, "state": state},
        )
        message({**reply, "finish": "stop"}, {"type": "text", "text": CLI_ANSWER})
    info = {
        "id": session,
        "slug": "few-shot",
        "projectID": "global",
        "directory": str(cwd),
        "title": "few-shot",
        "version": CLI_VERSIONS["opencode-ai"],
        "time": {"created": ms - 10_000, "updated": ms},
    }
    return session, {"info": info, "messages": messages}
