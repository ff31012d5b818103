"""Schema fuzzing: schemathesis generates requests from the OpenAPI schema; no answer is a 5xx.

40 examples an operation on SQLite, 30 on PostgreSQL (CI's time: 60 took ~57 s each): the
routes' validation is the same code on both, what differs is what each database refuses
(PostgreSQL's own 5xx sources, "\\u0000" in text, integer ranges)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from reins.gateway import GatewaySettings
from tests.conftest import ADMIN_KEY, serve

pytestmark = pytest.mark.slow

EXAMPLES = {"sqlite": 40, "postgresql": 30}


def test_schemathesis_finds_no_server_error(database_url: str, tmp_path: Path) -> None:
    settings = GatewaySettings(database_url=database_url, api_key=ADMIN_KEY)
    with serve(settings) as server:
        url = f"http://127.0.0.1:{server.port}"
        result = subprocess.run(
            [
                str(Path(sys.executable).parent / "schemathesis"),
                "run",
                f"{url}/openapi.json",
                "--checks",
                "not_a_server_error",
                "--header",
                f"Authorization: Bearer {ADMIN_KEY}",
                "--max-examples",
                str(EXAMPLES["sqlite" if database_url.startswith("sqlite") else "postgresql"]),
                "--seed",
                "1",
                "--generation-database",
                "none",
                "--report-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
