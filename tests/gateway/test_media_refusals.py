"""An image sent to the embedded engine (a text model) through the gateway is refused in each wire
API's own shape, naming where it is and not quoting its data: the chat refusal quoted the whole
content part, so a screenshot's data URL (megabytes) became the harness's error message and the
recorded error. Real components: the gateway, the embedded engine (a tiny random Llama with the
default model's real tokenizer and chat template), the `openai` and `anthropic` SDKs."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import Gateway
from tests.embedded_support import serving, tiny_engine

IMAGE_DATA = base64.b64encode(bytes(range(256)) * 4096).decode()
"""1 MiB of image bytes, as base64."""
IMAGE_URL = f"data:image/png;base64,{IMAGE_DATA}"


@contextlib.contextmanager
def proxy_on_tiny_engine(gateway: Gateway) -> Iterator[tuple[str, str]]:
    """The tiny embedded engine registered as model `tiny`; (attempt URL, token) of rollout `r`."""
    with serving(tiny_engine()) as served:
        gateway.http.post("/api/models", json={"model": "tiny", "endpoint": served.base_url})
        yield gateway.first_attempt()


def recorded_errors(gateway: Gateway) -> list[tuple[int, str]]:
    events = gateway.http.get("/api/rollouts/r/events", params={"type": "model_request"}).json()
    return [(event["data"]["status"], event["data"]["error"]) for event in events]


def chat_image(sdk: openai.OpenAI) -> None:
    image: Any = {"type": "image_url", "image_url": {"url": IMAGE_URL}}
    sdk.chat.completions.create(
        model="tiny",
        max_tokens=2,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}],
    )


def responses_image(sdk: openai.OpenAI) -> None:
    parts: Any = [{"type": "input_text", "text": "What?"}]
    parts.append({"type": "input_image", "image_url": IMAGE_URL, "detail": "auto"})
    sdk.responses.create(
        model="tiny", max_output_tokens=16, store=False, input=[{"role": "user", "content": parts}]
    )


@pytest.mark.parametrize(
    ("ask", "where"),
    [(chat_image, "messages[0].content[1]"), (responses_image, "input[0].content[1]")],
    ids=["chat", "responses"],
)
def test_an_openai_clients_image_is_a_400_naming_its_place_not_its_data(
    gateway: Gateway, ask: Any, where: str
) -> None:
    with proxy_on_tiny_engine(gateway) as (url, token):
        sdk = openai.OpenAI(base_url=f"{url}/openai/v1", api_key=token, max_retries=0)
        with pytest.raises(openai.BadRequestError) as raised:
            ask(sdk)
    message = raised.value.message
    assert where in message and "text models" in message
    assert IMAGE_DATA[:64] not in message and len(message) < 500
    ((status, error),) = recorded_errors(gateway)
    assert status == 400 and where in error
    assert IMAGE_DATA[:64] not in error and len(error) < 500


def test_an_anthropic_clients_image_is_a_400_naming_its_place_not_its_data(
    gateway: Gateway,
) -> None:
    image: Any = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": IMAGE_DATA},
    }
    with proxy_on_tiny_engine(gateway) as (url, token):
        sdk = anthropic.Anthropic(base_url=f"{url}/anthropic", api_key=token, max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as raised:
            sdk.messages.create(
                model="tiny",
                max_tokens=2,
                messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}],
            )
    message = raised.value.body["error"]["message"]  # type: ignore[index]
    assert "messages[0].content[1]" in message and "text models" in message
    assert IMAGE_DATA[:64] not in message and len(message) < 500
    ((status, error),) = recorded_errors(gateway)
    assert status == 400 and IMAGE_DATA[:64] not in error
