"""Disk full under the SQLite store: writes fail with a clear error, nothing acknowledged is lost,
and the gateway takes writes again once space returns, without a restart.

Real: the `reins gateway` process, its SQLite file on a real 4 MiB tmpfs (ENOSPC from the
kernel, not simulated), raw HTTP posts and a proxied LLM call. STUBBED: the engine's model
(tests/stub_engine.py), for the one proxied call. Mounting needs root (or passwordless
`sudo`, as CI machines have); where neither is there the test skips, and fails under CI (the
`CI` variable), where the fault suite must run. `RLIMIT_FSIZE` is no substitute: it raises EFBIG
(and SIGXFSZ), a different error on a different path than a full disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from reins.schemas import MODEL_REQUEST
from tests.faults.conftest import ADMIN_KEY, StubProcess, admin, open_rollouts
from tests.required import missing
from tests.support import GatewayProcess, free_port

pytestmark = pytest.mark.slow

BLOB = "x" * 20_000
"""Each event's payload: a full disk is reached in a few dozen posts."""


def _as_root(args: list[str]) -> subprocess.CompletedProcess[str]:
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
    return subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted at a temp dir; unmounted after the test. (A new gateway database
    takes ~1.6 MB in 64 KB pages and its WAL up to ~4 MB between checkpoints.)"""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    try:
        mounted = _as_root(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)])
    except FileNotFoundError as error:  # no sudo at all
        missing(f"cannot mount a small tmpfs for the disk-full test: {error}")
    if mounted.returncode != 0:
        missing(f"cannot mount a small tmpfs for the disk-full test: {mounted.stderr.strip()}")
    try:
        if os.geteuid() != 0:
            _as_root(["chown", str(os.geteuid()), str(mount_point)])
        yield mount_point
    finally:
        _as_root(["umount", "-l", str(mount_point)])


def _fill(disk: Path) -> Path:
    """Writes a file until the kernel says ENOSPC; returns it."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as file:
        try:
            while True:
                file.write(b"\0" * 65536)

        except OSError as error:
            assert error.errno == errno.ENOSPC, error
    with contextlib.suppress(OSError), filler.open("ab", buffering=0) as file:  # last page
        while True:
            file.write(b"\0")
            file.flush()
    return filler


def _post(client: httpx.Client, rid: str, key: str) -> httpx.Response:
    body = [{"type": "note", "data": {"blob": BLOB}, "idempotency_key": key}]
    return client.post(f"/api/rollouts/{rid}/attempt/1/events", json=body)


def test_a_full_disk_fails_writes_clearly_keeps_acknowledged_ones_and_recovers(
    small_disk: Path, stub_process: StubProcess
) -> None:
    url = f"sqlite+aiosqlite:///{small_disk / 'gateway.db'}"
    gateway = GatewayProcess(database_url=url, api_key=ADMIN_KEY, port=free_port())
    gateway.start()
    try:
        http = admin(gateway.url)
        token = open_rollouts(http, ["full"])["full"]
        harness = httpx.Client(
            base_url=gateway.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
        acked: list[str] = []
        for _ in range(10):
            key = uuid.uuid4().hex
            assert _post(harness, "full", key).status_code == 200
            acked.append(key)
        http.post("/api/models", json={"model": "policy", "endpoint": stub_process.base_url})
        filler = _fill(small_disk)

        refused: httpx.Response | None = None
        for _ in range(500):
            key = uuid.uuid4().hex
            answer = _post(harness, "full", key)
            if answer.status_code != 200:
                refused = answer
                break
            acked.append(key)
        assert refused is not None, "500 posts of 20 kB fitted on a full 4 MiB disk"
        print(
            f"disk full: {len(acked)} posts acknowledged, then {refused.status_code}: "
            f"{refused.json()['error']}"
        )
        assert refused.status_code == 507, refused.text
        assert "disk is full" in refused.json()["error"], refused.text
        # A harness's LLM call: answered while the disk holds its record (a write refused
        # once can fit later: SQLite writes its WAL from the start again after a checkpoint),
        # refused the same way, in its API's shape, once the disk does not.
        answered = 0
        for _ in range(100):
            call = harness.post(
                "/proxy/rollout/full/attempt/1/mode/train/openai/v1/chat/completions",
                json={"model": "policy", "messages": [{"role": "user", "content": BLOB}]},
            )
            if call.status_code != 200:
                break
            answered += 1
        print(f"disk full: {answered} calls answered, then {call.status_code}")
        assert call.status_code == 507, call.text
        assert "disk is full" in call.json()["error"]["message"], call.text
        # Reads still answer, and hold every acknowledged event and answered call once.
        stored = http.get("/api/rollouts/full/events").json()
        posted = [e["idempotency_key"] for e in stored if e["type"] != MODEL_REQUEST]
        assert sorted(posted) == sorted(acked)
        assert len(stored) - len(posted) == answered
        kept = [e["idempotency_key"] for e in stored]

        filler.unlink()  # space returns: the same gateway process takes writes again
        key = uuid.uuid4().hex
        answer = _post(harness, "full", key)
        assert answer.status_code == 200, answer.text
        kept.append(key)

        gateway.kill()  # and what was acknowledged survives a crash after it
        gateway.start()
        stored = admin(gateway.url).get("/api/rollouts/full/events").json()
        assert sorted(e["idempotency_key"] for e in stored) == sorted(kept)
        print(f"disk full: after space returned, {len(kept)} acknowledged events all kept")
    finally:
        gateway.stop()
