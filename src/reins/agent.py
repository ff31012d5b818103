"""Harness-side helpers: read the environment the controller injects, report rewards and events.

An unmodified harness needs none of this: it reads `OPENAI_BASE_URL` and `OPENAI_API_KEY` like
any OpenAI client. These helpers are for the few lines that grade the result::

    from reins.agent import AgentContext, report_reward

    ctx = AgentContext.from_env()
    ...  # run the harness against ctx.openai_base_url
    report_reward(1.0 if solved else 0.0, reason="tests passed")

Calls are synchronous (harness code is often not async), use the attempt's scoped token (which
may post events to its own attempt and nothing else), and are retried on transport errors and
5xx answers for up to two minutes (`reins.retry`: past a gateway restart) with one idempotency
key chosen before the first try, so a retry is stored once.

This module imports only the standard library: an agent is one short process per attempt, and
on this project's 2-core machines `import httpx` alone costs 0.25-0.35 s of CPU per attempt,
`urllib.request` under 0.1 s.

Coding-agent CLIs (docs/harnesses.md): Claude Code reads `ANTHROPIC_BASE_URL` and the token from
the environment as it is; Codex ignores `OPENAI_BASE_URL` and needs `write_codex_config`; OpenCode
needs `write_opencode_home`. `cli_home_env` gives any of them a home of its own and switches off
every call they would make beyond the proxy (updates, telemetry, model lists, plugin installs).
"""

from __future__ import annotations

import http.client
import json
import numbers
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

from reins.retry import RETRY_FOR_S, retry_delays

Json = Union[dict[str, "Json"], list["Json"], str, int, float, bool, None]  # noqa: UP007

REWARD = "reward"
"""The built-in reward event type (`reins.schemas.REWARD`)."""
TOOL = "tool"
"""A harness's tool use (`reins.schemas.TOOL`)."""

_VARIABLES = {
    "openai_base_url": "OPENAI_BASE_URL",
    "api_key": "OPENAI_API_KEY",
    "gateway_url": "REINS_GATEWAY_URL",
    "rollout_id": "REINS_ROLLOUT_ID",
    "attempt_id": "REINS_ATTEMPT_ID",
    "mode": "REINS_MODE",
    "input": "REINS_INPUT",
}
_OPENAI_SUFFIX = "/openai/v1"

POSTED_CHARS = 100_000
"""The most of a tool's input and output text, and of a reward's reason, that is posted: the
middle of a longer text is left out, with a note saying how long it was (as the sandbox cuts a
command's output). A tool's whole output was posted: past the gateway's body limit the post was
refused, and the agent crashed on it before its reward."""

MAX_EVENT_BYTES = 32 * 1024 * 1024
"""The largest event post sent (`emit_event(max_bytes=...)`): the gateway's default body limit
(its `REINS_MAX_BODY_BYTES`). A larger post is refused at once, before any byte is sent: the
gateway answers 413 to it, and resets a body past 256 MB unread, which was retried for two
minutes as an outage."""


_HEADER_VALUE = re.compile(r"[\x21-\x7e]+")
"""A bearer token as an HTTP header carries it: visible ASCII, no spaces."""
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,199}")
"""The gateway's rollout ids (`reins.schemas.Identifier`; a test holds the two alike): each goes
into the event URL as is."""


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


class AgentEnvError(RuntimeError):
    """The environment lacks what `reins controller` gives every agent."""


class ReportError(RuntimeError):
    """The gateway refused an event (4xx), or kept failing after every retry."""


