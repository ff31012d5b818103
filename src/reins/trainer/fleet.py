"""The inference servers a `ReloadPublisher` hands new weights to, by kind.

Each server loads a saved Hugging Face folder in place; the kind is told by its `/v1/models`
card (`owned_by`):

- `reins engine`: `POST /reins/load_weights` with the version number, which it then serves
  and reports on every answer (`x-reins-weight-version`).
- vLLM (started with `VLLM_SERVER_DEV_MODE=1`, which opens its development routes):
  `POST /collective_rpc` runs `reload_weights` on every worker with the folder, then
  `POST /reset_prefix_cache` drops KV computed by the old weights. Collocated on the trainer's
  GPUs, it can sleep during each update (`/sleep`, `/wake_up`). vLLM does not know version
  numbers: the trainer registers each one at the gateway, which records it for vLLM's calls
  (`Trainer.on_publish`).

The folder must be readable by every server at the same path (one host, or a shared file system).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import httpx

_LOAD_TIMEOUT_S = 600.0


class FleetError(RuntimeError):
    """An engine that cannot take part in the fleet, or refused new weights."""


class FleetEngine(Protocol):
    url: str
    kind: str
    """What the gateway registers it as: `reins` or `vllm`."""

    @property
    def drops_weights(self) -> bool:
        """Whether `before_update` lets the weights go (they must be loaded again after it)."""
        ...

    def before_update(self) -> None:
        """Called before the optimizer step (no call is in flight then)."""
        ...

    def load(self, folder: Path, version: int) -> None:
        """Serves the weights in `folder` as `version` when it returns."""
        ...

    @property
    def served_version(self) -> int | None:
        """The version it served when it was connected; None when it cannot tell (vLLM)."""
        ...


class ReinsEngine:
    kind = "reins"

    drops_weights = False

    def __init__(self, url: str, served_version: int | None = None) -> None:
        self.url = url
        self.served_version = served_version

    def before_update(self) -> None:
        pass

    def load(self, folder: Path, version: int) -> None:
        response = _post(self.url, "/reins/load_weights", {"path": str(folder), "version": version})
        served = response.json().get("weight_version")
        if served != version:
            raise FleetError(
                f"the engine at {self.url} serves version {served} after loading version {version}"
            )


class VllmEngine:
    """`sleep`: for vLLM on the trainer's own GPUs. It sleeps at level 2 during each update,
    giving back its weights' and KV cache's GPU memory for the optimizer step, then wakes its
    weights, loads the new ones into them, and wakes its KV cache."""

    kind = "vllm"
    served_version = None  # vLLM numbers no versions

    def __init__(self, url: str, *, sleep: bool = False) -> None:
        self.url = url
        self.sleep = sleep
        # The development routes exist only with VLLM_SERVER_DEV_MODE=1: find out now, before
        # any training, rather than at the first update.
        probe = httpx.post(f"{url}/reset_prefix_cache", timeout=60)
        if probe.status_code == 404:
            raise FleetError(
                f"the vLLM server at {url} cannot reload weights: start it with "
                "VLLM_SERVER_DEV_MODE=1 in its environment (it opens /collective_rpc)"
            )
        _check(url, "/reset_prefix_cache", probe)

    @property
    def drops_weights(self) -> bool:
        return self.sleep  # level 2 discards them

    def before_update(self) -> None:
        if self.sleep:
            _post(self.url, "/sleep?level=2", None)

    def load(self, folder: Path, version: int) -> None:
        if self.sleep:
            _post(self.url, "/wake_up?tags=weights", None)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
        _post(self.url, "/collective_rpc", {**rpc, "timeout": _LOAD_TIMEOUT_S})
        if self.sleep:
            _post(self.url, "/wake_up?tags=kv_cache", None)
        # The reset fails while blocks are held; the gateway is drained, so a held block can
        # only be one a just-finished request has not released yet.
        for _ in range(50):
            if _post(self.url, "/reset_prefix_cache", None).json().get("success"):
                return
            time.sleep(0.1)
        raise FleetError(
            f"the vLLM server at {self.url} would not drop its prefix cache after loading "
            f"version {version}: calls still running there would mix old and new weights"
        )


def connect(url: str, *, sleep: bool = False) -> FleetEngine:
    """The engine at `url` (its root, without `/v1`), by the kind its model card names;
    `sleep`: vLLM engines sleep during updates (`VllmEngine`)."""
    try:
        response = httpx.get(f"{url}/v1/models", timeout=60)
    except httpx.HTTPError as error:
        raise FleetError(f"cannot reach the engine at {url}: {error!r}") from error
    _check(url, "/v1/models", response)
    owners = {card.get("owned_by") for card in response.json().get("data", [])}
    if "reins" in owners:
        version = response.headers.get("x-reins-weight-version", "")
        return ReinsEngine(url, int(version) if version.isdigit() else None)
    if "vllm" in owners:
        return VllmEngine(url, sleep=sleep)
    raise FleetError(
        f"the engine at {url} is neither `reins engine` nor vLLM (its models are owned by "
        f"{sorted(map(str, owners))}): reins cannot hand it new weights"
    )


def _post(url: str, path: str, body: object) -> httpx.Response:
    try:
        response = httpx.post(f"{url}{path}", json=body, timeout=_LOAD_TIMEOUT_S)
    except httpx.HTTPError as error:
        raise FleetError(f"cannot reach the engine at {url}: {error!r}") from error
    _check(url, path, response)
    return response


def _check(url: str, path: str, response: httpx.Response) -> None:
    if response.status_code != 200:
        raise FleetError(
            f"the engine at {url} answered {path} with {response.status_code}: "
            f"{response.text[:500]}"
        )
