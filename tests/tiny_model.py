"""The tiny random Llama the tests run on (2 layers, hidden 64: milliseconds a step) with the
default model's real tokenizer and chat template. One builder, so that the engine's and the
trainer's tests do not drift apart; what differs between them is an argument."""

from __future__ import annotations

from typing import Any

DEFAULT_INITIALIZER_RANGE = 0.02
"""`LlamaConfig`'s own default."""


def default_tokenizer() -> Any:
    """The default model's tokenizer (prepared once into the local cache, never from a hub)."""
    from transformers import AutoTokenizer

    from reins.engine.prepare import prepare_default_model

    return AutoTokenizer.from_pretrained(prepare_default_model())


def tiny_llama_config(
    tokenizer: Any,
    *,
    tokenizer_bos_and_pad: bool = True,
    initializer_range: float = DEFAULT_INITIALIZER_RANGE,
) -> Any:
    """The tiny model's `LlamaConfig` for `tokenizer`'s vocabulary and end token.

    `tokenizer_bos_and_pad`: the beginning and padding ids are the tokenizer's; else
    `LlamaConfig`'s own (bos 1, no padding id), as the engine's tests were built. The padding id
    zeroes its embedding row at initialisation, so the two give other weights."""
    from transformers import LlamaConfig

    special: dict[str, Any] = {}
    if tokenizer_bos_and_pad:
        special = {"bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id}
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        eos_token_id=tokenizer.eos_token_id,
        **special,
    )


def tiny_llama(
    tokenizer: Any,
    *,
    seed: int = 0,
    tokenizer_bos_and_pad: bool = True,
    initializer_range: float = DEFAULT_INITIALIZER_RANGE,
    model_class: Any = None,
) -> Any:
    """The tiny model, its weights drawn after `torch.manual_seed(seed)` (the same weights on
    every call with the same arguments); `model_class` a `LlamaForCausalLM` subclass, or it."""
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(
        tokenizer,
        tokenizer_bos_and_pad=tokenizer_bos_and_pad,
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    return (model_class or LlamaForCausalLM)(config)
