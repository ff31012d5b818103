"""The embedded engine in the test process: the default model behind its OpenAI API on loopback.

Loading the default model takes about 3 s on two cores, so the tiers that use it (`tests/engine`,
`tests/harness`) each hold one engine for the whole session.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from reins.engine.api import create_engine_app
from reins.engine.embedded import EmbeddedEngine
from reins.serving import BackgroundServer
from tests.tiny_model import default_tokenizer, tiny_llama

# Nothing outside this machine can be reached: the model comes from the local cache only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass
class ServedEngine:
    """An `EmbeddedEngine` and the uvicorn server (a thread of this process) that serves it."""

    engine: EmbeddedEngine
    server: BackgroundServer

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (`.../v1`)."""
        return f"{self.server.url}/v1"

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def idle(self) -> bool:
        """No sequence running or waiting."""
        return self.engine.scheduler.load() == (0, 0)


def tiny_engine(**options: Any) -> EmbeddedEngine:
    """A tiny random Llama (`tests.tiny_model`; built in memory, milliseconds a step) with the
    default model's tokenizer and `LlamaConfig`'s own bos and padding ids; `options` go to
    `EmbeddedEngine`."""
    tokenizer = default_tokenizer()
    model = tiny_llama(tokenizer, tokenizer_bos_and_pad=False)
    return EmbeddedEngine(model.eval(), tokenizer, name="tiny", **options)


@contextlib.contextmanager
def served_engine(**options: Any) -> Iterator[ServedEngine]:
    """The default model (prepared once into the local cache, never from a hub), served;
    `options` go to `EmbeddedEngine.load` (`dtype=...`)."""
    with serving(EmbeddedEngine.load(**options)) as served:
        yield served


@contextlib.contextmanager
def serving(engine: EmbeddedEngine) -> Iterator[ServedEngine]:
    """`engine` served on a loopback port; closed after."""
    server = BackgroundServer(create_engine_app(engine)).start()
    try:
        yield ServedEngine(engine, server)
    finally:
        server.stop()
        engine.close()


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def weather_call(city: str, call_id: str) -> dict[str, Any]:
    """An assistant message that calls `get_weather` for `city`."""
    arguments = json.dumps({"city": city})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments},
            }
        ],
    }


FEW_SHOT_TOOL_USE = [
    {"role": "user", "content": "Weather in Rome?"},
    weather_call("Rome", "call_1"),
    {"role": "user", "content": "Weather in Oslo?"},
    weather_call("Oslo", "call_2"),
    {"role": "user", "content": "Weather in Paris?"},
]
"""A history in which the assistant always answered with a tool call (a 135M model rarely makes
one on its own): greedy decoding makes the default model answer the last question with a
`<tool_call>` for Paris."""
