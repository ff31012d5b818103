"""How `make test` spreads test files over its pytest-xdist workers.

`--dist=loadfile` runs each file whole on one worker, so its module fixtures start once. Two
changes to its plan:

- Files that share a session fixture too costly to start twice (a vLLM server: about a minute
  of both cores) are one unit, so they run on one worker and start it once.
- Units go out longest first, by the seconds measured for each file (a file not listed counts
  1 s a test, about the mean of those). xdist's own order, most tests first, left a 78 s and an
  80 s file to start last and run alone at the end. The figures only order the queue: a stale
  one costs time, never a result.
"""

from __future__ import annotations

from collections import Counter
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
    "tests/doctor/test_doctor_cli.py": 144,
    "tests/examples/test_examples_default_model.py": 141,
    "tests/harness/test_token_reuse.py": 125,
    "tests/engine/test_embedded.py": 125,
    "tests/engine/test_vllm_fleet.py": 125,
    "tests/engine/test_proxy_vllm.py": 121,
    "tests/gateway/test_fuzz.py": 108,
    "tests/engine/test_vllm_upstream.py": 108,
    "tests/trainer/test_fsdp.py": 145,
    "tests/trainer/test_fsdp_train.py": 115,
    "tests/trainer/test_sigkill.py": 80,
    "tests/harness/test_mini_swe_agent.py": 67,
    "tests/test_required.py": 60,
    "tests/harness/test_cli_claude.py": 56,
    "tests/test_makefile.py": 49,
    "tests/harness/test_anthropic_sdk.py": 45,
    "tests/gateway/test_crash.py": 45,
    "tests/engine/test_fidelity.py": 43,
    "tests/gateway/test_proxy.py": 42,
    "tests/controller/test_kubernetes.py": 40,
    "tests/examples/test_sandbox_agent.py": 40,
}
SECONDS_PER_UNLISTED_TEST = 1


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_UNITS.get(path, path)


def longest_first(items: list[Any]) -> list[Any]:
    """`items` with whole units in decreasing expected time, each unit's tests in their order."""
    counts = Counter(item.nodeid.split("::", 1)[0] for item in items)
    expected: Counter[str] = Counter()
    for path, count in counts.items():
        expected[unit_of(path)] += MEASURED_S.get(path, SECONDS_PER_UNLISTED_TEST * count)
    return sorted(items, key=lambda item: -expected[unit_of(item.nodeid)])


class SharedFixtureScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)


def make_scheduler(config: Any, log: Any) -> LoadFileScheduling | None:
    if config.getvalue("dist") != "loadfile":
        return None
    # The queue keeps the collection's order, which `longest_first` set.
    config.option.loadscopereorder = False
    return SharedFixtureScheduling(config, log)
