"""Who may call what: an admin key, and per-attempt scoped tokens for harnesses.

A scoped token is an HMAC of (rollout id, attempt id) under a secret kept in the database, so it
needs no table, survives restarts, and can be handed out again to an admin at any time. It allows
only the proxy and event posts of its own rollout and attempt.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

from fastapi import HTTPException, Request, status

SCOPED_TOKEN_PREFIX = "rk-at-"


@dataclass(frozen=True)
class Principal:
    """The caller: an admin, or a harness holding the token of one attempt."""

    is_admin: bool
    rollout_id: str | None = None
    attempt_id: int | None = None


class Authenticator:
    def __init__(self, api_key: str, secret: bytes) -> None:
        self._api_key = api_key.encode()
        self._secret = secret

    def scoped_token(self, rollout_id: str, attempt_id: int) -> str:
        mac = hmac.new(self._secret, f"{rollout_id}\x00{attempt_id}".encode(), hashlib.sha256)
        return SCOPED_TOKEN_PREFIX + base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")

    def _is_admin(self, token: str) -> bool:
        return hmac.compare_digest(token.encode(), self._api_key)

    def admin(self, request: Request) -> Principal:
        token = bearer_token(request)
        if not self._is_admin(token):
            if token.startswith(SCOPED_TOKEN_PREFIX):
                raise HTTPException(
                    status.HTTP_403_FORBIDDEN,
                    "a rollout's scoped token allows only the proxy and event posts of its own "
                    "attempt; this call needs the admin key",
                )
            raise _unauthorized("the bearer token is not the gateway's admin key")
        return Principal(is_admin=True)

    def attempt(self, request: Request, rollout_id: str, attempt_id: int) -> Principal:
        """The admin, or the holder of exactly this attempt's token."""
        token = bearer_token(request)
        if self._is_admin(token):
            return Principal(is_admin=True)
        expected = self.scoped_token(rollout_id, attempt_id)
        if hmac.compare_digest(token.encode(), expected.encode()):
            return Principal(is_admin=False, rollout_id=rollout_id, attempt_id=attempt_id)
        if token.startswith(SCOPED_TOKEN_PREFIX):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"this scoped token does not belong to rollout {rollout_id} attempt {attempt_id}",
            )
        raise _unauthorized("the bearer token is neither the admin key nor this attempt's token")


def bearer_token(request: Request) -> str:
    """The key of `Authorization: Bearer KEY`, or of `x-api-key: KEY` (Anthropic's clients send
    their key that way)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    api_key = request.headers.get("x-api-key", "").strip()
    if not header and api_key:
        return api_key
    raise _unauthorized(
        "send `Authorization: Bearer <key>` or `x-api-key: <key>` (the admin key or a scoped token)"
    )


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED, message, headers={"WWW-Authenticate": "Bearer"}
    )
