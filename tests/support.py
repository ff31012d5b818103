"""Real servers for tests and benchmarks: a PostgreSQL cluster and gateway processes on loopback.

Every server binds 127.0.0.1 only and is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[int]:
    """A stdlib HTTP server on 127.0.0.1 with `handler`, in a thread; yields its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def postgres_bin_dir() -> Path | None:
    """Debian's PostgreSQL binaries (not on PATH), or whichever `initdb` is on PATH."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    if candidates:
        return Path(candidates[0]).parent
    found = shutil.which("initdb")
    return Path(found).parent if found else None


@dataclass
class PostgresServer:
    """A throwaway cluster: `initdb` into a temp dir, `pg_ctl start` on 127.0.0.1."""

    bin_dir: Path
    root: Path
    port: int
    pid: int = 0

    @property
    def admin_dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, database: str) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def _run_as_owner(
        self, args: list[str], timeout_s: float = 120
    ) -> subprocess.CompletedProcess[str]:
        # PostgreSQL refuses to run as root; as root we run it as the `postgres` user.
        if os.geteuid() == 0:
            args = ["su", "postgres", "-s", "/bin/sh", "-c", shlex.join(args)]
        try:
            return subprocess.run(
                args, check=True, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.CalledProcessError as error:
            log = self.root / "log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
            raise RuntimeError(
                f"{shlex.join(args)} exited {error.returncode}: {error.stderr or error.stdout}\n"
                f"the server's log ends:\n{tail}"
            ) from error

    @classmethod
    def start(cls) -> PostgresServer:
        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            raise RuntimeError(
                "PostgreSQL is not installed: `make test` installs Debian's `postgresql`"
            )
        root = Path(tempfile.mkdtemp(prefix="reins-pg-"))
        server = cls(bin_dir=bin_dir, root=root, port=free_port())
        (root / "data").mkdir()
        (root / "sock").mkdir()
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            for path in (root, root / "data", root / "sock"):
                os.chown(path, owner.pw_uid, owner.pw_gid)
        server._run_as_owner(
            [str(bin_dir / "initdb"), "-D", str(root / "data"), "--auth=trust", "-U", "postgres"]
        )
        options = f"-c listen_addresses=127.0.0.1 -p {server.port} -k {root / 'sock'} -c fsync=on"
        server._run_as_owner(
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(root / "data"),
                "-l",
                str(root / "log"),
                "-w",
                "-o",
                options,
                "start",
            ]
        )
        server.pid = int((root / "data" / "postmaster.pid").read_text().split()[0])
        return server

    def create_database(self, name: str) -> str:
        self._run_as_owner(
            [
                str(self.bin_dir / "createdb"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                name,
            ]
        )
        return self.url(name)

    def stop(self) -> None:
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGINT)  # "fast" shutdown: disconnects clients
            # The postmaster removes its pid file when it is done; the process itself may linger
            # as a zombie until init reaps it, so its pid is no sign of life.
            pid_file = self.root / "data" / "postmaster.pid"
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and pid_file.exists():
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class GatewayProcess:
    """`reins gateway` in its own process, so a test can SIGKILL it."""

    database_url: str
    api_key: str
    port: int
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        self.log_path = self.log_path or Path(
            tempfile.mkstemp(prefix="reins-gw-", suffix=".log")[1]
        )
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "reins.cli",
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--db",
                self.database_url,
                "--api-key",
                self.api_key,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited early:\n{self.log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"gateway did not start:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)


@contextlib.contextmanager
def running_gateway(database_url: str, api_key: str = "test-admin-key") -> Iterator[GatewayProcess]:
    gateway = GatewayProcess(database_url=database_url, api_key=api_key, port=free_port())
    gateway.start()
    try:
        yield gateway
    finally:
        gateway.stop()


def stored_calls(db_path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every `model_request` of a stopped gateway's SQLite file, as (rollout id, whole event
    data), in seq order: packed rows restored (`reins.packed`), since their JSON column keeps
    only the fields queries use."""
    from reins.packed import Unpacked, base_of, unpack

    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT seq, rollout_id, data, packed FROM events "
            "WHERE type = 'model_request' ORDER BY seq"
        ).fetchall()
    restored: dict[int, Unpacked] = {}
    out: list[tuple[str, dict[str, Any]]] = []
    for seq, rollout_id, text, blob in rows:
        data = json.loads(text)
        if blob is not None:
            named = base_of(blob)
            restored[seq] = unpack(seq, data, blob, None if named is None else restored[named])
            data = restored[seq].data
        out.append((rollout_id, data))
    return out


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, ended but not waited for, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> list[int]:
    """The pids of the process's children, their children, and so on (Linux /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in map(int, (task / "children").read_text().split()):
                found += [child, *descendants(child)]
    return found


def growing_calls(
    turns: int, *, first: int, response: int, observation: int, seed: int = 0
) -> list[dict[str, Any]]:
    """`model_request` data of an agent's calls: each prompt is the previous prompt + response +
    an observation (random token IDs), so the store packs each call against the previous one."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 150_000, first).tolist()
    calls: list[dict[str, Any]] = []
    for turn in range(turns):
        answer = rng.integers(0, 150_000, response).tolist()
        calls.append(
            {
                "prompt_token_ids": prompt,
                "response_token_ids": answer,
                "response_logprobs": [-0.5] * response,
                "request": {"messages": [{"role": "user", "content": f"turn {turn}"}]},
                "status": 200,
            }
        )
        prompt = prompt + answer + rng.integers(0, 150_000, observation).tolist()
    return calls
