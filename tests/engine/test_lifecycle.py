"""The embedded engine's requests across its life: which weight version a request reports when a
weight update comes while it waits for a batch slot, and a server shutting down with requests in
flight. A tiny random Llama (built in memory) with the default model's tokenizer, served on
loopback."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from reins.engine.api import WEIGHT_VERSION_HEADER, create_engine_app
from reins.engine.embedded import EmbeddedEngine
from reins.serving import BackgroundServer
from tests.embedded_support import tiny_engine

LONG = 1500
"""Tokens a long answer is made to sample (`min_tokens`: the end of sequence is held back)."""


@pytest.fixture
def served() -> Iterator[tuple[EmbeddedEngine, BackgroundServer]]:
    engine = tiny_engine(max_batch=1)
    server = BackgroundServer(create_engine_app(engine)).start()
    try:
        yield engine, server
    finally:
        server.stop()
        engine.close()


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Runs `work` in a thread; its result (or error) lands in the dict under "result"."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = work()
        except Exception as error:  # shown by the assertion that reads it
            out["result"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], str]:
    with httpx.Client(timeout=120) as client:
        response = client.post(f"{url}/v1/completions", json={"prompt": "Hello there", **body})
        return response.status_code, dict(response.headers), response.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_queued_across_a_weight_update_reports_the_version_it_was_sampled_with(
    served: tuple[EmbeddedEngine, BackgroundServer], stream: bool
) -> None:
    engine, server = served
    body = {"max_tokens": 3, "temperature": 0, "stream": stream}
    with engine.scheduler.holding():  # the request arrives and waits in line
        thread, out = in_thread(lambda: post(server.url, body))
        wait_until(lambda: engine.scheduler.load() == (0, 1), "the request to wait in line")
        with engine.updating_weights(version=7):
            pass  # served as version 7 from now on, before the request's prefill
    thread.join(timeout=120)
    status, headers, text = out["result"]
    assert status == 200, text
    assert headers[WEIGHT_VERSION_HEADER] == "7"
    # A request that arrives after the update reports it too.
    assert post(server.url, body)[1][WEIGHT_VERSION_HEADER] == "7"


def test_a_server_shutting_down_aborts_the_requests_in_flight(
    served: tuple[EmbeddedEngine, BackgroundServer],
) -> None:
    engine, server = served
    chunks: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"prompt": "Hello there", "stream": True, "max_tokens": LONG, "min_tokens": LONG}
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{server.url}/v1/completions", json=body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line.removeprefix("data: "))
                    first_chunk.set()

    streaming, streamed = in_thread(stream)
    assert first_chunk.wait(timeout=60), streamed
    # A second request waits for the one batch slot.
    waiting, waited = in_thread(lambda: post(server.url, {"max_tokens": 2}))
    wait_until(lambda: engine.scheduler.load() == (1, 1), "the second request to wait in line")

    server.stop()
    streaming.join(timeout=60)
    waiting.join(timeout=60)

    assert chunks[-1] == "[DONE]"
    error = json.loads(chunks[-2])["error"]
    assert error["code"] == 503, error
    assert "shutting down" in error["message"]
    sampled = sum(len(json.loads(c)["choices"][0]["token_ids"]) for c in chunks[:-2])
    assert sampled < LONG  # cut short, not run to its end
    status, _, text = waited["result"]
    assert status == 503, text
