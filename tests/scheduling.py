"""How `make test` spreads test files over its pytest-xdist workers.

`--dist=loadfile` runs each file whole on one worker, so its module fixtures start once. Two
changes to its plan:

- Files that share a session fixture too costly to start twice (a vLLM server: about a minute
  of both cores) are one unit, so they run on one worker and start it once.
- Units go out longest first, by the seconds measured for each file (a file not listed counts
  1 s a test, about the mean of those). xdist's own order, most tests first, can leave a
  four-minute file to start last and run alone at the end. The figures only order the queue: a
  stale one costs time, never a result.

The order is set in the controller's queue only: each worker's collection keeps its order (the
controller sends tests as indexes into it).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from xdist.scheduler import LoadFileScheduling

SHARED_UNITS = {
    # tests/engine/conftest.py's `vllm_server`.
    "tests/engine/test_vllm_upstream.py": "vllm-server",
    "tests/engine/test_proxy_vllm.py": "vllm-server",
    "tests/engine/test_vllm_fleet.py": "vllm-server",
    "tests/engine/test_token_reuse_vllm.py": "vllm-server",
}

MEASURED_S = {
    # Test time per file in the full suite on 2 workers, 2026-12-02 (`--junitxml`, summed; the
    # files of 20 s and more).
    "tests/engine/test_token_reuse_vllm.py": 332,
    "tests/swe/test_training.py": 205,
    "tests/engine/test_vllm_fleet.py": 193,
    "tests/harness/test_cli_opencode.py": 186,
    "tests/doctor/test_named_doctor.py": 170,
    "tests/engine/test_proxy_vllm.py": 156,
    "tests/engine/test_prefix_cache.py": 138,
    "tests/trainer/test_fsdp.py": 119,
    "tests/doctor/test_doctor_cli.py": 111,
    "tests/trainer/test_fsdp_train.py": 111,
    "tests/engine/test_embedded.py": 108,
    "tests/gateway/test_fuzz.py": 104,
    "tests/examples/test_examples_default_model.py": 86,
    "tests/harness/test_token_reuse.py": 82,
    "tests/test_required.py": 57,
    "tests/trainer/test_loop.py": 55,
    "tests/gateway/test_proxy.py": 51,
    "tests/test_makefile.py": 46,
    "tests/controller/test_scale.py": 45,
    "tests/harness/test_anthropic_sdk.py": 45,
    "tests/harness/test_openai_responses.py": 43,
    "tests/trainer/test_sigkill.py": 42,
    "tests/harness/test_mini_swe_agent.py": 40,
    "tests/harness/test_openai_sdk.py": 39,
    "tests/harness/test_cli_claude.py": 37,
    "tests/gateway/test_replicas.py": 35,
    "tests/gateway/test_rollouts.py": 35,
    "tests/trainer/test_fleet.py": 35,
    "tests/trainer/test_publish.py": 33,
    "tests/controller/test_kubernetes.py": 32,
    "tests/faults/test_load.py": 32,
    "tests/gateway/test_proxy_guards.py": 31,
    "tests/controller/test_local.py": 31,
    "tests/gateway/test_auth_before_body.py": 30,
    "tests/faults/test_postgres_restart.py": 30,
    "tests/monitor/test_dashboard.py": 30,
    "tests/engine/test_vllm_upstream.py": 29,
    "tests/harness/test_pydantic_ai.py": 28,
    "tests/trainer/test_resume.py": 26,
    "tests/gateway/test_crash.py": 26,
    "tests/examples/test_sandbox_agent.py": 26,
    "tests/gateway/test_auth.py": 25,
    "tests/monitor/test_export_report.py": 25,
    "tests/trainer/test_memory.py": 24,
    "tests/gateway/test_json_rule.py": 24,
    "tests/engine/test_fidelity.py": 24,
    "tests/test_packed.py": 22,
    "tests/gateway/test_abandoned_calls.py": 22,
    "tests/faults/test_network_cuts.py": 22,
    "tests/swe/test_prepare.py": 21,
    "tests/gateway/test_admission.py": 21,
    "tests/harness/test_openai_agents.py": 20,
    "tests/trainer/test_distributed.py": 20,
    "tests/gateway/test_attempts_events.py": 20,
}
SECONDS_PER_UNLISTED_TEST = 1


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_UNITS.get(path, path)


def expected_seconds(nodeids: list[str]) -> float:
    """A unit's expected time: the measured seconds of its files, or 1 s a test."""
    per_file: dict[str, int] = {}
    for nodeid in nodeids:
        path = nodeid.split("::", 1)[0]
        per_file[path] = per_file.get(path, 0) + 1
    return sum(MEASURED_S.get(path, SECONDS_PER_UNLISTED_TEST * n) for path, n in per_file.items())


class SharedFixtureScheduling(LoadFileScheduling):
    _ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        if not self._ordered:  # the queue is complete once the first unit goes out
            self._ordered = True
            units = self.workqueue.items()
            longest = sorted(units, key=lambda unit: -expected_seconds(list(unit[1])))
            self.workqueue = OrderedDict(longest)
        super()._assign_work_unit(node)


def make_scheduler(config: Any, log: Any) -> LoadFileScheduling | None:
    if config.getvalue("dist") != "loadfile":
        return None
    return SharedFixtureScheduling(config, log)
