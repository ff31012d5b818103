"""`reins gateway` as a user starts it: a real process, flags and REINS_* environment."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Gateway
from tests.support import PostgresServer, alive, free_port, running_gateway


def test_gateway_command_serves_with_flags(tmp_path: Path) -> None:
    with running_gateway(str(tmp_path / "g.db"), api_key="flag-key") as gateway:
        ok = httpx.get(f"{gateway.url}/api/models", headers={"Authorization": "Bearer flag-key"})
        assert ok.status_code == 200
        assert httpx.get(f"{gateway.url}/api/models").status_code == 401
    assert (tmp_path / "g.db").exists()


def test_gateway_reads_key_and_database_from_the_environment(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "REINS_API_KEY": "env-key",
        "REINS_DATABASE_URL": str(tmp_path / "env.db"),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "reins.cli", "gateway", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.get(
                    f"http://127.0.0.1:{port}/api/models",
                    headers={"Authorization": "Bearer env-key"},
                )
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.05)
        assert response.status_code == 200
        assert (tmp_path / "env.db").exists()
    finally:
        os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout=10)


@pytest.mark.slow
def test_model_prepare_prints_a_ready_model_folder() -> None:
    """Builds the default model's folder on first use (about 45 s), then reuses it."""
    result = subprocess.run(
        [sys.executable, "-m", "reins.cli", "model", "prepare"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert (folder / "config.json").is_file()
    assert (folder / "reins-prepared.json").is_file()
    assert (folder / "tokenizer_config.json").is_file()


def refused_gateway(database: str) -> subprocess.CompletedProcess[str]:
    """`reins gateway --db DATABASE`, which must end at once (a gateway that served would run
    until the timeout)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "reins.cli",
            "gateway",
            "--db",
            database,
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "REINS_API_KEY": "k"},
    )


@pytest.mark.parametrize(
    ("database", "words"),
    [
        (
            f"postgresql://reins:secret@127.0.0.1:{free_port()}/runs",
            "cannot reach the database postgresql+asyncpg://reins:***@127.0.0.1:",
        ),
        ("/proc/no-such-folder/gateway.db", "cannot open the SQLite database /proc/no-such"),
        # It started, and failed each event post: the writer and the reader each opened an
        # empty database of their own.
        (":memory:", "an in-memory SQLite database cannot hold the gateway's records"),
        ("sqlite://", "an in-memory SQLite database cannot hold"),
    ],
    ids=["no-server", "unwritable-file", "in-memory", "in-memory-url"],
)
def test_a_database_that_cannot_be_opened_is_one_line_not_a_traceback(
    database: str, words: str
) -> None:
    """Uvicorn reported a database failing at startup as a traceback of its lifespan machinery
    (the cause at the bottom), and `store:` printed the URL's password."""
    result = refused_gateway(database)
    assert result.returncode == 1, result.stderr
    assert words in result.stderr
    assert "Traceback" not in result.stderr and "secret" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "environment", "words"),
    [
        (["--api-key", ""], {}, "api_key (REINS_API_KEY): the admin key is empty"),
        ([], {"REINS_API_KEY": "  "}, "api_key (REINS_API_KEY): the admin key is"),
        (["--api-key", "key "], {}, "the admin key starts or ends with white space"),
        (["--api-key", "ключ"], {}, "the admin key must be printable ASCII"),
        ([], {"REINS_MAX_PAGE_SIZE": "0"}, "max_page_size (REINS_MAX_PAGE_SIZE): Input should be"),
        (
            [],
            {"REINS_TRAIN_SAMPLING": "{bad"},
            "train_sampling (REINS_TRAIN_SAMPLING) is not the JSON it takes: Expecting property",
        ),
        (  # a typo read as no setting at all lost the default temperature unsaid
            [],
            {"REINS_TRAIN_SAMPLING": '{"temperature": 0.5}'},
            "train_sampling.temperature (REINS_TRAIN_SAMPLING): Extra inputs are not permitted",
        ),
    ],
    ids=[
        "empty-flag",
        "blank-variable",
        "outer-space",
        "not-ascii",
        "other-setting",
        "not-json",
        "unknown-field",
    ],
)
def test_a_setting_the_gateway_cannot_use_is_named_not_a_traceback(
    tmp_path: Path, flags: list[str], environment: dict[str, str], words: str
) -> None:
    """An empty admin key was accepted: the dashboard's login then took an empty key, and its
    session cookie was a value anyone could compute. Any setting refused is one line, exit 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REINS_")} | environment
    result = subprocess.run(
        [sys.executable, "-m", "reins", "gateway", "--db", str(tmp_path / "g.db"), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    assert words in " ".join(result.stderr.split()), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "g.db").exists()


def test_a_file_that_is_not_a_database_and_an_unknown_url_are_one_line(tmp_path: Path) -> None:
    text = tmp_path / "notes.db"
    text.write_text("not a database")
    for database, words in (
        (str(text), f"{text} is not a SQLite database (file is not a database)"),
        ("mysql://u@127.0.0.1/x", "is neither a SQLite file nor a PostgreSQL URL"),
        # A device or a folder passed the check, then the gateway's start was a traceback.
        ("/dev/null", "/dev/null is not a file (a folder or a device)"),
        (str(tmp_path), f"{tmp_path} is not a file (a folder or a device)"),
        (  # an option of libpq's that asyncpg does not take was a TypeError traceback
            "postgresql://u@127.0.0.1:1/db?connect_timeout=3",
            "has an option the PostgreSQL driver (asyncpg) does not take",
        ),
    ):
        result = refused_gateway(database)
        assert result.returncode == 1, result.stderr
        assert words in " ".join(result.stderr.split()), result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "database", ["postgresql://u@127.0.0.1:notaport/db", "postgresql://u@[::1/db"]
)
def test_a_database_url_that_does_not_parse_is_one_line(database: str) -> None:
    """Both were tracebacks from the URL parser."""
    result = refused_gateway(database)
    assert result.returncode == 2, result.stderr
    words = "database_url (REINS_DATABASE_URL): not a database URL (invalid literal for int()"
    assert words in " ".join(result.stderr.split()), result.stderr
    assert "Traceback" not in result.stderr


def reins(arguments: list[str]) -> subprocess.CompletedProcess[str]:
    """`reins ARGUMENTS` run as a user runs it, without the REINS_* variables of this process."""
    return subprocess.run(
        [sys.executable, "-m", "reins", *arguments],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("REINS_")},
    )


CONTROLLER = ["controller", "--runner", "local", "--agent", "true", "--gateway"]
KUBERNETES = [
    *("controller", "--runner", "kubernetes", "--agent", "true"),
    *("--gateway", "http://127.0.0.1:1", "--api-key", "k"),
]


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        (
            [*KUBERNETES, "--job-template", "/nonexistent"],
            "--job-template /nonexistent: cannot read it ([Errno 2]",
        ),
        (  # it said "Invalid kube-config file ...; pass --kubeconfig"
            [*KUBERNETES, "--kubeconfig", "/nonexistent", "--set", "image=x"],
            "--kubeconfig /nonexistent: no such file",
        ),
        (
            ["export", "--api-key", "k", "--mode", "bogus"],
            "--mode 'bogus': give one of train, val",
        ),
        (
            ["export", "--api-key", "k", "--status", "done"],
            "--status 'done': give one of queuing, running, succeeded, failed",
        ),
        (["engine", "--max-batch", "0"], "Invalid value for '--max-batch'"),
        (["engine", "--device", "foo"], "--device 'foo': Expected one of cpu"),
        (["engine", "--dtype", "fp16"], "--dtype 'fp16': give one of auto, bfloat16, float16"),
        (["gateway", "--port", "99999"], "Invalid value for '--port'"),
        (["export", "--gateway", "notaurl", "--api-key", "k"], "'notaurl' is not a gateway URL"),
        (
            ["export", "--api-key", "k", "--run", ""],
            "--run is empty: give a value, or leave it out",
        ),
        (["export", "--api-key", "k", "--search", ""], "--search is empty: give a value"),
        (
            ["export", "--gateway", "http://127.0.0.1:99999", "--api-key", "k"],
            "its port is not 1-65535",
        ),
        (["export", "--gateway", "http://127.0.0.1:1", "--api-key", " "], "the admin key is empty"),
        ([*CONTROLLER, "notaurl", "--api-key", "k"], "'notaurl' is not a gateway URL"),
        (
            [*CONTROLLER, "http://127.0.0.1:1", "--api-key", "k", "--set", "image=[bad"],
            "--set 'image=[bad': its value is not YAML",
        ),
        (
            [*CONTROLLER, "http://127.0.0.1:1", "--api-key", "k", "--timeout", "-1"],
            "Invalid value for '--timeout'",
        ),
        (
            [*CONTROLLER, "http://127.0.0.1:1", "--api-key", "k", "--poll-interval", "inf"],
            "Invalid value for '--poll-interval'",
        ),
    ],
    ids=[
        "job-template",
        "kubeconfig",
        "export-mode",
        "export-status",
        "max-batch",
        "device",
        "dtype",
        "port",
        "not-a-url",
        "export-empty-run",
        "export-empty-search",
        "port-range",
        "blank-key",
        "controller-url",
        "set-not-yaml",
        "timeout",
        "poll-interval-inf",
    ],
)
def test_a_mistaken_argument_is_one_line_and_exit_2(arguments: list[str], words: str) -> None:
    """Each was a traceback, a hang (an engine serving no sequence), a two-minute retry of a URL
    that is none, or an attempt timing out at once."""
    result = reins(arguments)
    said = " ".join((result.stdout + result.stderr).replace("│", " ").split())
    assert result.returncode == 2, said
    assert words in said
    assert "Traceback" not in said


@pytest.mark.slow
def test_a_database_the_server_does_not_have_is_named(postgres: PostgresServer) -> None:
    result = refused_gateway(postgres.url("no_such_database"))
    assert result.returncode == 1, result.stderr
    assert 'refused the connection: database "no_such_database" does not exist' in result.stderr
    assert "Traceback" not in result.stderr


def test_model_prepare_refuses_an_unknown_dtype() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "reins.cli", "model", "prepare", "--dtype", "int3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "dtype must be one of" in result.stderr


_GC_PROBE = """
import gc, sys, weakref
import uvicorn
import reins.trainer.runtime
from reins.cli import app

