"""Stop strings over HTTP with vLLM's `include_stop_str_in_output`: the answer ends before the
stop string by default, after it when asked, and its token IDs are always those of its text. A
tiny random Llama (seeded, so its answer is known in advance) with the default tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from reins.engine.api import create_engine_app
from reins.engine.embedded import EmbeddedEngine
from reins.serving import BackgroundServer
from tests.embedded_support import tiny_engine


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[EmbeddedEngine, str]]:
    engine = tiny_engine()
    server = BackgroundServer(create_engine_app(engine)).start()
    try:
        yield engine, server.url
    finally:
        server.stop()
        engine.close()


def complete(url: str, **body: Any) -> dict[str, Any]:
    body = {"prompt": "The weather today", "temperature": 1.0, "seed": 7, "max_tokens": 8, **body}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]  # type: ignore[no-any-return]


def test_include_stop_str_in_output_ends_the_answer_after_its_stop_string(
    served: tuple[EmbeddedEngine, str],
) -> None:
    engine, url = served
    whole = complete(url)
    # The stop: the text of the first token that is not in the text before it (a stop string
    # that starts a token: nothing before it is cut).
    tokens = whole["token_ids"]
    at = next(
        i
        for i in range(1, len(tokens))
        if engine.decode(tokens[i : i + 1]).strip()
        and engine.decode(tokens[i : i + 1]) not in engine.decode(tokens[: i + 1])[:-1]
    )
    stop, expected = engine.decode(tokens[at : at + 1]), engine.decode(tokens[:at])

    cut = complete(url, stop=[stop])
    assert (cut["text"], cut["stop_reason"]) == (expected, stop)

    kept = complete(url, stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == expected + stop
    assert kept["token_ids"] == tokens[: at + 1]
    assert engine.decode(kept["token_ids"]) == kept["text"]
    assert (kept["finish_reason"], kept["stop_reason"]) == ("stop", stop)


def test_include_stop_str_in_output_must_be_a_boolean(served: tuple[EmbeddedEngine, str]) -> None:
    _, url = served
    body = {"prompt": "Hi", "max_tokens": 2, "include_stop_str_in_output": "yes"}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 400
    assert "include_stop_str_in_output" in response.json()["error"]["message"]
