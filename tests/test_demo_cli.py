"""`reins demo --example NAME`: an example by name, a config by path, a clear error otherwise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reins import cli
from reins.cli import app, demo_config

ROOT = Path(__file__).resolve().parents[1]


def test_an_example_is_found_by_name_by_folder_or_by_config_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    recall = Path("examples/recall/config.yaml")
    assert demo_config("recall") == recall
    assert demo_config("examples/recall") == Path("examples/recall") / "config.yaml"
    assert demo_config(str(recall)) == recall
    assert demo_config("no-such-example") is None


def test_an_unknown_example_exits_2_and_lists_the_examples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, ["demo", "--example", "no-such-example"], env=dict(os.environ))
    assert result.exit_code == 2
    assert "no example 'no-such-example'" in result.output
    assert "recall" in result.output.split("examples here:")[1]


@pytest.mark.parametrize(
    ("command", "variable"),
    [
        (["controller"], "REINS_GATEWAY_URL"),
        (["controller"], "REINS_API_KEY"),
        (["export"], "REINS_GATEWAY_URL"),
        (["export"], "REINS_API_KEY"),
    ],
)
def test_an_options_environment_variable_is_named_once_in_help(
    command: list[str], variable: str
) -> None:
    """`reins controller --help` said "[env: REINS_GATEWAY_URL]  [env var: REINS_GATEWAY_URL]"."""
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert result.output.count(variable) == 1, result.output


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_run_name_is_refused(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """`--run-name ""` was read as no name: the run was quietly named `recall-<time>`."""
    monkeypatch.chdir(ROOT)
    trained: list[object] = []  # a run it starts is recorded here, not trained
    monkeypatch.setattr(cli, "_run_training", lambda config, **_: trained.append(config))
    result = CliRunner().invoke(app, ["demo", "--run-name", name], env=dict(os.environ))
    assert result.exit_code == 2, result.output
    assert "error: --run-name is empty: give a name, or leave it out" in result.output
    assert trained == []