def probe(*args, **kwargs):
    frozen, unfrozen = gc.get_freeze_count(), len(gc.get_objects(generation=2))

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle
    collected = []
    weakref.finalize(cycle, collected.append, True)
    del cycle
    gc.collect()
    young = gc.get_threshold()[0]
    print("gc-probe", frozen, unfrozen, collected == [True], young, flush=True)

async def train(*args, on_serving, **kwargs):
    on_serving()
    probe()
    return []

uvicorn.Server.run = probe  # `reins gateway` and `reins engine` serve here (`reins.serving.serve`)
reins.trainer.runtime.train = train  # `reins train` trains here
app(sys.argv[1:])
"""


@pytest.mark.parametrize("command", ["gateway", "engine", "train"])
def test_servers_leave_their_startup_objects_out_of_full_collections(
    command: str, tmp_path: Path
) -> None:
    """A full collection walked every object of the process (a gateway's ~150k: 90-100 ms, no
    request moving; an engine's ~400k: 240-300 ms; a trainer's, its gateway and engine
    in-process, ~500k: 270-670 ms). Those alive when it starts serving are frozen
    (`gc.freeze`); the garbage made afterwards is still collected."""
    args = {
        "gateway": ["gateway", "--db", str(tmp_path / "g.db"), "--api-key", "k"],
        "engine": ["engine"],  # the default model, from its package
        "train": ["train", "examples/recall/config.yaml", "--set", f"runs_dir={tmp_path}"],
    }[command]
    probe = subprocess.run(
        [sys.executable, "-c", _GC_PROBE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert probe.returncode == 0, probe.stderr
    (line,) = [line for line in probe.stdout.splitlines() if line.startswith("gc-probe ")]
    frozen, unfrozen, collected, young = line.split()[1:]
    assert int(frozen) > 20_000
    assert int(unfrozen) < int(frozen) // 100
    assert collected == "True"
    # The gateway collects its young objects less often (its calls' garbage goes by reference
    # counts); the engine and the trainer keep CPython's threshold.
    assert int(young) == (10_000 if command == "gateway" else 700)


def test_python_dash_m_reins_is_the_reins_command() -> None:
    """For an environment whose scripts are not on PATH (it said: 'reins' is a package and
    cannot be directly executed)."""
    result = subprocess.run(
        [sys.executable, "-m", "reins", "gateway", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "Serve the API Gateway" in result.stdout


def test_an_output_folder_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    """Each was a FileExistsError traceback."""
    taken = tmp_path / "taken"
    taken.write_text("")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.6}\n'
    )
    for arguments in (
        ["report", "--run", str(run), "--out", str(taken)],
        ["model", "prepare", "--cache-dir", str(taken)],
        [*CONTROLLER, "http://127.0.0.1:1", "--api-key", "k", "--log-dir", str(taken)],
    ):
        result = reins(arguments)
        said = " ".join((result.stdout + result.stderr).split())
        assert result.returncode == 1, (arguments, said)
        assert "Traceback" not in said, arguments
        assert f"error: [Errno 17] File exists: '{taken}'" in said, said


def test_the_controller_stops_at_once_while_the_gateway_does_not_answer() -> None:
    """Its reconcile pass retried each call for two minutes, and SIGINT waited as long."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "reins", *CONTROLLER, "http://127.0.0.1:1", "--api-key", "k"],
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("REINS_")},
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "controller up" in line:
                break
        time.sleep(1)  # its first pass is now retrying a call
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        proc.wait(timeout=30)
        assert time.monotonic() - sent < 15
        assert "controller stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_error_quoting_brackets_shows_them_as_they_are(tmp_path: Path) -> None:
    """A `[/y]` in a quoted path was read as rich markup: a MarkupError traceback."""
    folder = tmp_path / "run[" / "y]"
    folder.mkdir(parents=True)
    result = reins(["report", "--run", str(folder)])
    assert result.returncode == 1, result.stderr
    assert f"error: {folder} has no metrics.jsonl" in " ".join(result.stderr.split())


