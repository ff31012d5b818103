"""Whole weights into a loaded model, in place: from a saved Hugging Face folder (the trainer's
`save_weights`) or from a state dict (the FSDP trainer's gathered weights).

The folder's safetensors files are read directly, not through a second `from_pretrained`: no
second model in memory, and several engines of one process may load at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def read_folder(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's `*.safetensors` files (one file or shards)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def load_into(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Copies `state` into `model`'s parameters and buffers (cast to their dtype and device);
    refuses weights that do not fit it, rather than serving a half-loaded model."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    absent = set(missing) - _tied(model)
    if unexpected or absent:
        raise ValueError(
            f"the weights do not fit the engine's model: missing {sorted(absent)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )


def _tied(model: torch.nn.Module) -> set[str]:
    """Names that share another parameter's storage (a tied LM head): weights may omit them."""
    seen: set[int] = set()
    tied = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.add(name)
        seen.add(id(parameter))
    return tied
