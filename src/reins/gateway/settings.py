"""Gateway settings: flags on `reins gateway`, or `REINS_*` environment variables."""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from reins.gateway.capture import SamplingPolicy

DEFAULT_DB_PATH = Path(".reins") / "gateway.db"


_ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg"}
"""The driver the gateway serves each database through: SQLAlchemy's blocking ones (the
`sqlite+pysqlite://` or `postgresql+psycopg2://` of most guides) failed its start with a
traceback (no async driver, or a module not installed)."""


def database_url(value: str) -> str:
    """Accept a SQLAlchemy URL (any driver of SQLite or PostgreSQL), a plain `postgresql://` URL
    or a SQLite file path (`~` is the home folder, in a `sqlite:///` URL too)."""
    scheme, found, rest = value.partition("://")
    if not found:
        return f"sqlite+aiosqlite:///{Path(value).expanduser()}"
    backend = scheme.partition("+")[0]
    if backend == "postgres":
        backend = "postgresql"
    if backend == "sqlite":
        # Not parsed as a URL: a file's name may hold what a URL reads otherwise (`@`, `?`).
        path = rest.removeprefix("/")
        return f"sqlite+aiosqlite:///{Path(path).expanduser() if path.startswith('~') else path}"
    if backend in _ASYNC_DRIVERS:
        value = f"{_ASYNC_DRIVERS[backend]}://{rest}"
    try:
        url = sa.make_url(value)
    except (ValueError, sa.exc.ArgumentError) as error:  # a port that is no number, a bad host
        raise ValueError(
            f"not a database URL ({error}): give a SQLite file path or "
            "postgresql://USER:PASSWORD@HOST:PORT/DATABASE"
        ) from None
    if url.drivername == "postgresql+asyncpg" and "sslmode" in url.query:
        # libpq's name for it; asyncpg takes the same values as `ssl`.
        query = {key: value for key, value in url.query.items() if key != "sslmode"}
        url = url.set(query={**query, "ssl": url.query["sslmode"]})
        value = url.render_as_string(hide_password=False)
    return value