def test_a_database_path_with_brackets_is_named_as_it_is(tmp_path: Path) -> None:
    """`reins gateway --db 'DIR/[/y]/g.db'` that cannot be opened: the reason quotes the path,
    whose `[/y]` rich read as markup (a MarkupError traceback in place of the reason)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = refused_gateway(f"{blocker}/[/y]/g.db")
    assert result.returncode == 1, result.stderr
    said = " ".join(result.stderr.split())
    assert f"cannot open the SQLite database {blocker}/[/y]/g.db" in said, said
    assert "Traceback" not in said


def test_libpqs_sslmode_is_asyncpgs_ssl() -> None:
    """`?sslmode=require`, as every PostgreSQL guide writes it, was a TypeError traceback."""
    from reins.gateway.settings import database_url

    assert database_url("postgresql://u:p@db.internal:5433/reins?sslmode=require") == (
        "postgresql+asyncpg://u:p@db.internal:5433/reins?ssl=require"
    )
    assert database_url("postgresql://u@h/db") == "postgresql+asyncpg://u@h/db"


@pytest.mark.parametrize("command", ["gateway", "engine"])
def test_a_port_in_use_is_one_line_before_any_start_up_work(command: str, tmp_path: Path) -> None:
    """uvicorn said it in its log, after the app had started or the model had loaded, exit 3."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        extra = (
            ["--db", str(tmp_path / "g.db"), "--api-key", "k" * 12] if command == "gateway" else []
        )
        result = reins([command, "--port", str(port), *extra])
    assert result.returncode == 1, result.stderr
    said = " ".join(result.stderr.split())
    assert f"reins {command}: cannot listen on 127.0.0.1:{port}: Address already in use" in said
    assert "loading the model" not in said and not (tmp_path / "g.db").exists()


