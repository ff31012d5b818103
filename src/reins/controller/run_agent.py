"""`python -m reins.controller.run_agent module:function`: runs one `module:function` agent.

The controller starts this in a fresh interpreter with the agent's environment. The function is
called with the rollout's input (JSON-decoded); it may be sync or async. A number it returns is
posted as the attempt's `reward` event (`{"value": x, "source": "agent"}`); None means the agent
reported for itself. An exception prints its traceback (kept in the attempt's log) and exits 1,
which the controller counts as a crashed attempt; so does a returned number that is not finite
or that cannot be posted (the log says which). A SIGTERM (the controller stopping it) ends it
as `SystemExit`, so its `finally` clauses and `with` exits run.

Only a few standard modules are imported up front (asyncio only for an async agent), so this
costs little more than the interpreter's own start.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import os
import reprlib
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, cast


def main(argv: list[str]) -> int:
    if len(argv) != 1 or ":" not in argv[0]:
        print("usage: python -m reins.controller.run_agent module:function", file=sys.stderr)
        return 2
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the agent's module is found from its working directory
    function = load_agent(argv[0])
    if function is None:
        return 2
    return call_agent(argv[0], function)


def load_agent(agent: str) -> Callable[[Any], Any] | None:
    """Imports `module:function`; None (after saying why on stderr) when it cannot."""
    module_name, _, function_name = agent.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        print(
            f"reins: cannot load agent {agent!r}: {error!r}; the module must be importable "
            f"from {os.getcwd()} (or on PYTHONPATH) and define {function_name}",
            file=sys.stderr,
        )
        return None
    if not callable(function):
        print(f"reins: agent {agent!r} is not a function", file=sys.stderr)
        return None
    return cast("Callable[[Any], Any]", function)


def _end_on_sigterm(signum: int, _frame: object) -> None:
    # Python's own SIGTERM ends the process where it stands: an agent stopped by the controller
    # (a timeout, a cancelled rollout) never ran its `finally` clauses and `with` exits, and
    # left its temporary folders and sandboxes behind. As `SystemExit` (the status a shell
    # gives a SIGTERM) they run, within the controller's grace before its SIGKILL.
    raise SystemExit(128 + signum)


def call_agent(agent: str, function: Callable[[Any], Any]) -> int:
    """Runs one attempt in this process's environment; returns its exit status. A SIGTERM ends
    it as `SystemExit(143)`, its cleanup run (an agent may set a handler of its own)."""
    signal.signal(signal.SIGTERM, _end_on_sigterm)
    try:
        task = json.loads(os.environ["REINS_INPUT"])
    except KeyError:
        print(
            "reins: REINS_INPUT is not set; run agents through `reins controller`", file=sys.stderr
        )
        return 2
    except ValueError as error:
        print(f"reins: REINS_INPUT is not JSON: {error}", file=sys.stderr)
        return 2
    try:
        result = function(task)
        if hasattr(result, "__await__"):
            import asyncio  # only now: its import costs more than the rest of this runner

            result = asyncio.run(_await(result))
    except Exception:
        traceback.print_exc()
        return 1
    if result is None:
        return 0
    # Any real number: numpy's scalars (`np.float32`, `np.int64`: a reward summed or averaged
    # over numpy arrays) are `numbers.Real` without being Python floats or ints; a bool is no
    # reward.
    if isinstance(result, bool) or not isinstance(result, numbers.Real):
        print(
            f"reins: agent {agent} returned {type(result).__name__} {result!r}; return a "
            "number (the reward) or None (the agent reported its reward itself)",
            file=sys.stderr,
        )
        return 1
    try:
        reward = float(result)
    except OverflowError:  # an int past float's range
        reward = math.inf
    if not math.isfinite(reward):
        print(
            f"reins: agent {agent} returned {reprlib.repr(result)}, not a finite number: a "
            "reward must be one (no reward was posted)",
            file=sys.stderr,
        )
        return 1
    from reins.agent import AgentEnvError, ReportError, report_reward

    try:
        report_reward(reward, source="agent")
    except (ReportError, AgentEnvError) as error:
        print(
            f"reins: the reward {reward} agent {agent} returned was not posted: {error}",
            file=sys.stderr,
        )
        return 1
    return 0


async def _await(awaitable: object) -> object:
    return await awaitable  # type: ignore[misc]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
