"""`reins doctor mini-swe-agent`: mini-swe-agent's default agent with its litellm tool-calling
model and its `local` environment (the templates of its `mini.yaml`), on a tiny task in a
temporary folder (fix a typo in `greeting.py`), `turns()` steps at most. It leaves a rejected
(malformed) answer out of its history: expect `dropped` splits, which are not an error."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from reins.doctor.harnesses import task

TASK = "greeting.py prints 'helo world'; make it print 'hello world'."


def main() -> None:
    os.environ.setdefault("MSWEA_CONFIGURED", "true")
    os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    minisweagent = task.require("minisweagent", "mini-swe-agent")
    yaml = task.require("yaml", "PyYAML")
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    config = yaml.safe_load((Path(minisweagent.package_dir) / "config" / "mini.yaml").read_text())
    agent_config = {**config["agent"], "step_limit": task.turns(), "cost_limit": 0}
    model = LitellmModel(
        model_name=f"openai/{task.MODEL}",
        model_kwargs={
            "api_base": task.env("OPENAI_BASE_URL"),
            "api_key": task.env("OPENAI_API_KEY"),
            "max_tokens": 48,
            "timeout": task.TIMEOUT_S,
        },
        cost_tracking="ignore_errors",
    )
    with tempfile.TemporaryDirectory(prefix="reins-doctor-mini-") as folder:
        (Path(folder) / "greeting.py").write_text('print("helo world")\n')
        agent = DefaultAgent(model, LocalEnvironment(cwd=folder), **agent_config)
        result = agent.run(TASK)
    print(f"exit status: {result.get('exit_status')}", flush=True)


if __name__ == "__main__":
    main()
