"""Fixtures of the gateway tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.stub_engine import StubEngine


@pytest.fixture
def stub() -> Iterator[StubEngine]:
    """A vLLM-shaped stub engine on loopback (the model is stubbed: see tests/stub_engine.py)."""
    with StubEngine() as engine:
        yield engine