@pytest.mark.slow
def test_a_second_ctrl_c_stops_reins_train_at_once_and_its_agents_end(tmp_path: Path) -> None:
    """asyncio's handler raised KeyboardInterrupt wherever the first Ctrl-C's cleanup was: the
    process hung (SIGKILL needed) or aborted ("terminate called without an active exception",
    exit -6), and the first Ctrl-C said nothing until a model load ended."""
    from tests.trainer.conftest import make_tiny_model
    from tests.trainer.test_sigkill import start, stuck_run, wait_for

    (tmp_path / "pids").mkdir()
    model = make_tiny_model(tmp_path / "model")
    config, output = stuck_run(tmp_path, model, "twice", "tests.trainer.paced_agents:stuck")
    trainer = start(config, output)
    try:
        wait_for(lambda: len(list((tmp_path / "pids").glob("twice.*"))) == 4, trainer, output, 120)
        agents = [
            int(pid) for p in (tmp_path / "pids").glob("twice.*") for pid in p.read_text().split()
        ]
        trainer.send_signal(signal.SIGINT)
        wait_for(lambda: "Ctrl-C again to stop at once" in output.read_text(), trainer, output, 30)
        trainer.send_signal(signal.SIGINT)
        trainer.wait(timeout=30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    text = output.read_text()
    assert trainer.returncode == 130, text
    assert "stopped at once by a second Ctrl-C" in text
    assert "terminate called" not in text and "Traceback" not in text
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in agents) and time.monotonic() < deadline:
        time.sleep(0.02)  # polling /proc, bounded by the deadline
    assert not [pid for pid in agents if alive(pid)]


