"""Publishing one update to a fleet of `reins engine` servers, against publishing to one.

`ReloadPublisher` saves the trainer's weights once as a Hugging Face folder, then every engine
loads it at once. Each engine here is the embedded engine's HTTP app on loopback, in this
process, on the default model (135M, fp32); the trainer is the torch backend on the same model.
Per fleet size: one warm-up publish, then the mean of the timed ones, split into saving the
folder and the engines' loads. The baseline is a fleet of one, measured in the same run.

    .venv/bin/python benchmarks/fleet.py           # 1 and 2 engines, 2 timed publishes (~1 min)
    .venv/bin/python benchmarks/fleet.py --long    # 1, 2 and 4 engines, 5 timed publishes

Last line: `fleet_publish_2_engines_over_1: VALUE ratio` (publish time; 1 is free scaling).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reins.trainer.backend import TorchBackend


def measure(
    engines: int, publishes: int, model_dir: Path, backend: TorchBackend
) -> tuple[float, float]:
    """(mean publish seconds, mean of that spent saving the folder)."""
    from reins.engine.api import create_engine_app
    from reins.engine.embedded import EmbeddedEngine
    from reins.serving import BackgroundServer
    from reins.trainer.publish import ReloadPublisher

    with ExitStack() as stack, tempfile.TemporaryDirectory() as folder:
        urls = []
        for index in range(engines):
            engine = EmbeddedEngine.load(model_dir, dtype="float32", name=f"e{index}")
            stack.callback(engine.close)
            urls.append(stack.enter_context(BackgroundServer(create_engine_app(engine))).url)
        publisher = ReloadPublisher(backend, urls, Path(folder) / "weights")
        save = backend.save_weights
        saving: list[float] = []

        def timed_save(path: Path) -> None:
            started = time.perf_counter()
            save(path)
            saving.append(time.perf_counter() - started)

        backend.save_weights = timed_save  # type: ignore[method-assign]
        try:
            publisher.publish(1)  # warm-up
            saving.clear()
            started = time.perf_counter()
            for version in range(2, 2 + publishes):
                publisher.publish(version)
            total = (time.perf_counter() - started) / publishes
        finally:
            backend.save_weights = save  # type: ignore[method-assign]
    return total, sum(saving) / len(saving)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="1, 2, 4 engines, 5 publishes")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from reins.engine.prepare import prepare_default_model
    from reins.trainer.backend import BackendConfig, TorchBackend

    model_dir = prepare_default_model()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    backend = TorchBackend(model, BackendConfig())
    sizes, publishes = ([1, 2, 4], 5) if args.long else ([1, 2], 2)
    print(f"publish to a fleet of `reins engine` servers, 135M fp32, {publishes} timed each")
    print(f"{'engines':>8} {'publish s':>10} {'save s':>8} {'loads s':>8} {'vs 1 engine':>12}")
    baseline: float | None = None
    ratios: dict[int, float] = {}
    for size in sizes:
        total, save = measure(size, publishes, model_dir, backend)
        baseline = baseline or total
        ratios[size] = total / baseline
        print(f"{size:>8} {total:>10.2f} {save:>8.2f} {total - save:>8.2f} {ratios[size]:>11.2f}x")
    print(f"fleet_publish_2_engines_over_1: {ratios[2]:.2f} ratio")


if __name__ == "__main__":
    main()