@dataclass(frozen=True)
class AgentContext:
    """What the controller tells one agent run (docs/controller.md, "The agent's environment")."""

    openai_base_url: str
    """The gateway's proxy for this rollout, attempt and mode; point any OpenAI client here."""
    api_key: str
    """The attempt's scoped token: the proxy and this attempt's event posts, nothing else."""
    gateway_url: str
    rollout_id: str
    attempt_id: int
    mode: str
    """`train` or `val`."""
    input: Json
    """The rollout's input, JSON-decoded."""

    def __post_init__(self) -> None:
        """What every event post needs, checked here: a gateway URL without its scheme was
        retried for two minutes as an outage, and a token with a newline was a bare error."""
        where = urllib.parse.urlsplit(self.gateway_url)
        if where.scheme not in ("http", "https") or not where.netloc:
            raise AgentEnvError(
                f"the gateway URL {self.gateway_url!r} is not an http(s)://HOST:PORT URL "
                "(REINS_GATEWAY_URL)"
            )
        if not self.api_key or not _HEADER_VALUE.fullmatch(self.api_key):
            raise AgentEnvError(
                "the attempt's token (OPENAI_API_KEY) is empty or holds characters no HTTP "
                "header can carry"
            )
        if not self.rollout_id:
            raise AgentEnvError("the rollout id (REINS_ROLLOUT_ID) is empty")
        if not _ROLLOUT_ID.fullmatch(self.rollout_id):
            # A space made every post a bare `http.client.InvalidURL`; a slash posted elsewhere.
            raise AgentEnvError(
                f"the rollout id {self.rollout_id!r} (REINS_ROLLOUT_ID) is not one the gateway "
                "gives: letters, digits and . _ : - (at most 200)"
            )
        if self.mode not in ("train", "val"):
            raise AgentEnvError(f"the mode {self.mode!r} (REINS_MODE) is neither train nor val")
        if isinstance(self.attempt_id, bool) or self.attempt_id < 1:
            raise AgentEnvError(f"the attempt id is {self.attempt_id!r}: attempts count from 1")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AgentContext:
        env = os.environ if environ is None else environ
        missing = [name for name in _VARIABLES.values() if name not in env]
        if missing:
            raise AgentEnvError(
                f"{', '.join(missing)} not set: this code expects to run as an agent launched by "
                "`reins controller`, which sets them (see docs/controller.md)"
            )
        try:
            attempt_id = int(env["REINS_ATTEMPT_ID"])
        except ValueError as error:
            raise AgentEnvError(
                f"REINS_ATTEMPT_ID is {env['REINS_ATTEMPT_ID']!r}, not an integer"
            ) from error
        try:
            value: Json = json.loads(env["REINS_INPUT"], parse_constant=_not_json)
        except ValueError as error:
            raise AgentEnvError(f"REINS_INPUT is not JSON: {error}") from error
        return cls(
            openai_base_url=env["OPENAI_BASE_URL"],
            api_key=env["OPENAI_API_KEY"],
            gateway_url=env["REINS_GATEWAY_URL"].rstrip("/"),
            rollout_id=env["REINS_ROLLOUT_ID"],
            attempt_id=attempt_id,
            mode=env["REINS_MODE"],
            input=value,
        )

    @property
    def anthropic_base_url(self) -> str:
        """The same proxy for Anthropic clients (`ANTHROPIC_BASE_URL`): `.../mode/{mode}/anthropic`,
        under which they call `/v1/messages`."""
        return anthropic_base_url(self.openai_base_url)

    def env(self) -> dict[str, str]:
        """The variables the controller sets for this context (docs/controller.md): what a harness
        started from an agent, or by a test, needs."""
        return {
            "OPENAI_BASE_URL": self.openai_base_url,
            "OPENAI_API_KEY": self.api_key,
            "ANTHROPIC_BASE_URL": self.anthropic_base_url,
            "ANTHROPIC_AUTH_TOKEN": self.api_key,
            "ANTHROPIC_API_KEY": self.api_key,
            "REINS_GATEWAY_URL": self.gateway_url,
            "REINS_ROLLOUT_ID": self.rollout_id,
            "REINS_ATTEMPT_ID": str(self.attempt_id),
            "REINS_MODE": self.mode,
            "REINS_INPUT": json.dumps(self.input, separators=(",", ":")),
        }


def anthropic_base_url(openai_base_url: str) -> str:
    """The gateway proxy's Anthropic base URL beside its OpenAI one (`.../openai/v1` becomes
    `.../anthropic`); Anthropic clients append `/v1/messages` themselves."""
    base = openai_base_url.rstrip("/")
    if not base.endswith(_OPENAI_SUFFIX):
        raise ValueError(
            f"{openai_base_url!r} is not a reins proxy URL: it should end with {_OPENAI_SUFFIX} "
            "(the OPENAI_BASE_URL that `reins controller` sets)"
        )
    return base[: -len(_OPENAI_SUFFIX)] + "/anthropic"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """urllib follows a 301 or 302 of a POST as a GET without its body: the event was never
    posted, and a GET that answered 200 (an admin read, a login page) passed for its ack.
    Refused instead, so the redirect surfaces as an HTTPError."""

    def redirect_request(self, *_: Any, **__: Any) -> None:
        return None


_POSTER = urllib.request.build_opener(_NoRedirects)


