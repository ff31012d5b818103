"""`reins.agent`'s coding-agent CLI helpers: the files they write parse and point at the proxy,
and the environment keeps a CLI in its home with its outbound calls off. The CLIs themselves run
in tests/harness/test_cli_*.py."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from reins.agent import (
    CLI_VERSIONS,
    OPENCODE_PACKAGES,
    AgentContext,
    anthropic_base_url,
    cli_home_env,
    codex_config,
    opencode_config,
    write_codex_config,
    write_opencode_home,
)

ROOT = Path(__file__).resolve().parents[2]
PROXY = "http://127.0.0.1:8181/proxy/rollout/r-7/attempt/2/mode/val"
OPENAI = f"{PROXY}/openai/v1"


def context() -> AgentContext:
    return AgentContext(
        openai_base_url=OPENAI,
        api_key="rk-at-secret",
        gateway_url="http://127.0.0.1:8181",
        rollout_id="r-7",
        attempt_id=2,
        mode="val",
        input={"task": [1, "two"]},
    )


def test_the_anthropic_base_url_sits_beside_the_openai_one() -> None:
    assert anthropic_base_url(OPENAI) == f"{PROXY}/anthropic"
    assert anthropic_base_url(OPENAI + "/") == f"{PROXY}/anthropic"
    assert context().anthropic_base_url == f"{PROXY}/anthropic"
    with pytest.raises(ValueError, match="not a reins proxy URL"):
        anthropic_base_url("http://127.0.0.1:8181/v1")


def test_env_is_the_controller_contract_and_reads_back() -> None:
    env = context().env()
    assert env["ANTHROPIC_BASE_URL"] == f"{PROXY}/anthropic"
    assert env["ANTHROPIC_AUTH_TOKEN"] == env["ANTHROPIC_API_KEY"] == env["OPENAI_API_KEY"]
    assert env["OPENAI_API_KEY"] == "rk-at-secret"
    assert AgentContext.from_env(env) == context()


def test_cli_home_env_keeps_everything_in_the_home_and_switches_traffic_off(
    tmp_path: Path,
) -> None:
    env = cli_home_env(tmp_path / "h")
    home = (tmp_path / "h").resolve()
    assert env["HOME"] == str(home) and Path(env["TMPDIR"]).is_dir()
    for name in ("TMPDIR", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "CODEX_HOME"):
        assert Path(env[name]).is_relative_to(home), name
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert env["OPENCODE_DISABLE_MODELS_FETCH"] == env["OPENCODE_DISABLE_AUTOUPDATE"] == "1"


def test_codex_config_is_a_responses_provider_at_the_proxy_with_calls_off(tmp_path: Path) -> None:
    config = tomllib.loads(codex_config(OPENAI + "/", "tiny", env_key="MY_KEY"))
    assert config["model"] == "tiny" and config["model_provider"] == "local"
    assert config["model_providers"]["local"] == {
        "name": "reins gateway",
        "base_url": OPENAI,
        "env_key": "MY_KEY",
        "wire_api": "responses",
    }
    assert config["check_for_update_on_startup"] is False
    assert config["analytics"] == {"enabled": False} == config["feedback"]
    assert config["features"] == {"plugins": False}
    assert "model_instructions_file" not in config and "skills" not in config


def test_codex_lean_config_drops_the_big_prompt_parts(tmp_path: Path) -> None:
    instructions = tmp_path / "short.md"
    path = write_codex_config(
        tmp_path / "codex", OPENAI, 'odd "name"', instructions_file=instructions, lean=True
    )
    assert path == tmp_path / "codex" / "config.toml"
    config = tomllib.loads(path.read_text())
    assert config["model"] == 'odd "name"'
    assert config["model_instructions_file"] == str(instructions.resolve())
    assert config["include_permissions_instructions"] is False
    assert config["include_environment_context"] is False
    assert config["web_search"] == "disabled"
    assert config["features"] == {"plugins": False, "multi_agent": False, "goals": False}
    assert config["skills"] == {"include_instructions": False}
    assert config["tools"] == {"experimental_request_user_input": {"enabled": False}}


@pytest.mark.parametrize(
    ("provider", "base", "key"),
    [
        ("chat", OPENAI, "OPENAI_API_KEY"),
        ("responses", OPENAI, "OPENAI_API_KEY"),
        ("messages", f"{PROXY}/anthropic/v1", "ANTHROPIC_API_KEY"),
    ],
)
def test_opencode_config_per_provider(provider: str, base: str, key: str) -> None:
    written = opencode_config(provider, OPENAI, "tiny", output_limit=64)  # type: ignore[arg-type]
    config = json.loads(json.dumps(written))
    local = config["provider"]["local"]
    assert local["npm"] == OPENCODE_PACKAGES[provider]
    assert local["options"] == {"baseURL": base, "apiKey": "{env:" + key + "}"}
    assert local["models"]["tiny"]["limit"] == {"context": 32768, "output": 64}
    assert config["model"] == config["small_model"] == "local/tiny"
    assert config["autoupdate"] is False and config["share"] == "disabled"
    assert "agent" not in config and "tools" not in config


def test_opencode_config_replaces_the_prompt_and_keeps_only_named_tools() -> None:
    config = opencode_config("chat", OPENAI, "tiny", prompt="Be brief.", tools=["bash"])
    assert config["agent"] == {"build": {"prompt": "Be brief."}}
    assert config["tools"] == {"*": False, "bash": True}
    with pytest.raises(ValueError, match="provider must be one of chat, responses, messages"):
        opencode_config("completions", OPENAI, "tiny")  # type: ignore[arg-type]


def test_opencode_home_is_seeded_so_no_plugin_install_runs(tmp_path: Path) -> None:
    config = opencode_config("messages", OPENAI, "tiny")
    path = write_opencode_home(tmp_path, config)
    folder = tmp_path / ".config" / "opencode"
    assert path == folder / "opencode.json"
    assert json.loads(path.read_text()) == config
    plugin = {"@opencode-ai/plugin": CLI_VERSIONS["opencode-ai"]}
    assert json.loads((folder / "package.json").read_text()) == {"dependencies": plugin}
    lock = json.loads((folder / "package-lock.json").read_text())
    assert lock["packages"][""]["dependencies"] == plugin
    assert (folder / "node_modules").is_dir()


def test_the_pinned_versions_are_the_install_scripts() -> None:
    script = (ROOT / "scripts" / "install-cli-harnesses.sh").read_text()
    pins = dict(re.findall(r'^([A-Z_]+_VERSION)="([^"]+)"', script, re.MULTILINE))
    assert pins == {
        "CLAUDE_CODE_VERSION": CLI_VERSIONS["@anthropic-ai/claude-code"],
        "CODEX_VERSION": CLI_VERSIONS["@openai/codex"],
        "OPENCODE_VERSION": CLI_VERSIONS["opencode-ai"],
    }
