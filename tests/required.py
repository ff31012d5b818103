"""Skips for a missing dependency that fail under CI.

Locally, a test whose dependency (a package, a model folder, a system binary) is missing skips,
with a message saying how to get it. Under CI (the `CI` environment variable set, as CI systems
set it) every tier must run, so the same test fails instead of passing unseen; the PostgreSQL,
vLLM and Kubernetes fixtures work the same way.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def missing(message: str) -> NoReturn:
    """Skip with `message`; under CI, fail with it."""
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set, so a missing dependency is a failure)")
    pytest.skip(message)


def module(name: str, how: str) -> ModuleType:
    """The module `name`, or `missing` (`how`: how to install it)."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        missing(f"{name} cannot be imported ({error}): {how}")
