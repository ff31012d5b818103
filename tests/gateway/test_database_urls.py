"""`--db` URLs as SQLAlchemy's guides write them: the gateway serves each database through its
async driver, whichever driver the URL names."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from reins.gateway import GatewaySettings
from reins.gateway.settings import database_url
from tests.conftest import ADMIN_KEY, serve


@pytest.mark.parametrize(
    ("given", "served"),
    [
        ("postgresql+psycopg2://u:p@h:5433/db", "postgresql+asyncpg://u:p@h:5433/db"),
        ("postgresql+psycopg://u@h/db?sslmode=require", "postgresql+asyncpg://u@h/db?ssl=require"),
        ("postgres://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("sqlite+pysqlite:///g.db", "sqlite+aiosqlite:///g.db"),
        ("sqlite:////abs/g.db", "sqlite+aiosqlite:////abs/g.db"),
    ],
)
def test_a_blocking_drivers_url_is_served_through_the_async_driver(given: str, served: str) -> None:
    """`postgresql+psycopg2://...` ended `reins gateway` with a ModuleNotFoundError traceback,
    `sqlite+pysqlite:///...` with "The asyncio extension requires an async driver"."""
    assert database_url(given) == served


def test_a_sqlite_urls_home_folder_is_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sqlite:///~/g.db` made a folder named `~` in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert database_url("sqlite:///~/g.db") == f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    assert database_url("~/g.db") == f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"


def test_a_gateway_serves_a_pysqlite_url(tmp_path: Path) -> None:
    settings = GatewaySettings(
        database_url=f"sqlite+pysqlite:///{tmp_path / 'g.db'}", api_key=ADMIN_KEY
    )
    with serve(settings) as server:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        url = f"http://127.0.0.1:{server.port}"
        with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
            created = http.post("/api/rollouts", json=[{"rollout_id": "r"}])
            assert created.status_code == 200, created.text
    assert (tmp_path / "g.db").is_file()
