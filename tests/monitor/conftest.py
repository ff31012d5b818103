"""Fixtures of the monitoring tests: a gateway that also knows a runs directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from reins.gateway import GatewaySettings
from tests.conftest import ADMIN_KEY
from tests.stub_engine import StubEngine


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "runs"
    folder.mkdir()
    return folder


@pytest.fixture
def gateway_settings(database_url: str, runs_dir: Path) -> GatewaySettings:
    return GatewaySettings(database_url=database_url, api_key=ADMIN_KEY, runs_dir=runs_dir)


@pytest.fixture
def stub() -> Iterator[StubEngine]:
    """A vLLM-shaped stub engine on loopback (the model is stubbed: see tests/stub_engine.py)."""
    with StubEngine() as engine:
        yield engine
