"""`reins train`'s own error lines: a gateway that refuses the trainer's key, an engine that
cannot be reached, are settings to fix, said as such, not tracebacks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from reins.cli import app
from tests.support import free_port, running_gateway
from tests.trainer.test_loop import tasks_file

pytestmark = pytest.mark.slow  # a gateway process, or an in-process one and the model


def run_config(tmp_path: Path, model: Path, **fields: object) -> Path:
    base = {
        "run_name": "k",
        "runs_dir": str(tmp_path / "runs"),
        "tasks": str(tasks_file(tmp_path, "train.jsonl", ["ant"])),
        "agent": "true",
        "model": str(model),
        "malloc_mmap_threshold_mb": None,  # the test process's allocator stays as it is
        "tensorboard": False,
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**base, **fields}))
    return config


def test_an_engine_that_cannot_be_reached_is_an_error_line(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = run_config(tmp_path, tiny_model_dir, engine_url=url)
    result = CliRunner().invoke(app, ["train", str(config)], env=dict(os.environ))
    assert result.exit_code == 1, result.output
    assert " ".join(result.output.split()).endswith(
        f"error: cannot reach the engine at {url}: ConnectError('[Errno 111] Connection refused')"
    )


def test_a_gateway_that_refuses_the_key_is_an_error_line(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    with running_gateway(f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}", api_key="right") as gateway:
        config = run_config(tmp_path, tiny_model_dir, gateway_url=gateway.url, api_key="wrong")
        result = CliRunner().invoke(app, ["train", str(config)], env=dict(os.environ))
    assert result.exit_code == 1, result.output
    assert " ".join(result.output.split()).endswith(
        f"error: the gateway {gateway.url} refused the trainer's key (the bearer token is not "
        "the gateway's admin key): set api_key, or REINS_API_KEY"
    )


def test_a_gateway_that_does_not_answer_is_an_error_line_before_the_model_loads(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was found after the model loaded, then two minutes of silent retries."""
    from reins.trainer import runtime

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the gateway was checked")

    monkeypatch.setattr(runtime, "load_policy", no_model)
    monkeypatch.setattr(runtime, "GATEWAY_CHECK_S", 1.0)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = run_config(tmp_path, tiny_model_dir, gateway_url=url, api_key="k" * 12)
    result = CliRunner().invoke(app, ["train", str(config)], env=dict(os.environ))
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert f"error: the gateway {url} could not be reached" in said, said
    assert "check gateway_url" in said
