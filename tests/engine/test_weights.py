"""Loading whole weights into a model in place (`reins.engine.weights`): weights that do not fit
are refused before anything is copied; concurrent updates never lower the version served. A tiny
random Llama built in memory, no files."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from reins.engine.embedded import EmbeddedEngine, WeightVersionError
from reins.engine.prepare import prepare_default_model
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


class WatchedLock:
    """A lock that reports each thread that starts to acquire it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.attempts: queue.Queue[str] = queue.Queue()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.attempts.put(threading.current_thread().name)
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_: object) -> None:
        self.release()


def test_an_update_to_a_lower_version_waiting_behind_a_higher_one_is_refused() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    engine = EmbeddedEngine(tiny_model(), tokenizer, name="tiny", prefix_cache_gb=0)
    lock = WatchedLock()
    engine._weights_lock = engine.scheduler.weights_lock = lock  # type: ignore[assignment]
    in_update, finish_update = threading.Event(), threading.Event()
    outcomes: dict[int, object] = {}

    def update(version: int) -> None:
        try:
            with engine.updating_weights(version):
                in_update.set()
                finish_update.wait(30)
            outcomes[version] = "applied"
        except WeightVersionError as error:
            outcomes[version] = error

    try:
        to_five = threading.Thread(target=update, args=(5,), name="to-5")
        to_five.start()
        assert in_update.wait(30) and lock.attempts.get(timeout=30) == "to-5"
        to_three = threading.Thread(target=update, args=(3,), name="to-3")
        to_three.start()
        assert lock.attempts.get(timeout=30) == "to-3"  # waiting while version 5 goes in
        finish_update.set()
        to_five.join(30)
        to_three.join(30)
        assert outcomes[5] == "applied"
        assert "only go up" in str(outcomes[3]) and engine.weight_version == 5
    finally:
        finish_update.set()
        engine.close()