@pytest.mark.slow
def test_ctrl_c_before_any_checkpoint_does_not_advise_resume(tmp_path: Path) -> None:
    """It said "go on with `reins train CONFIG --resume`", which is refused without a
    checkpoint (and `reins demo` has no CONFIG to give it)."""
    from tests.trainer.conftest import make_tiny_model
    from tests.trainer.test_sigkill import start, stuck_run, wait_for

    (tmp_path / "pids").mkdir()
    model = make_tiny_model(tmp_path / "model")
    config, output = stuck_run(tmp_path, model, "once", "tests.trainer.paced_agents:stuck")
    trainer = start(config, output)
    try:
        wait_for(lambda: len(list((tmp_path / "pids").glob("once.*"))) == 4, trainer, output, 120)
        trainer.send_signal(signal.SIGINT)
        trainer.wait(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    text = " ".join(output.read_text().split())
    assert trainer.returncode == 130, text
    run_dir = tmp_path / "runs" / "once"
    advice = "it made no checkpoint to go on from: run it again under another run_name"
    assert f"{advice}, or delete {run_dir} first" in text
    assert "--resume" not in text


@contextlib.contextmanager
def _reins_engine(tmp_path: Path, *options: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`reins engine --port 0` on a tiny model, read up to its `serving` line (or a traceback):
    (the process, what it said). Ended with Ctrl-C (killed if it does not stop)."""
    from tests.trainer.conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    command = [sys.executable, "-m", "reins", "engine", "--port", "0", "--model", str(model)]
    engine = subprocess.Popen([*command, *options], stderr=subprocess.PIPE, text=True)
    try:
        assert engine.stderr is not None
        said = []
        for line in engine.stderr:
            said.append(line)
            if line.startswith("serving ") or "Traceback" in line:
                break
        yield engine, "".join(said)
    finally:
        if engine.poll() is None:
            engine.send_signal(signal.SIGINT)
        try:
            engine.wait(timeout=30)
        except subprocess.TimeoutExpired:
            engine.kill()
            engine.wait()


def _served_models(said: str) -> tuple[str, dict[str, Any]]:
    """The URL an engine's `serving` line names, and its `/models` once it answers there."""
    url = said.splitlines()[-1].split(" at ")[1].strip() if " at " in said else ""
    assert url.startswith("http://127.0.0.1:"), said
    deadline = time.monotonic() + 60
    while True:
        try:
            return url, dict(httpx.get(f"{url}/models").raise_for_status().json())
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the engine did not answer at the port it said"
            time.sleep(0.05)


def test_engine_on_port_0_says_the_port_it_serves_on(tmp_path: Path) -> None:
    """It printed `http://127.0.0.1:0/v1`, and its quiet log told the port nowhere."""
    with _reins_engine(tmp_path) as (_, said):
        url, models = _served_models(said)
    assert not url.startswith("http://127.0.0.1:0/") and len(models["data"]) == 1


def test_engine_says_a_served_name_with_brackets_as_it_is(tmp_path: Path) -> None:
    """`--served-model-name 'm[/y]'`: its start line read `[/y]` as rich markup, a MarkupError
    traceback once the model had loaded, and the engine never served."""
    with _reins_engine(tmp_path, "--served-model-name", "m[/y]") as (_, said):
        assert said.splitlines()[-1].startswith("serving m[/y] on "), said


def test_engine_stops_at_ctrl_c_with_a_generation_in_flight(tmp_path: Path) -> None:
    """uvicorn waited for every answer in flight before it stopped: `reins engine` with a
    3,000-token stream took 651 s to end after Ctrl-C. Its generations are aborted now: the
    stream ends with an error event long before its tokens, and the process exits."""
    with _reins_engine(tmp_path) as (engine, said):
        url, models = _served_models(said)
        wanted = 100_000  # far more than this machine samples before the signal is handled
        body = {
            "model": models["data"][0]["id"],
            "prompt": "a",
            "max_tokens": wanted,
            "min_tokens": wanted,  # no end of sequence before it
            "stream": True,
        }
        chunks: list[dict[str, object]] = []
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks.append(json.loads(line.removeprefix("data: ")))
                if len(chunks) == 3:
                    engine.send_signal(signal.SIGINT)
        errors = [chunk["error"] for chunk in chunks if "error" in chunk]
        assert len(errors) == 1 and len(chunks) < wanted, chunks[-3:]
        assert engine.wait(timeout=120) == 0


def _said(result: object) -> str:
    return " ".join(str(getattr(result, "output", "")).replace("│", " ").split())


@pytest.mark.parametrize(
    ("command", "option", "shown"),
    [
        (["train"], "--set", "--set KEY=VALUE"),
        (["demo"], "--set", "--set KEY=VALUE"),
        (["controller"], "--set", "--set KEY=VALUE"),
        (["export"], "--status", "--status STATE"),
        (["engine"], "--port", "--port PORT"),
        (["controller"], "--timeout", "--timeout SECONDS"),
        (["doctor"], "--timeout", "--timeout SECONDS"),
    ],
)
def test_help_shows_an_options_value_as_a_user_writes_it(
    command: list[str], option: str, shown: str
) -> None:
    """`--set <list[str]>`, `--timeout <float range>`: the Python type, not what to write."""
    from typer.testing import CliRunner

    from reins.cli import app

    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert shown in _said(result)
    assert "list[str]>" not in result.output.split(option, 1)[1].split("\n")[0]


def test_counts_take_the_number_of_their_noun() -> None:
    from reins.cliout import counted

    assert [counted(n, "rollout") for n in (0, 1, 2)] == ["0 rollouts", "1 rollout", "2 rollouts"]
    assert counted(1, "CUDA device") == "1 CUDA device"


def test_export_of_one_rollout_says_one_rollout(gateway: Gateway, tmp_path: Path) -> None:
    """It said "exported 1 rollouts"."""
    from typer.testing import CliRunner

    from reins.cli import app
    from tests.monitor.factory import many_rollouts

    many_rollouts(gateway, 1, run="one")
    out = tmp_path / "one.jsonl"
    arguments = ["export", "--run", "one", "-o", str(out), "--gateway", gateway.url]
    result = CliRunner().invoke(app, [*arguments, "--api-key", gateway.api_key])
    assert result.exit_code == 0, result.output
    assert f"exported 1 rollout to {out}" in _said(result)
    assert len(out.read_text().splitlines()) == 1


def test_train_names_a_runs_folder_with_brackets_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's first line quoted `runs_dir` as rich markup: a `[/y]` in it was a MarkupError
    traceback before training began. A run of one step of one task says so in the singular."""
    from typer.testing import CliRunner

    import reins.trainer.runtime
    from reins.cli import app

    async def no_training(*args: object, **kwargs: object) -> list[object]:
        return []

    monkeypatch.setattr(reins.trainer.runtime, "train", no_training)
    runs_dir = tmp_path / "[/y]"
    config = Path(__file__).resolve().parents[1] / "examples" / "recall" / "config.yaml"
    sets = [f"runs_dir={runs_dir}", "run_name=r1", "steps=1", "tasks_per_step=1", "group_size=2"]
    result = CliRunner().invoke(
        app, ["train", str(config), *[a for s in sets for a in ("--set", s)]]
    )
    said = _said(result)
    assert result.exit_code == 0, said
    assert "run r1: 1 step, " in said
    assert "1 task x 2 rollouts per step" in said
    assert f"files in {runs_dir / 'r1'}" in said


def _engine_that_never_answers(arrived: Any) -> Any:
    """An engine app whose chat completions answer only once the client has left (`arrived`,
    a `threading.Event`, is set when one comes)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def never(request: Request) -> Response:
        arrived.set()
        while (await request.receive())["type"] != "http.disconnect":
            pass  # the body; then nothing comes until the client leaves
        return Response(status_code=499)

    return Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", never, methods=["POST"]),
        ]
    )


