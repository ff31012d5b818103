"""How `make test` spreads test files over its pytest-xdist workers.

`--dist=loadfile` runs each file whole on one worker, so its module fixtures start once. Files
that share a session fixture too costly to start twice (a vLLM server: about a minute of both
cores) are one unit here, so they run on one worker and start it once.
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


class SharedFixtureScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        path = super()._split_scope(nodeid)
        return SHARED_UNITS.get(path, path)


def make_scheduler(config: Any, log: Any) -> LoadFileScheduling | None:
    if config.getvalue("dist") != "loadfile":
        return None
    return SharedFixtureScheduling(config, log)
