"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright): log in,
the rollouts table and its live updates, a rollout page, a run page. Screenshots go to
$REINS_SCREENSHOT_DIR (`make screenshots` sets docs/screenshots), else to a temp folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import required
from tests.conftest import Gateway
from tests.monitor.factory import (
    coding_rollout,
    many_rollouts,
    proxied_rollout,
    write_run,
)
from tests.stub_engine import StubEngine

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.slow


@pytest.fixture(params=["sqlite"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The browser tests need one store: the store queries are tested on both elsewhere."""
    return f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"


@pytest.fixture
def browser_page() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        required.missing(
            "Debian's chromium is not installed: bash scripts/install-system-packages.sh"
        )
    sync_api = required.module("playwright.sync_api", "pip install -e '.[dev]'")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        yield page
        browser.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("REINS_SCREENSHOT_DIR") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_dashboard_in_chromium(
    gateway: Gateway, stub: StubEngine, runs_dir: Path, browser_page: Any, shots: Path
) -> None:
    page = browser_page
    many_rollouts(gateway, 26, run="demo", step=3)
    coding_rollout(gateway, "fix-bug-1", run="demo")
    proxied_rollout(gateway, stub.base_url, "proxied-1")
    write_run(runs_dir, "demo")

    page.goto(f"{gateway.url}/ui")
    assert "/ui/login" in page.url
    page.fill("input[name=key]", gateway.api_key)
    page.click("button[type=submit]")
    page.wait_for_selector("table.grid")
    assert page.locator("table.grid tbody tr").count() == 28
    page.screenshot(path=str(shots / "rollouts.png"))

    # Live: a rollout that finishes while the page is open shows up without a reload.
    many_rollouts(gateway, 1, run="late", step=9)
    page.wait_for_selector('a[href="/ui/rollouts/late-s9-r000"]', timeout=15_000)

    page.click('a[href="/ui/rollouts/fix-bug-1"]')
    page.wait_for_selector(".call")
    assert page.locator(".card.call").count() == 6
    assert page.locator(".boundary.split").count() == 2
    assert page.locator(".tokens .t0").count() > 0
    page.screenshot(path=str(shots / "rollout.png"), full_page=True)

    page.goto(f"{gateway.url}/ui/rollouts/proxied-1")
    assert page.locator(".card.call").count() == 3
    assert page.locator(".boundary.merge").count() == 1
    assert "Hello again!" in page.inner_text("main")
    page.screenshot(path=str(shots / "rollout-proxied.png"), full_page=True)

    page.goto(f"{gateway.url}/ui/runs/demo")
    page.wait_for_selector("svg.chart")
    assert page.locator("svg.chart").count() == 10
    page.screenshot(path=str(shots / "run.png"), full_page=True)
