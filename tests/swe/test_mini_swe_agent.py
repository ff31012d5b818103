"""The coding example's harness as it runs for real: mini-swe-agent 2.x (its DefaultAgent, its
litellm model, its `mini.yaml` templates) driving `reins.swe.environment.SandboxEnvironment`.
The model is stubbed: a scripted OpenAI-compatible server on 127.0.0.1 answers each call with
the next fixed `bash` tool call (no LLM, no gateway: the gateway's side of these calls is
covered by tests/harness/test_mini_swe_agent.py and the slow example test)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from examples.swe.agent import play, run_mini_swe_agent
from reins.agent import AgentContext
from reins.swe.instances import Instance, RepoSource
from tests.support import http_server
from tests.swe.conftest import by_id, needs_sandbox

SCRIPT = [
    "grep -n 'elif out' minilib/text.py",
    "sed -i 's/elif out:/elif out and out[-1] != \"-\":/' minilib/text.py",
    "git diff",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
]


@pytest.fixture
def scripted_model() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(base URL, requests received): each chat completion answers SCRIPT's next command."""
    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(body)
            command = SCRIPT[len(received) - 1]
            arguments = json.dumps({"command": command})
            call = {"id": f"call_{len(received)}", "type": "function",
                    "function": {"name": "bash", "arguments": arguments}}  # fmt: skip
            reply = {
                "id": f"c{len(received)}", "object": "chat.completion", "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                    "role": "assistant", "content": "Next step.", "tool_calls": [call]}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }  # fmt: skip
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    with http_server(Handler) as port:
        yield f"http://127.0.0.1:{port}/v1", received


def test_mini_swe_agent_fixes_a_task_in_the_sandbox_and_is_rewarded(
    scripted_model: tuple[str, list[dict[str, Any]]],
    shipped: tuple[list[Instance], dict[str, RepoSource]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    needs_sandbox()
    monkeypatch.setenv("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
    base_url, received = scripted_model
    instances, repos = shipped
    instance = by_id(instances, "func_pm_remove_cond__b3cb911e")
    context = AgentContext(base_url, "key", "http://unused", "r", 1, "val", None)
    commands: list[tuple[str, int | None, list[str]]] = []

    def on_command(command: str, result: Any, hacks: list[Any]) -> None:
        commands.append((command, result.exit_code, [h.kind for h in hacks]))

    episode = play(
        instance, repos[instance.repo], run_mini_swe_agent(context, instance), on_command=on_command
    )
    assert episode.exit_status == "Submitted"
    assert [(c, code) for c, code, _ in commands] == [
        (SCRIPT[0], 0), (SCRIPT[1], 0), (SCRIPT[2], 126), (SCRIPT[3], 0)
    ]  # fmt: skip
    assert [kinds for _, _, kinds in commands] == [[], [], ["git-history"], []]
    assert episode.report is not None and episode.report.reward == 1.0
    assert episode.metrics() == {
        "commands": 4, "submitted": 1, "hack_attempts": 1, "patch_lines": 2
    }  # fmt: skip
    # What the model was shown: mini.yaml's prompt with the problem statement, then each
    # command's output as mini-swe-agent renders it (git refused, in the sandbox).
    assert len(received) == 4 and received[0]["tools"][0]["function"]["name"] == "bash"
    first = received[0]["messages"]
    assert instance.problem_statement in first[1]["content"]
    last = received[3]["messages"][-1]
    assert last["role"] == "tool" and "git: disabled in this sandbox (reins)" in last["content"]
    assert "<returncode>126</returncode>" in last["content"]
    assert str(Path.home()) not in json.dumps(received)  # no host path in the prompt
