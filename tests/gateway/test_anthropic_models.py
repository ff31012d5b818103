"""Anthropic's model list (`GET .../anthropic/v1/models`, `client.models.list()`) through the
proxy, read by the real `anthropic` SDK. No engine answers: the models are only registered (their
endpoints are never called)."""

from __future__ import annotations

import anthropic
import pytest

from tests.conftest import Gateway

NAMES = ["policy", "smollm2:135m-instruct.v1", "critic"]


@pytest.fixture
def sdk(gateway: Gateway) -> anthropic.Anthropic:
    for number, name in enumerate(NAMES):
        registered = gateway.http.post(
            "/api/models", json={"model": name, "endpoint": f"http://127.0.0.1:{9 + number}/v1"}
        )
        assert registered.status_code == 200, registered.text
    base, token = gateway.first_attempt()
    return anthropic.Anthropic(base_url=f"{base}/anthropic", api_key=token, max_retries=0)


def registered(gateway: Gateway) -> list[str]:
    return [model["model"] for model in gateway.http.get("/api/models").json()]


def test_the_sdk_lists_every_registered_model_page_by_page(
    gateway: Gateway, sdk: anthropic.Anthropic
) -> None:
    order = registered(gateway)
    assert sorted(order) == sorted(NAMES)
    first = sdk.models.list(limit=2)
    assert [model.id for model in first.data] == order[:2]
    assert first.has_more is True
    assert [model.id for model in sdk.models.list(limit=2)] == order  # the SDK follows `last_id`
    assert [model.id for model in sdk.models.list()] == order
    last = sdk.models.list(after_id=order[1])
    assert ([m.id for m in last.data], last.has_more) == (order[2:], False)
    before = sdk.models.list(before_id=order[2], limit=1)
    assert ([m.id for m in before.data], before.has_more) == ([order[1]], True)
    assert (before.first_id, before.last_id) == (order[1], order[1])


def test_one_model_by_its_id_and_an_unknown_one_is_a_404(sdk: anthropic.Anthropic) -> None:
    model = sdk.models.retrieve("smollm2:135m-instruct.v1")
    assert (model.id, model.display_name, model.type) == (
        "smollm2:135m-instruct.v1",
        "smollm2:135m-instruct.v1",
        "model",
    )
    with pytest.raises(anthropic.NotFoundError, match="not served here"):
        sdk.models.retrieve("claude-opus-4-8")


def test_a_bad_page_request_is_a_400_in_anthropic_shape(sdk: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="after_id: no served model"):
        sdk.models.list(after_id="nobody")
    with pytest.raises(anthropic.BadRequestError) as raised:
        sdk.models.list(limit=0)
    assert raised.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_the_list_needs_the_attempts_token(gateway: Gateway, sdk: anthropic.Anthropic) -> None:
    stranger = anthropic.Anthropic(base_url=str(sdk.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.models.list()
