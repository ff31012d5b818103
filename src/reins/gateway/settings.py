"""Gateway settings: flags on `reins gateway`, or `REINS_*` environment variables."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DB_PATH = Path(".reins") / "gateway.db"


def database_url(value: str) -> str:
    """Accept a SQLAlchemy URL, a plain `postgresql://` URL or a SQLite file path."""
    if value.startswith(("postgresql://", "postgres://")):
        return "postgresql+asyncpg://" + value.split("://", 1)[1]
    if value.startswith("sqlite:///"):
        return "sqlite+aiosqlite:///" + value.removeprefix("sqlite:///")
    if "://" in value:
        return value
    return f"sqlite+aiosqlite:///{Path(value).expanduser()}"


class GatewaySettings(BaseSettings):
    """Everything the gateway needs; defaults are the embedded single-machine setup."""

    model_config = SettingsConfigDict(env_prefix="REINS_", extra="ignore")

    database_url: str = Field(default=str(DEFAULT_DB_PATH))
    """SQLite file path or URL (embedded default), or `postgresql://...` for several nodes."""
    api_key: str = Field(default_factory=lambda: "rk-admin-" + secrets.token_urlsafe(24))
    """Admin key for the trainer and the controller (`Authorization: Bearer KEY`)."""
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    """Larger request bodies get 413."""
    sqlite_synchronous: Literal["NORMAL", "FULL"] = "NORMAL"
    """NORMAL survives a killed gateway process (WAL); FULL also survives a power loss."""
    max_page_size: int = Field(default=1000, ge=1)
    """Most rollouts or events one list call returns."""

    @field_validator("database_url")
    @classmethod
    def _normalize_url(cls, value: str) -> str:
        return database_url(value)

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")
