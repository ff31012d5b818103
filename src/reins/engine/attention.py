"""The scheduler's attention on CPU: transformers' SDPA path without its extra reads and copies.

On a grouped-query model (the default SmolLM2-135M: 9 query heads share 3 KV heads), transformers'
`sdpa` attention feeds PyTorch's CPU flash-attention kernel in two wasteful ways, and at agent
context lengths (4k tokens) attention is half of a decode step:

- A decode step of one row without padding (one conversation) passes `enable_gqa`: the kernel runs
  one task per *query* head, so every KV head's whole cache is read three times per layer. Packing
  the query instead (`[rows, 3 KV heads, 3 query heads, dim]`: what transformers already does
  for batches with padding) reads it once: 204 MB instead of ~600 MB per step at 4.4k tokens.
- A prefill over a cached prefix (fewer queries than keys, so a mask) `repeat_kv`s the keys and
  values, copying the whole cache three times in every layer; `enable_gqa` with the mask gives
  the kernel the shared heads directly.

Invariants: the same kernel computes every output. A prefill's output is bitwise transformers'
(the kernel reads the same numbers); a decode step's is bitwise that of transformers' packed path,
which it already took for every batch with padding (a single unpadded row rounds differently from
before by ~1e-7). Off CPU, with gradients on (a trainer's forward on a shared model), or with
anything this path does not handle (dropout, a per-head mask, position bias, soft-capping),
transformers' own function runs unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

log = logging.getLogger(__name__)

NAME = "reins_sdpa"
"""The attention implementation's name in transformers' registry (masks as for `sdpa`)."""


def engine_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [rows, heads, q, dim], key and value
    [rows, kv heads, k, dim]; returns [rows, q, heads, dim]."""
    groups = getattr(module, "num_key_value_groups", 1)
    rows, heads, length, dim = query.shape
    if (
        groups == 1
        or query.device.type != "cpu"
        or torch.is_grad_enabled()
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or (attention_mask is not None and attention_mask.shape[1] != 1)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    attend = torch.nn.functional.scaled_dot_product_attention
    if length == 1:  # one query per row: its heads become the rows of their KV head
        packed = query.reshape(rows, heads // groups, groups, dim)
        out = attend(packed, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None
    if attention_mask is None:  # transformers passes `enable_gqa` (and `is_causal`) itself
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    out = attend(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_engine_attention(model: Any) -> bool:
    """Switches `model` from transformers' `sdpa` attention to `engine_attention`; whether it did.

    Models on another implementation (eager, flash) or that cannot switch are left as they are."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", NAME):
        return False
    AttentionInterface.register(NAME, engine_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    try:
        model.set_attn_implementation(NAME)
    except (AttributeError, TypeError, ValueError) as error:
        log.info("keeping transformers' sdpa attention: %s", error)
        return False
    return True