def emit_event(
    type: str,
    data: Mapping[str, Json],
    *,
    context: AgentContext | None = None,
    idempotency_key: str | None = None,
    retry_for_s: float = RETRY_FOR_S,
    timeout_s: float = 10.0,
    max_bytes: int = MAX_EVENT_BYTES,
) -> None:
    """Appends one event of `type` to this attempt at the gateway; transport errors and 5xx
    answers are retried for `retry_for_s` (`reins.retry`, past a gateway restart), each try
    with the same idempotency key. A post larger than `max_bytes` (the gateway's default body
    limit) raises `ReportError` at once: trim the data, or raise `max_bytes` to a gateway's own
    larger `REINS_MAX_BODY_BYTES`."""
    ctx = context or AgentContext.from_env()
    key = idempotency_key or uuid.uuid4().hex
    url = f"{ctx.gateway_url}/api/rollouts/{ctx.rollout_id}/attempt/{ctx.attempt_id}/events"
    body = json.dumps({"type": type, "data": dict(data), "idempotency_key": key}).encode()
    if len(body) > max_bytes:
        raise ReportError(
            f"the {type} event is {len(body)} bytes of JSON, over the {max_bytes} bytes one post "
            "may carry (the gateway's body limit): not posted; trim its data (or pass a larger "
            "max_bytes to a gateway whose REINS_MAX_BODY_BYTES is larger)"
        )
    headers = {"Authorization": f"Bearer {ctx.api_key}", "Content-Type": "application/json"}
    problem = ""
    delays = retry_delays(retry_for_s)
    while True:
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with _POSTER.open(request, timeout=timeout_s) as response:
                response.read()
            return
        except urllib.error.HTTPError as error:
            problem = f"{error.code}: {_message(_error_body(error))}"
            if 300 <= error.code < 400:
                where = error.headers.get("Location", "another URL")
                problem = f"{error.code}: redirected to {where}; set the gateway's own URL"
            if error.code < 500:
                raise ReportError(f"the gateway refused the {type} event ({problem})") from error
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
            # Refused, reset, timed out; or an answer cut short (`IncompleteRead`) or garbled
            # (`BadStatusLine`), which are no OSErrors: they escaped as bare tracebacks.
            problem = repr(error)
        delay = next(delays, None)
        if delay is None:
            raise ReportError(
                f"could not post the {type} event to {url} in {retry_for_s:g} s ({problem})"
            )
        time.sleep(delay)


def report_reward(
    value: float,
    *,
    reason: str | None = None,
    source: str = "agent",
    metrics: Mapping[str, float] | None = None,
    context: AgentContext | None = None,
) -> None:
    """Posts this attempt's `reward` event (the trainer reads the last one of the attempt).

    `metrics` are numbers about the episode (searches made, tool calls, answered or not): the
    trainer logs their mean over a step's trained rollouts as `agent/<name>` and over a
    validation as `val/agent/<name>`."""
    data: dict[str, Json] = {"value": _number("the reward", value), "source": source}
    if reason is not None:
        data["reason"] = trimmed(reason, "reason")
    if metrics:
        for name in metrics:
            if not isinstance(name, str):
                raise TypeError(f"metric name {name!r} is not a string")
        data["metrics"] = {name: _number(f"metric {name!r}", n) for name, n in metrics.items()}
    emit_event(REWARD, data, context=context)


def _number(what: str, value: Any) -> float:
    """`value` as a float; a TypeError for what is no number (a bool, a string: `run_agent`
    refuses a returned bool too), a ValueError for an int past a float's range."""
    # Any real number: numpy's scalars (`np.float32`, `np.int64`: a reward computed over
    # arrays) are `numbers.Real` without being Python floats or ints (`run_agent` too).
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} is {value!r}, not a number")
    try:
        return float(value)
    except OverflowError as error:
        raise ValueError(f"{what} is an integer too large for a float") from error


def report_tool(
    name: str,
    input: Json,
    output: str,
    *,
    ok: bool = True,
    seconds: float | None = None,
    context: AgentContext | None = None,
) -> None:
    """Posts a `tool` event: one tool use of the harness (a search and its passages, a shell
    command and its output), shown on the dashboard's rollout page in the calls' timeline.
    An `input` or `output` text longer than `POSTED_CHARS` is posted as its head and tail with
    a note in place of the middle."""
    if isinstance(input, str):
        input = trimmed(input, "input")
    if isinstance(output, str):
        output = trimmed(output, "output")
    data: dict[str, Json] = {"name": name, "input": input, "output": output, "ok": ok}
    if seconds is not None:
        data["seconds"] = round(float(seconds), 4)
    emit_event(TOOL, data, context=context)


