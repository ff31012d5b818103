"""mini-swe-agent (its default agent, its litellm tool-calling model and its `local`
environment, with the templates of its `mini.yaml` config) on a tiny task in a temp folder,
pointed at the gateway proxy in front of the embedded engine.

A 135M model does not solve the task; the check is that every call the agent made was recorded
with response tokens that decode to exactly what the agent received. A response without a valid
`bash` tool call is a format error to the agent: it keeps the raw response in the error message's
`extra.response`, and the test reads what it received from there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.conftest import Received, Rollout

pytestmark = pytest.mark.slow

STEP_LIMIT = 3


def received_by_agent(messages: list[dict[str, Any]]) -> list[Received]:
    """What each model call returned, in order, from the agent's trajectory."""
    received = []
    for message in messages:
        extra = message.get("extra") or {}
        if message.get("role") == "assistant":
            answer = message
        elif extra.get("interrupt_type") == "FormatError" and "response" in extra:
            answer = extra["response"]["choices"][0]["message"]
        else:
            continue
        calls = answer.get("tool_calls") or []
        if calls:
            pairs = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            received.append(Received.calls(answer.get("content"), pairs))
        else:
            received.append(Received.text(answer.get("content")))
    return received


def test_agent_on_a_tiny_task_in_a_local_folder(rollout: Rollout, tmp_path: Path) -> None:
    from minisweagent import package_dir
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    (tmp_path / "greeting.py").write_text('print("helo world")\n')
    config = yaml.safe_load((Path(package_dir) / "config" / "mini.yaml").read_text())
    agent_config = {**config["agent"], "step_limit": STEP_LIMIT, "cost_limit": 0}
    model = LitellmModel(
        model_name=f"openai/{rollout.model}",
        model_kwargs={
            "api_base": rollout.base_url,
            "api_key": rollout.token,
            "max_tokens": 48,
            "timeout": 300,
        },
        cost_tracking="ignore_errors",
    )
    agent = DefaultAgent(model, LocalEnvironment(cwd=str(tmp_path)), **agent_config)
    result = agent.run("greeting.py prints 'helo world'; make it print 'hello world'.")

    assert result["exit_status"] in {"LimitsExceeded", "RepeatedFormatError", "Submitted"}
    received = received_by_agent(agent.messages)
    assert 2 <= len(received) <= STEP_LIMIT, json.dumps(agent.messages, default=str)[:2000]
    rollout.assert_recorded_as_received(received)
    first_prompt = rollout.calls()[0]["request"]["messages"]
    assert "greeting.py" in first_prompt[1]["content"]
    assert [tool["function"]["name"] for tool in rollout.calls()[0]["request"]["tools"]] == ["bash"]
