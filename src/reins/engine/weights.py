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
        try:
            state.update(load_file(file))
        except Exception as error:  # safetensors' own error is neither OSError nor ValueError
            raise ValueError(f"{file} is not a readable safetensors file: {error}") from error
    return state


def load_into(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Copies `state` into `model`'s parameters and buffers (cast to their dtype and device);
    refuses weights that do not fit it (names, shapes, dtypes) before copying any, rather than
    serving a half-loaded model."""
    check_fits(model, state)
    model.load_state_dict(state, strict=False)  # strict would want the tied names too


def check_fits(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Raises ValueError, saying what does not fit, unless `state` holds a tensor of the right
    shape, of a dtype that casts to the model's, for every name of `model`'s state dict (tied
    names may be left out) and no other name."""
    expected = model.state_dict()
    absent = sorted(set(expected) - set(state) - _tied(model))
    unexpected = sorted(set(state) - set(expected))
    not_tensors = sorted(
        name for name in set(state) & set(expected) if not isinstance(state[name], torch.Tensor)
    )
    wrong_shape, wrong_dtype = [], []
    for name in sorted(set(state) & set(expected) - set(not_tensors)):
        given, wanted = state[name], expected[name]
        if given.shape != wanted.shape:
            wrong_shape.append(f"{name} {list(given.shape)} (the model's: {list(wanted.shape)})")
        elif not torch.can_cast(given.dtype, wanted.dtype):
            wrong_dtype.append(f"{name} {given.dtype} (the model's: {wanted.dtype})")
    problems = [
        f"{what} {names[:3]}{' and more' if len(names) > 3 else ''}"
        for what, names in (
            ("missing", absent),
            ("unexpected", unexpected),
            ("not tensors", not_tensors),
            ("of another shape", wrong_shape),
            ("of a dtype that does not cast", wrong_dtype),
        )
        if names
    ]
    if problems:
        raise ValueError(
            "the weights do not fit the engine's model (nothing was loaded): " + "; ".join(problems)
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