def trimmed(text: str, what: str) -> str:
    """`text` itself, or its head and tail with a note in place of the middle past
    `POSTED_CHARS` (as `reins.swe.environment` and the sandbox cut an output)."""
    if len(text) <= POSTED_CHARS:
        return text
    half = POSTED_CHARS // 2
    note = f"\n[... {what} truncated: {len(text)} characters in all, the middle left out ...]\n"
    return text[:half] + note + text[len(text) - half :]


def _error_body(error: urllib.error.HTTPError) -> bytes:
    """The body of an error answer, or what arrived of it before the connection was cut."""
    try:
        return error.read()
    except http.client.IncompleteRead as cut:
        return cut.partial
    except (OSError, http.client.HTTPException):
        return b""


def _message(body: bytes) -> str:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:300].decode(errors="replace")
    if isinstance(parsed, dict) and "error" in parsed:
        return str(parsed["error"])
    return str(parsed)[:300]


# --- Coding-agent CLIs (docs/harnesses.md) -------------------------------------------------------

CLI_VERSIONS: Mapping[str, str] = {
    "@anthropic-ai/claude-code": "2.1.197",
    "@openai/codex": "0.171.0",
    "opencode-ai": "1.18.33",
}
"""The npm packages and versions `scripts/install-cli-harnesses.sh` pins (a test keeps them equal):
the configurations below were checked against these versions."""

OpenCodeProvider = Literal["chat", "responses", "messages"]
"""OpenCode's three ways to reach the proxy: chat completions, the Responses API, Anthropic
Messages."""

OPENCODE_PACKAGES: Mapping[str, str] = {
    "chat": "@ai-sdk/openai-compatible",
    "responses": "@ai-sdk/openai",
    "messages": "@ai-sdk/anthropic",
}
"""The AI SDK provider package (bundled in OpenCode, no install) that speaks each wire API."""

_OFFLINE = {
    # Claude Code: the one switch that removes every call beyond the API (bootstrap, MCP
    # registry, metrics, event logging); the other three are subsets of it, kept for older builds.
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    # OpenCode: the models.dev catalogue, self-update, LSP server downloads, share links. Its npm
    # install of a plugin is stopped by the seeded config folder (`write_opencode_home`).
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    # Codex has no such variables: its plugin sync and analytics are off in `write_codex_config`.
}


def cli_home_env(home: str | Path) -> dict[str, str]:
    """Creates `home` (and `home/tmp`) and returns the variables that keep a coding-agent CLI there
    and on the proxy: HOME, TMPDIR, the XDG folders and CODEX_HOME inside it, and the switches
    that stop Claude Code's and OpenCode's own outbound calls.

    Add them to an environment that already holds the proxy's variables (`AgentContext.env()`,
    which the controller sets). A fresh home per run keeps runs apart: these CLIs keep sessions,
    caches and config in HOME, and write to TMPDIR (OpenCode a 5 MB library per run).
    """
    root = Path(home).resolve()
    tmp = root / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {
        "HOME": str(root),
        "TMPDIR": str(tmp),
        "XDG_CONFIG_HOME": str(root / ".config"),
        "XDG_DATA_HOME": str(root / ".local" / "share"),
        "XDG_STATE_HOME": str(root / ".local" / "state"),
        "XDG_CACHE_HOME": str(root / ".cache"),
        "CODEX_HOME": str(root / ".codex"),
        **_OFFLINE,
    }


def codex_config(
    base_url: str,
    model: str,
    *,
    env_key: str = "OPENAI_API_KEY",
    instructions_file: str | Path | None = None,
    lean: bool = False,
) -> str:
    """Codex's `config.toml` for the proxy at `base_url` (the proxy's OpenAI base, `.../openai/v1`).

    Codex ignores `OPENAI_BASE_URL` (it would call its vendor's API), so the proxy is a provider of
    its own, `local`, speaking the Responses API (`wire_api = "chat"` is refused by Codex), with the
    key read from `env_key`. Update checks, analytics, feedback and plugins (which fetch a
    plugin catalogue from three hosts) are off: with them, Codex makes no call but the model's.

    `instructions_file` replaces Codex's 17k-character system prompt. `lean` also drops the
    permission, environment and skills sections, web search, the user-question tool, multi-agent
    and goals: about 4.6k characters of request in all, for small-context models.
    """
    top: dict[str, str | bool] = {
        "model": model,
        "model_provider": "local",
        "check_for_update_on_startup": False,
    }
    if instructions_file is not None:
        top["model_instructions_file"] = str(Path(instructions_file).resolve())
    features: dict[str, str | bool] = {"plugins": False}
    tables: dict[str, dict[str, str | bool]] = {
        "model_providers.local": {
            "name": "reins gateway",
            "base_url": base_url.rstrip("/"),
            "env_key": env_key,
            "wire_api": "responses",
        },
        "analytics": {"enabled": False},
        "feedback": {"enabled": False},
        "features": features,
    }
    if lean:
        top.update(
            include_permissions_instructions=False,
            include_environment_context=False,
            web_search="disabled",
        )
        features.update(multi_agent=False, goals=False)
        tables["skills"] = {"include_instructions": False}
        tables["tools.experimental_request_user_input"] = {"enabled": False}
    lines = [f"{key} = {_toml(value)}" for key, value in top.items()]
    for name, table in tables.items():
        lines += ["", f"[{name}]", *(f"{key} = {_toml(value)}" for key, value in table.items())]
    return "\n".join(lines) + "\n"


