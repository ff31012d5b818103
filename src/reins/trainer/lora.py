"""LoRA adapters folded into their base weights, on a state dict: what an engine loads.

peft's own `merge_adapter` changes the modules in place, which a sharded model (FSDP2) cannot
do; this computes the same sum, `W + scaling * B @ A` per adapted linear layer, on the whole
weights gathered to one process, and names the result as the base model names its weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

_PEFT_PREFIX = "base_model.model."


def is_lora(model: Any) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def merged_state(model: Any, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """`state` (the whole weights of the peft-wrapped `model`, its own names) as the base
    model's weights with every adapter added in."""
    merged: dict[str, torch.Tensor] = {}
    adapted: dict[str, tuple[str, float]] = {}
    for name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or not lora_a:
            continue
        (adapter,) = module.active_adapters
        if module.use_dora.get(adapter) or module.fan_in_fan_out:
            raise ValueError(f"{name}: only plain LoRA on linear layers can be merged here")
        adapted[name] = (adapter, float(module.scaling[adapter]))
    for key, value in state.items():
        if ".lora_" in key:
            continue
        merged[_base_name(key)] = value
    for name, (adapter, scaling) in adapted.items():
        a = state[f"{name}.lora_A.{adapter}.weight"].float()
        b = state[f"{name}.lora_B.{adapter}.weight"].float()
        weight = _base_name(f"{name}.base_layer.weight")
        base = merged[weight]
        merged[weight] = (base.float() + scaling * (b @ a)).to(base.dtype)
    return merged


def _base_name(key: str) -> str:
    return key.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
