"""OpenAI's model list and model card (`GET .../openai/v1/models[/{model}]`,
`client.models.list()` / `retrieve()`) through the proxy, read by the real `openai` SDK. No
engine answers: the models are only registered (their endpoints are never called)."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import Gateway

NAMES = ["policy", "smollm2:135m-instruct.v1"]


@pytest.fixture
def sdk(gateway: Gateway) -> openai.OpenAI:
    for number, name in enumerate(NAMES):
        registered = gateway.http.post(
            "/api/models", json={"model": name, "endpoint": f"http://127.0.0.1:{9 + number}/v1"}
        )
        assert registered.status_code == 200, registered.text
    base, token = gateway.first_attempt()
    return openai.OpenAI(base_url=f"{base}/openai/v1", api_key=token, max_retries=0)


def test_a_listed_model_is_retrieved_by_its_id_and_an_unknown_one_is_a_404(
    sdk: openai.OpenAI,
) -> None:
    assert sorted(model.id for model in sdk.models.list()) == sorted(NAMES)
    card = sdk.models.retrieve("smollm2:135m-instruct.v1")
    assert (card.id, card.object, card.owned_by) == ("smollm2:135m-instruct.v1", "model", "reins")
    with pytest.raises(openai.NotFoundError, match="not served here") as refused:
        sdk.models.retrieve("gpt-9")
    assert refused.value.code == "model_not_found"
