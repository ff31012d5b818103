"""How `make test` spreads test files over its pytest-xdist workers.

`--dist=loadfile` runs each file whole on one worker, so its module fixtures start once. Files
that share a session fixture too costly to start twice (a vLLM server: about a minute of both
cores) are one unit here, so they run on one worker and start it once. (Ordering units longest
first by measured seconds was tried and is not in: not measured on a full run yet.)
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling

SHARED_UNITS = {
    # tests/engine/conftest.py's `vllm_server`.
    "tests/engine/test_vllm_upstream.py": "vllm-server",
    "tests/engine/test_proxy_vllm.py": "vllm-server",
    "tests/engine/test_vllm_fleet.py": "vllm-server",
}


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_UNITS.get(path, path)


class SharedFixtureScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)


def make_scheduler(config: Any, log: Any) -> LoadFileScheduling | None:
    if config.getvalue("dist") != "loadfile":
        return None
    return SharedFixtureScheduling(config, log)
