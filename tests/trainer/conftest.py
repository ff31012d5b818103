"""A tiny randomly initialised Llama with the default model's real tokenizer and chat template:
loads in milliseconds, so trainer tests run the real code paths quickly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def make_tiny_model(folder: Path, seed: int = 0, initializer_range: float = 0.02) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from reins.engine.prepare import prepare_default_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama")
