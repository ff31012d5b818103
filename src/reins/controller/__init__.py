"""The Rollout Controller (paper appendix A.2): reconciles the gateway's rollouts with agents.

`Controller` is the loop; a `Reconciler` runs the agents: `LocalReconciler` (a local process
pool, `local.py`) or `KubernetesReconciler` (Jobs, `kubernetes.py`).

Names are imported on first use, so that `python -m reins.controller.run_agent`, which starts
once per agent, does not pay for the client, pydantic or the Kubernetes library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reins.controller.kubernetes import KubernetesReconciler
    from reins.controller.local import LocalReconciler
    from reins.controller.loop import (
        AgentLog,
        Controller,
        ControllerStats,
        Ended,
        Launch,
        LaunchError,
        Reconciler,
    )

__all__ = [
    "AgentLog",
    "Controller",
    "ControllerStats",
    "Ended",
    "KubernetesReconciler",
    "Launch",
    "LaunchError",
    "LocalReconciler",
    "Reconciler",
]

_WHERE = {
    "KubernetesReconciler": "reins.controller.kubernetes",
    "LocalReconciler": "reins.controller.local",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'reins.controller' has no attribute {name!r}")
    module = importlib.import_module(_WHERE.get(name, "reins.controller.loop"))
    return getattr(module, name)
