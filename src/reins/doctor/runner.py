"""`reins doctor`'s processes and servers: a private gateway, an engine, the harness runs.

What it keeps:
- **Private.** The gateway is its own: a SQLite file in a temporary folder, an admin key made
  here, 127.0.0.1 and a free port; the embedded engine (when no `--engine URL` is given) is served
  on another free loopback port. Both are stopped, and the folder removed, when the doctor ends.
- **A rollout's environment.** Each run is one rollout attempt, opened at the gateway as the
  controller opens one, and the harness gets exactly the controller's environment for it
  (`reins.controller.loop.agent_env`: OPENAI_BASE_URL, ANTHROPIC_BASE_URL, the attempt's token,
  REINS_*) on top of this process's own (less REINS_API_KEY, as `LocalReconciler` does).
- **Whole answers.** A run ends when its process exits (or is killed at the time limit, its whole
  process group). Its calls are read after the embedded engine has no work left, so the record
  of a call the harness hung up on is in.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import TypeAdapter

from reins.cliout import counted
from reins.controller.loop import agent_env
from reins.doctor.report import Detokenizer, DoctorReport, HarnessRun, build_report
from reins.packed import unpack_events
from reins.schemas import Attempt, PackedEvent, Rollout
from reins.serving import engine_root

MODEL_NAME = "policy"
"""The name the engine is registered under; the proxy serves any name a harness asks for."""
IDLE_WAIT_S = 60.0
"""Longest wait, after a run, for the embedded engine to finish work a harness left behind."""
OUTPUT_TAIL = 2000


class DoctorError(RuntimeError):
    """The doctor could not set up (engine, gateway, tokenizer); the message says what to do."""


@dataclass
class DoctorOptions:
    runs: int = 3
    """Runs of the harness command; each is one rollout."""
    timeout_s: float = 600.0
    """Time limit of one run."""
    mode: str = "train"
    """`train` (the proxy samples at temperature 1) or `val` (the harness's own settings)."""
    engine_url: str | None = None
    """An OpenAI-compatible engine's base URL (`.../v1`); None: the embedded engine."""
    model: Path | None = None
    """The embedded engine's model folder (None: the prepared default model)."""
    tokenizer: Path | None = None
    """The policy's tokenizer folder, for the text checks with `engine_url`."""
    input: Any = None
    """Every rollout's input (REINS_INPUT)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the harness (the rollout's variables win)."""
    token_reuse: bool | None = None
    """The gateway's `token_reuse` setting (None: the gateway's default)."""


@dataclass
class _Stack:
    gateway_url: str
    admin_key: str
    detok: Detokenizer | None
    idle: Callable[[], bool]
    unserved: UnservedRequests


_Message = MutableMapping[str, Any]
_ATTEMPT_PREFIX = re.compile(r"^/proxy/rollout/[^/]+/attempt/[^/]+/mode/[^/]+")


class UnservedRequests:
    """ASGI middleware around the doctor's gateway: the requests it answered 404 or 405 (a path
    or method it does not serve, such as an embeddings call), by method, path and status. They
    leave no event, so the calls read back cannot show them; a harness that needs one fails or
    works around it. HEAD is left out (Claude Code probes its base URL with one, and a 404 does
    it no harm)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.seen: Counter[str] = Counter()

    async def __call__(
        self,
        scope: _Message,
        receive: Callable[[], Awaitable[_Message]],
        send: Callable[[_Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http" or scope["method"] == "HEAD":
            await self.app(scope, receive, send)
            return

        async def watched(message: _Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in (404, 405):
                path = _ATTEMPT_PREFIX.sub("…", scope["path"])
                self.seen[f"{scope['method']} {path} ({message['status']})"] += 1
            await send(message)

        await self.app(scope, receive, watched)


@contextlib.contextmanager
def _embedded(model: Path | None) -> Iterator[tuple[str, Detokenizer, Callable[[], bool]]]:
    try:
        from reins.engine.api import create_engine_app
        from reins.engine.embedded import EmbeddedEngine
        from reins.engine.prepare import ModelPreparationError
    except ImportError as error:
        raise DoctorError(
            f"the embedded engine needs the train extra ({error}): pip install 'reins[train]', "
            "or pass --engine URL"
        ) from error
    from reins.serving import BackgroundServer

    try:
        engine = EmbeddedEngine.load(model)
    except (ModelPreparationError, ValueError, OSError) as error:
        raise DoctorError(f"cannot load the embedded engine: {error}") from error
    try:
        with BackgroundServer(create_engine_app(engine)) as server:
            yield (
                f"{server.url}/v1",
                Detokenizer(engine.tokenizer),
                lambda: engine.scheduler.load() == (0, 0),
            )
    finally:
        engine.close()


def _tokenizer(folder: Path) -> Detokenizer:
    folder = folder.expanduser()
    if not folder.is_dir():
        # Else transformers reads the path as a hub repository id and says so.
        raise DoctorError(f"--tokenizer {folder}: no such folder")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise DoctorError(
            f"--tokenizer {folder}: no tokenizer there (tokenizer.json or tokenizer_config.json)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise DoctorError("--tokenizer needs transformers: pip install 'reins[train]'") from error
    try:
        return Detokenizer(AutoTokenizer.from_pretrained(str(folder)))
    except (OSError, ValueError) as error:
        raise DoctorError(f"cannot load a tokenizer from {folder}: {error}") from error


@contextlib.contextmanager
def _stack(options: DoctorOptions) -> Iterator[_Stack]:
    from reins.gateway import GatewaySettings, create_app
    from reins.gateway.settings import SettingsRefused, load_settings
    from reins.serving import BackgroundServer

    with contextlib.ExitStack() as stack:
        detok: Detokenizer | None
        if options.engine_url is None:
            endpoint, detok, idle = stack.enter_context(_embedded(options.model))
        else:
            endpoint = engine_root(options.engine_url) + "/v1"
            detok = _tokenizer(options.tokenizer) if options.tokenizer else None
            idle = _always
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="reins-doctor-")))
        key = "rk-doctor-" + secrets.token_urlsafe(18)
        overrides: dict[str, Any] = {}
        if options.token_reuse is not None:
            if "token_reuse" not in GatewaySettings.model_fields:
                raise DoctorError("this gateway has no token reuse setting; drop --token-reuse")
            overrides["token_reuse"] = options.token_reuse
        try:
            settings = load_settings(
                database_url=str(folder / "gateway.db"), api_key=key, **overrides
            )
        except SettingsRefused as error:  # a REINS_* variable of the environment
            raise DoctorError(f"the gateway's settings: {error}") from None
        unserved = UnservedRequests(create_app(settings))
        server = stack.enter_context(BackgroundServer(unserved))
        registered = httpx.post(
            f"{server.url}/api/models",
            json={"model": MODEL_NAME, "endpoint": endpoint, "engine": "openai"},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        if registered.status_code >= 400:
            raise DoctorError(f"the gateway refused the engine {endpoint}: {registered.text}")
        yield _Stack(server.url, key, detok, idle, unserved)


def _always() -> bool:
    return True


def _open_attempt(
    http: httpx.Client, options: DoctorOptions, number: int
) -> tuple[Rollout, Attempt]:
    rollout_id = f"doctor-{number}-{uuid.uuid4().hex[:8]}"
    body = [{"rollout_id": rollout_id, "mode": options.mode, "input": options.input}]
    created = http.post("/api/rollouts", json=body)
    created.raise_for_status()
    opened = http.post(f"/api/rollouts/{rollout_id}/attempts")
    opened.raise_for_status()
    return (
        Rollout.model_validate(created.json()[0], extra="allow"),
        Attempt.model_validate(opened.json(), extra="allow"),
    )


def _wait(check: Callable[[], bool], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)


def _run_process(
    argv: Sequence[str], env: dict[str, str], timeout_s: float, log: Path
) -> tuple[int | None, str]:
    """Runs `argv` in a session of its own; once it has ended, or at the time limit, its whole
    group is killed: a background worker it left would go on calling a gateway that is gone, or
    into the next run."""
    with log.open("w+b") as out:
        try:
            process = subprocess.Popen(
                list(argv),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as error:
            raise DoctorError(f"cannot start {argv[0]!r}: {error}") from error
        returncode: int | None = None
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # ended, at the limit, or the doctor itself interrupted: the harness goes too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        out.seek(0)
        tail = out.read()[-OUTPUT_TAIL:].decode(errors="replace")
    return returncode, tail


def _calls(http: httpx.Client, rollout_id: str) -> list[dict[str, Any]]:
    """The run's calls, read as stored (each packed against an earlier one: a long session's
    read costs its length, not the square of its turns) and restored with their prompts as
    arrays (as lists, 50 calls growing to 32k tokens are ~800k Python ints)."""
    stored: list[PackedEvent] = []
    after = 0
    while True:
        page = http.get(
            f"/api/rollouts/{rollout_id}/events/packed",
            params={"type": "model_request", "after": after, "limit": 1000},
        )
        page.raise_for_status()
        events = _PACKED_PAGE.validate_json(page.content)
        stored += events
        if len(events) < 1000:
            return [event.data for event in unpack_events(stored, token_arrays=True)]
        after = events[-1].seq


_PACKED_PAGE: TypeAdapter[list[PackedEvent]] = TypeAdapter(list[PackedEvent])


def run_doctor(
    argv: Sequence[str],
    options: DoctorOptions,
    progress: Callable[[str], None] = lambda line: None,
) -> DoctorReport:
    """Runs the harness `argv` `options.runs` times through a private gateway; the report."""
    if not argv:
        raise DoctorError(
            "no harness command: reins doctor -- CMD ARGS..., or a named harness: "
            "reins doctor NAME (the names: reins doctor --list)"
        )
    if options.runs < 1:
        raise DoctorError(f"--runs must be at least 1, not {options.runs}")
    if options.engine_url is None and options.tokenizer is not None:
        raise DoctorError("--tokenizer goes with --engine (the embedded engine has its own)")
    if options.engine_url is not None and options.model is not None:
        raise DoctorError("--model is the embedded engine's; with --engine, pass --tokenizer")
    if options.engine_url is not None and not options.engine_url.startswith(
        ("http://", "https://")
    ):
        raise DoctorError(f"--engine {options.engine_url!r}: give http://HOST:PORT (or .../v1)")
    runs: list[HarnessRun] = []
    base = {k: v for k, v in os.environ.items() if k != "REINS_API_KEY"}
    base.setdefault("PYTHONUNBUFFERED", "1")
    # Before the engine loads (seconds to minutes): a command that cannot start fails at once.
    if shutil.which(argv[0], path={**base, **options.env}.get("PATH")) is None:
        raise DoctorError(f"cannot start {argv[0]!r}: no such program (or not executable)")
    with (
        _stack(options) as stack,
        httpx.Client(
            base_url=stack.gateway_url,
            headers={"Authorization": f"Bearer {stack.admin_key}"},
            timeout=60,
        ) as http,
        tempfile.TemporaryDirectory(prefix="reins-doctor-logs-") as logs,
    ):
        times = "once" if options.runs == 1 else f"{options.runs} times"
        progress(f"gateway {stack.gateway_url}; running `{' '.join(argv)}` {times}")
        for number in range(1, options.runs + 1):
            rollout, attempt = _open_attempt(http, options, number)
            env = {**base, **options.env, **agent_env(stack.gateway_url, rollout, attempt)}
            started = time.monotonic()
            unserved_before = Counter(stack.unserved.seen)
            returncode, tail = _run_process(
                argv, env, options.timeout_s, Path(logs) / f"run-{number}.log"
            )
            seconds = time.monotonic() - started
            _wait(stack.idle, IDLE_WAIT_S)
            unserved = dict(stack.unserved.seen - unserved_before)
            calls = _calls(http, rollout.rollout_id)
            run = HarnessRun(rollout.rollout_id, calls, returncode, seconds, tail, unserved)
            runs.append(run)
            progress(f"run {number}/{options.runs}: " + _run_line(run, stack.detok))
        return build_report(runs, stack.detok)


def _run_line(run: HarnessRun, detok: Detokenizer | None) -> str:
    (summary,) = build_report([run], detok).rollouts
    status = "timed out" if run.returncode is None else f"exit {run.returncode}"
    why = f" (splits: {', '.join(summary.splits)})" if summary.splits else ""
    return (
        f"{status}, {run.seconds:.1f} s, {counted(summary.calls, 'call')} "
        f"({summary.failed} failed) -> {counted(summary.sequences, 'sequence')}{why}"
    )
