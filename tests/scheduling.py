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
}

MEASURED_S = {
    # Test time per file in the full suite on 2 workers, 2026-12-01 (`--junitxml`, summed).
    "tests/doctor/test_named_doctor.py": 274,
    "tests/engine/test_token_reuse_vllm.py": 274,
    "tests/harness/test_cli_opencode.py": 226,
    "tests/engine/test_prefix_cache.py": 158,
    "tests/trainer/test_fsdp.py": 145,
    "tests/doctor/test_doctor_cli.py": 144,
    "tests/examples/test_examples_default_model.py": 141,
    "tests/harness/test_token_reuse.py": 125,
    "tests/engine/test_embedded.py": 125,
    "tests/engine/test_vllm_fleet.py": 125,
    "tests/engine/test_proxy_vllm.py": 121,
    "tests/trainer/test_fsdp_train.py": 115,
    "tests/gateway/test_fuzz.py": 108,
    "tests/engine/test_vllm_upstream.py": 108,
    "tests/trainer/test_sigkill.py": 80,
    "tests/trainer/test_loop.py": 120,
    "tests/harness/test_mini_swe_agent.py": 67,
    "tests/test_required.py": 60,
    "tests/harness/test_cli_claude.py": 56,
    "tests/test_makefile.py": 49,
    "tests/harness/test_anthropic_sdk.py": 45,
    "tests/gateway/test_crash.py": 45,
    "tests/engine/test_fidelity.py": 43,
    "tests/gateway/test_proxy.py": 42,
    "tests/controller/test_kubernetes.py": 50,
    "tests/examples/test_sandbox_agent.py": 40,
    # Added 2026-12-02, measured alone.
    "tests/swe/test_training.py": 140,
    "tests/swe/test_cli_harness.py": 5,
    "tests/swe/test_image_environment.py": 2,
    "tests/trainer/test_correction.py": 12,
    "tests/swe/test_prepare.py": 13,
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