class GatewaySettings(BaseSettings):
    """Everything the gateway needs; defaults are the embedded single-machine setup."""

    model_config = SettingsConfigDict(env_prefix="REINS_", extra="ignore")

    database_url: str = Field(default=str(DEFAULT_DB_PATH))
    """SQLite file path or URL (embedded default), or `postgresql://...` for several nodes."""
    api_key: str = Field(default_factory=lambda: "rk-admin-" + secrets.token_urlsafe(24))
    """Admin key for the trainer and the controller (`Authorization: Bearer KEY`)."""

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, key: str) -> str:
        # An empty key let anyone in at the dashboard's login (the empty password matches) and
        # made its session cookie a value anyone can compute; a key with outer spaces could
        # never match, since headers are read stripped.
        if not key.strip():
            raise ValueError(
                "the admin key is empty; set a key, or leave REINS_API_KEY and --api-key unset "
                "for a random one (printed at start)"
            )
        if key != key.strip():
            raise ValueError("the admin key starts or ends with white space, which no header keeps")
        if not key.isascii() or not key.isprintable():
            # A header carries Latin-1 at most: a UTF-8 key sent by a client never matched.
            raise ValueError("the admin key must be printable ASCII (a header carries no other)")
        return key

    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    """Larger request bodies get 413."""
    sqlite_synchronous: Literal["NORMAL", "FULL"] = "NORMAL"
    """NORMAL survives a killed gateway process (WAL); FULL also survives a power loss."""
    sqlite_event_writer: Literal["process", "thread"] = "process"
    """Where a SQLite file's event commits run: a writer process of their own (more event posts
    per second: 0.23-0.32x the `/healthz` floor against 0.15-0.18x with 16-64 clients on 2
    cores), or a thread of the gateway's (on 2 cores, ~15 % more proxied calls per second at
    16 at once: there the writer process takes a core's share from the engine;
    docs/benchmarks.md)."""
    max_page_size: int = Field(default=1000, ge=1)
    """Most rollouts one `GET /api/rollouts` page returns (an events read takes its own
    `limit`, up to 100,000)."""
    train_sampling: SamplingPolicy = Field(
        default_factory=lambda: SamplingPolicy(set={"temperature": 1.0, "top_p": 1.0})
    )
    """Sampling applied to `train` calls: the policy's own distribution, so logprobs are its own.
    Fields a harness sends that change the sampled distribution (`top_k`, `min_p`, the penalties,
    `logit_bias`, `min_tokens`...: `capture.DISTRIBUTION_CHANGING`) are removed from `train`
    calls, with a note in the call's record, unless this policy sets them."""
    val_sampling: SamplingPolicy = Field(default_factory=SamplingPolicy)
    """Sampling applied to `val` calls; by default the harness's own settings."""
    admission_max_wait_s: float = Field(default=600.0, gt=0)
    """How long a call waits at a paused gateway before it gets 503 with Retry-After."""
    replica_timeout_s: float = Field(default=10.0, gt=0)
    """Gateway processes on one database hold a pause together; one silent this long (killed)
    no longer holds a drain."""
    proxy_retries: int = Field(default=3, ge=0)
    """Retries of a call whose engine could not be reached or closed the connection (backoff,
    next endpoint); not of one it took and did not answer in time (`proxy_read_timeout_s`)."""
    proxy_read_timeout_s: float = Field(default=3600.0, gt=0)
    """Longest an engine may go silent in one call (before its answer, or between a stream's
    chunks); past it the call fails (502), not retried."""
    token_reuse: bool = True
    """Token reuse: a chat call whose messages extend an earlier call of its attempt (that call's
    messages, its answer, new messages) is prompted with that call's prompt and response token
    IDs + the rendering of only the new messages, so the rollout merges into one training
    sequence (docs/proxy.md). On by default: measured, it turns `retokenized` splits into merged
    rollouts (docs/benchmarks.md); an engine that cannot take a token-ID prompt renders as
    usual. `REINS_TOKEN_REUSE=false` renders every prompt from the template."""
    runs_dir: Path = Path(".reins") / "runs"
    """Where the dashboard finds training runs: `<runs_dir>/<run>/metrics.jsonl`."""
    monitor_tokenizer: str | None = None
    """A tokenizer folder (the policy's): the dashboard then shows token text and text-based
    split reasons (needs `transformers`)."""

    @field_validator("database_url")
    @classmethod
    def _normalize_url(cls, value: str) -> str:
        return database_url(value)

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


class SettingsRefused(ValueError):
    """A flag or a `REINS_*` variable the gateway cannot use; the message names each one."""


def load_settings(**fields: Any) -> GatewaySettings:
    """`GatewaySettings(**fields)` with the `REINS_*` variables, each refusal said in one line
    that names the setting and its variable (a `SettingsRefused`), not pydantic's dump or the
    traceback of a variable that is not the JSON its field takes."""
    try:
        return GatewaySettings(**fields)
    except ValidationError as error:
        problems = [
            f"{_setting(*(str(part) for part in problem['loc']))}: "
            + problem["msg"].removeprefix("Value error, ")
            for problem in error.errors()
        ]
        raise SettingsRefused("; ".join(problems)) from None
    except SettingsError as error:  # REINS_TRAIN_SAMPLING='{bad json'
        found = re.search(r'field "(\w+)"', str(error))
        name = found.group(1) if found else "a setting"
        cause = f": {error.__cause__}" if error.__cause__ else ""
        raise SettingsRefused(f"{_setting(name)} is not the JSON it takes{cause}") from None


def _setting(name: str = "", *inner: str) -> str:
    """`train_sampling.temperature (REINS_TRAIN_SAMPLING)`: where, and the variable to fix."""
    return f"{'.'.join((name, *inner))} (REINS_{name.upper()})"
