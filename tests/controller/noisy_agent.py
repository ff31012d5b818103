"""An agent module that prints when imported, as mini-swe-agent does (its version banner): the
zygote that preloads it must keep its own answers apart from that output."""

from __future__ import annotations

from typing import Any

print("This module prints a banner on stdout when it is imported.")


def succeed(task: dict[str, Any]) -> float:
    print("and the agent prints too")
    return 1.0
