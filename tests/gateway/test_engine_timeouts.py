"""An engine that took a call and does not answer within the read timeout may still be
generating it: the call fails once (502, recorded once), and is not sent again, even with
retries left; an engine that cannot be connected to is retried."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from reins.gateway import GatewaySettings
from tests.conftest import ADMIN_KEY, Gateway
from tests.gateway.test_call_failures import MESSAGES, attempt_on_engine, base, calls

READ_TIMEOUT_S = 0.5


@pytest.fixture
def gateway_settings(database_url: str) -> GatewaySettings:
    return GatewaySettings(
        database_url=database_url,
        api_key=ADMIN_KEY,
        proxy_read_timeout_s=READ_TIMEOUT_S,
        proxy_retries=2,
    )


@pytest.fixture
def received() -> list[dict[str, Any]]:
    return []


@pytest.fixture
def token(gateway: Gateway, received: list[dict[str, Any]]) -> Iterator[str]:
    """An engine that counts the calls it receives and answers none in time."""

    async def chat(request: Request) -> Response:
        received.append(await request.json())
        await asyncio.sleep(10 * READ_TIMEOUT_S)
        return JSONResponse({})

    with attempt_on_engine(gateway, chat) as attempt_token:
        yield attempt_token


def test_a_call_the_engine_took_and_did_not_answer_in_time_is_sent_once(
    gateway: Gateway, token: str, received: list[dict[str, Any]]
) -> None:
    client = openai.OpenAI(base_url=f"{base(gateway)}/openai/v1", api_key=token, max_retries=0)
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert len(received) == 1
    says = f"did not answer within {READ_TIMEOUT_S:g} s"
    assert failed.value.status_code == 502 and says in failed.value.message
    (call,) = calls(gateway)
    assert call["status"] == 502 and says in call["error"]
