"""Fixtures of the real-engine tier: one vLLM server for the whole session (about two minutes
to start on two cores), the default model's tokenizer, and one embedded engine (about 3 s)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from reins.engine.prepare import prepare_default_model
from tests.embedded_support import ServedEngine, served_engine
from tests.vllm_support import (
    HERMES_TEMPLATE,
    INSTALL_HINT,
    VllmServer,
    vllm_python,
    vllm_venv,
)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    if vllm_python() is None:
        message = f"vLLM is not installed in {vllm_venv()}: run `{INSTALL_HINT}`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    model_dir = prepare_default_model()
    template = tmp_path_factory.mktemp("vllm-template") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    # Development mode opens /collective_rpc and /reset_prefix_cache, which reload weights
    # (test_vllm_fleet.py; it puts the original weights back when it ends). Scale-out opens
    # the render, generate and derender routes token reuse needs (test_token_reuse_vllm.py),
    # whose tool calls need the Hermes template (a chat without tools renders as the model's
    # own template: the other files see no difference).
    server = VllmServer.start(
        model_dir,
        timeout_s=600,
        extra_args=["--enable-scale-out", "--chat-template", str(template)],
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tokenizer(vllm_server: VllmServer) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_server.model_dir)


@pytest.fixture(scope="session")
def embedded() -> Iterator[ServedEngine]:
    """One embedded engine (the default model in float32, so that its logprobs can be checked
    against a recomputed forward pass) served on loopback for the whole session.

    Tests that change its weights use their own engine instead.
    """
    with served_engine(dtype="float32") as served:
        yield served
