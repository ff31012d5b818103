"""The trainer: the loop (sync and collocated async), the torch backend, checkpoints, metrics."""

from reins.trainer.backend import Backend, BackendConfig, StepStats, TorchBackend
from reins.trainer.config import ConfigError, TrainConfig, load_config
from reins.trainer.loop import Trainer

__all__ = [
    "Backend",
    "BackendConfig",
    "ConfigError",
    "StepStats",
    "TorchBackend",
    "TrainConfig",
    "Trainer",
    "load_config",
]
