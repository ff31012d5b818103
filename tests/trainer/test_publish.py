"""Publishing to an engine in another server: save the weights, the engine loads them in place."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from reins.engine.api import create_engine_app
from reins.engine.embedded import EmbeddedEngine
from reins.serving import BackgroundServer
from reins.trainer.backend import BackendConfig, StepStats, TorchBackend
from reins.trainer.publish import InProcessPublisher, ReloadPublisher
from tests.trainer.batches import make_batch


def test_reload_publisher_hands_the_new_weights_to_the_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    engine = EmbeddedEngine.load(tiny_model_dir, dtype="float32", device="cpu", name="policy")
    trainer_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    backend = TorchBackend(trainer_model, BackendConfig(lr=1e-2))
    try:
        with BackgroundServer(create_engine_app(engine)) as server:
            publisher = ReloadPublisher(backend, server.url, tmp_path / "weights")
            _, seconds = publisher.update(lambda: backend.train_step(make_batch()))
            assert publisher.version == engine.weight_version == 1 and seconds > 0
            trained = trainer_model.state_dict()
            for name, value in engine.model.state_dict().items():
                torch.testing.assert_close(value, trained[name], msg=name)
            refused = httpx.post(f"{server.url}/reins/load_weights", json={"path": ""})
            assert refused.status_code == 400 and "path" in refused.json()["error"]["message"]
    finally:
        engine.close()


def moved(stats: StepStats) -> bool:
    return stats.optimizer_steps > 0


def test_a_step_that_moved_no_weight_publishes_no_version(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every advantage 0 (or every gradient non-finite): no optimizer step. A new version would
    age every rollout in flight for nothing, and a fleet would save and reload the weights."""
    from transformers import AutoModelForCausalLM

    engine = EmbeddedEngine.load(tiny_model_dir, dtype="float32", device="cpu", name="policy")
    trainer_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    backend = TorchBackend(trainer_model, BackendConfig(lr=1e-2))
    try:
        with BackgroundServer(create_engine_app(engine)) as server:
            folder = tmp_path / "weights"
            reload = ReloadPublisher(backend, server.url, folder)
            still, _ = reload.update(lambda: StepStats(optimizer_steps=0), moved)
            assert (still.optimizer_steps, reload.version, engine.weight_version) == (0, 0, 0)
            assert not folder.exists(), "nothing was saved"
            reload.update(lambda: StepStats(optimizer_steps=1), moved)
            assert (reload.version, engine.weight_version) == (1, 1) and folder.is_dir()
        in_process = InProcessPublisher(engine)
        in_process.update(lambda: StepStats(optimizer_steps=0), moved)
        assert in_process.version == engine.weight_version == 1
        in_process.update(lambda: StepStats(optimizer_steps=2), moved)
        assert in_process.version == engine.weight_version == 2
    finally:
        engine.close()