@pytest.mark.slow
def test_gateway_stops_at_ctrl_c_with_a_proxied_call_in_flight(tmp_path: Path) -> None:
    """`reins gateway` served with plain uvicorn, which waits at Ctrl-C for every answer in
    flight, with no bound: a proxied call whose engine never answers kept it from stopping for
    ever. It serves through `reins.serving.serve` now, which waits `GRACEFUL_SHUTDOWN_S` at
    most, then cancels the calls and exits."""
    import threading

    from reins.serving import GRACEFUL_SHUTDOWN_S, BackgroundServer
    from tests.support import GatewayProcess

    arrived = threading.Event()
    with BackgroundServer(_engine_that_never_answers(arrived)) as engine:
        gateway = GatewayProcess(str(tmp_path / "g.db"), "k", free_port())
        gateway.start()
        try:
            admin = {"Authorization": "Bearer k"}
            api = f"{gateway.url}/api"
            model = {"model": "m", "endpoint": f"{engine.url}/v1"}
            httpx.post(f"{api}/models", json=model, headers=admin).raise_for_status()
            httpx.post(f"{api}/rollouts", json=[{"rollout_id": "r"}], headers=admin)
            token = httpx.post(f"{api}/rollouts/r/attempts", headers=admin).json()["token"]
            url = f"{gateway.url}/proxy/rollout/r/attempt/1/mode/train/openai/v1/chat/completions"
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            answered: list[int] = []

            def call() -> None:
                with contextlib.suppress(httpx.TransportError):
                    headers = {"Authorization": f"Bearer {token}"}
                    answer = httpx.post(url, json=body, headers=headers, timeout=300)
                    answered.append(answer.status_code)

            caller = threading.Thread(target=call, daemon=True)
            caller.start()
            assert arrived.wait(timeout=60), "the call never reached the engine"
            assert gateway.process is not None
            signalled = time.monotonic()
            gateway.process.send_signal(signal.SIGINT)
            assert gateway.process.wait(timeout=GRACEFUL_SHUTDOWN_S + 60) == 0
            assert time.monotonic() - signalled < GRACEFUL_SHUTDOWN_S + 30
            caller.join(timeout=30)
        finally:
            gateway.stop()
