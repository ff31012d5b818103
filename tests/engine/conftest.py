"""Fixtures of the real-engine tier: one vLLM server for the whole session (about a minute to
start on two cores), and the default model's tokenizer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from reins.engine.prepare import prepare_default_model
from tests.vllm_support import INSTALL_HINT, VllmServer, vllm_python, vllm_venv


@pytest.fixture(scope="session")
def vllm_server() -> Iterator[VllmServer]:
    if vllm_python() is None:
        message = f"vLLM is not installed in {vllm_venv()}: run `{INSTALL_HINT}`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    model_dir = prepare_default_model()
    server = VllmServer.start(model_dir, timeout_s=600)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tokenizer(vllm_server: VllmServer) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_server.model_dir)
