"""The engine's attention against transformers' `sdpa` on grouped-query shapes (9 query heads on 3
KV heads, as the default model): the same numbers where the docstring promises them."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from reins.engine import attention
from reins.engine.attention import NAME, engine_attention, use_engine_attention


class Heads(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def inputs(rows: int, queries: int, keys: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(rows * 1000 + queries)
    query = torch.randn(rows, queries, 9, 64, generator=generator).transpose(1, 2)
    room = torch.randn(2, rows, 3, keys + 64, 64, generator=generator)  # KV with room to grow
    return query, room[0][:, :, :keys], room[1][:, :, :keys]


def padding_mask(rows: int, queries: int, keys: int) -> torch.Tensor:
    """Row r: r * 5 padded positions in front, causal over the last `queries` keys."""
    mask = torch.ones(rows, 1, queries, keys, dtype=torch.bool).tril(keys - queries)
    for row in range(rows):
        mask[row, :, :, : row * 5] = False
    return mask


def test_a_prefill_over_a_cached_prefix_is_bitwise_transformers() -> None:
    query, key, value = inputs(2, 24, 300)
    mask = padding_mask(2, 24, 300)
    with torch.inference_mode():
        ours, _ = engine_attention(Heads(), query, key, value, mask, scaling=0.125)
        theirs, _ = sdpa_attention_forward(Heads(), query, key, value, mask, scaling=0.125)
    assert torch.equal(ours, theirs)


def test_a_batched_decode_step_is_bitwise_transformers() -> None:
    query, key, value = inputs(3, 1, 700)
    mask = padding_mask(3, 1, 700)
    with torch.inference_mode():
        ours, _ = engine_attention(Heads(), query, key, value, mask, scaling=0.125)
        theirs, _ = sdpa_attention_forward(Heads(), query, key, value, mask, scaling=0.125)
    assert ours.shape == (3, 1, 9, 64)
    assert torch.equal(ours, theirs)


def test_a_single_row_decode_step_agrees_with_transformers_within_rounding() -> None:
    query, key, value = inputs(1, 1, 4400)
    with torch.inference_mode():
        ours, _ = engine_attention(Heads(), query, key, value, None, scaling=0.125)
        theirs, _ = sdpa_attention_forward(Heads(), query, key, value, None, scaling=0.125)
    assert ours.shape == theirs.shape == (1, 1, 9, 64)
    assert (ours - theirs).abs().max().item() < 1e-6


def test_with_gradients_on_it_is_transformers_own_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []

    def transformers_path(*args: object, **kwargs: object) -> tuple[torch.Tensor, None]:
        calls.append(torch.is_grad_enabled())
        return sdpa_attention_forward(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "sdpa_attention_forward", transformers_path)
    query, key, value = inputs(1, 1, 100)
    engine_attention(Heads(), query, key, value, None, scaling=0.125)
    with torch.inference_mode():
        engine_attention(Heads(), query, key, value, None, scaling=0.125)
    assert calls == [True]


def test_only_sdpa_models_switch() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    def tiny(implementation: str) -> LlamaForCausalLM:
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        config._attn_implementation = implementation
        return LlamaForCausalLM(config).eval()

    switched, eager = tiny("sdpa"), tiny("eager")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        before = switched(ids).logits
    assert use_engine_attention(switched) and switched.config._attn_implementation == NAME
    assert not use_engine_attention(eager) and eager.config._attn_implementation == "eager"
    with torch.inference_mode():
        assert (switched(ids).logits - before).abs().max().item() < 1e-6
