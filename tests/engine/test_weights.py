"""Loading whole weights into a model in place (`reins.engine.weights`): weights that do not fit
are refused before anything is copied. A tiny random Llama built in memory, no files."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from reins.engine.weights import load_into


def tiny_model() -> Any:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def changed_state(model: Any) -> dict[str, torch.Tensor]:
    """Every weight of `model` (its tied head left out, as saved folders do), one of them
    changed."""
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state["model.layers.0.mlp.down_proj.weight"] *= 1.5
    return state


def extra_name(state: dict[str, torch.Tensor]) -> None:
    state["bogus.weight"] = torch.zeros(1)


def wrong_shape(state: dict[str, torch.Tensor]) -> None:
    state["model.norm.weight"] = torch.ones(7)


def wrong_dtype(state: dict[str, torch.Tensor]) -> None:
    state["model.norm.weight"] = torch.ones(16, dtype=torch.complex64)


def missing(state: dict[str, torch.Tensor]) -> None:
    del state["model.norm.weight"]


@pytest.mark.parametrize(
    ("flaw", "says"),
    [
        (extra_name, "unexpected ['bogus.weight']"),
        (wrong_shape, "model.norm.weight [7] (the model's: [16])"),
        (wrong_dtype, "does not cast"),
        (missing, "missing ['model.norm.weight']"),
    ],
)
def test_weights_that_do_not_fit_are_refused_before_any_is_copied(
    flaw: Callable[[dict[str, torch.Tensor]], None], says: str
) -> None:
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = changed_state(model)
    flaw(state)
    with pytest.raises(ValueError, match="nothing was loaded") as refused:
        load_into(model, state)
    assert says in str(refused.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_weights_that_fit_are_loaded_cast_to_the_models_dtype() -> None:
    model = tiny_model()
    state = changed_state(model)
    load_into(model, {k: v.to(torch.bfloat16) for k, v in state.items()})
    loaded = model.state_dict()
    assert loaded["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    expected = state["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16).float()
    assert torch.equal(loaded["model.layers.0.mlp.down_proj.weight"], expected)
