"""Publishing to an engine in another server: save the weights, the engine loads them in place."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from reins.engine.api import create_engine_app
from reins.engine.embedded import EmbeddedEngine
from reins.serving import BackgroundServer
from reins.trainer.backend import BackendConfig, TorchBackend
from reins.trainer.publish import ReloadPublisher
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