def write_codex_config(codex_home: str | Path, base_url: str, model: str, **options: Any) -> Path:
    """Writes `codex_config(base_url, model, **options)` as `codex_home/config.toml` (CODEX_HOME;
    `cli_home_env` puts it at `HOME/.codex`) and returns its path."""
    folder = Path(codex_home)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.toml"
    path.write_text(codex_config(base_url, model, **options))
    return path


def opencode_config(
    provider: OpenCodeProvider,
    base_url: str,
    model: str,
    *,
    api_key_env: str | None = None,
    context_limit: int = 32768,
    output_limit: int = 4096,
    prompt: str | None = None,
    tools: Sequence[str] | None = None,
) -> dict[str, Json]:
    """OpenCode's `opencode.json` for the proxy (`base_url` is its OpenAI base, `.../openai/v1`):
    one provider, `local`, whose only model is `model`, used for titles too.

    `provider` picks the wire API: `chat` and `responses` call `base_url`, `messages` calls the
    Anthropic base plus `/v1` (OpenCode's Anthropic SDK wants the `/v1` in its base URL, unlike
    Claude Code). The key comes from `api_key_env` (default OPENAI_API_KEY, ANTHROPIC_API_KEY for
    `messages`: the controller sets both to the scoped token). `output_limit` is the `max_tokens`
    it asks for; `prompt` replaces the agent's system prompt (about 9.6k characters); `tools`
    keeps only the named tools (of bash, edit, glob, grep, read, skill, task, todowrite, webfetch,
    write).
    """
    if provider not in OPENCODE_PACKAGES:
        raise ValueError(
            f"provider must be one of {', '.join(OPENCODE_PACKAGES)}, not {provider!r}"
        )
    endpoint = base_url.rstrip("/")
    if provider == "messages":
        endpoint = anthropic_base_url(base_url) + "/v1"
    key = api_key_env or ("ANTHROPIC_API_KEY" if provider == "messages" else "OPENAI_API_KEY")
    config: dict[str, Json] = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "local": {
                "npm": OPENCODE_PACKAGES[provider],
                "name": "reins gateway",
                "options": {"baseURL": endpoint, "apiKey": "{env:" + key + "}"},
                "models": {
                    model: {
                        "name": model,
                        "limit": {"context": context_limit, "output": output_limit},
                    }
                },
            }
        },
        "model": f"local/{model}",
        "small_model": f"local/{model}",
        "autoupdate": False,
        "share": "disabled",
    }
    if prompt is not None:
        config["agent"] = {"build": {"prompt": prompt}}
    if tools is not None:
        config["tools"] = {"*": False, **dict.fromkeys(tools, True)}
    return config


def write_opencode_home(home: str | Path, config: Mapping[str, Json]) -> Path:
    """Writes `config` as `home/.config/opencode/opencode.json` and seeds that folder so OpenCode
    finds its plugin package installed (otherwise every run starts `npm install
    @opencode-ai/plugin` there, a registry call); returns the config's path. `home` is the HOME
    of `cli_home_env`."""
    folder = Path(home) / ".config" / "opencode"
    (folder / "node_modules").mkdir(parents=True, exist_ok=True)
    plugin = {"@opencode-ai/plugin": CLI_VERSIONS["opencode-ai"]}
    (folder / "package.json").write_text(json.dumps({"dependencies": plugin}))
    lock = {"lockfileVersion": 3, "packages": {"": {"dependencies": plugin}}}
    (folder / "package-lock.json").write_text(json.dumps(lock))
    path = folder / "opencode.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def _toml(value: str | bool) -> str:
    """A TOML value: JSON's string escapes are TOML basic-string escapes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)
