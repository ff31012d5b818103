"""A fleet: several `reins engine` servers under one model name, each update loaded by all.

The engines are real HTTP servers of the embedded engine (the code `reins engine` serves), on a
tiny random model. What is checked through the API, as for any engine: the logprob of a fixed
prompt's first token is the same on every engine after each publish, and moves with it.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import torch

from reins.engine.api import create_engine_app
from reins.engine.embedded import EmbeddedEngine
from reins.serving import BackgroundServer
from reins.trainer.backend import BackendConfig, TorchBackend
from reins.trainer.publish import ReloadPublisher
from reins.trainer.runtime import train
from tests.support import stored_calls
from tests.trainer.batches import make_batch
from tests.trainer.test_loop import config

PROMPT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def fleet(tiny_model_dir: Path) -> Iterator[list[tuple[EmbeddedEngine, str]]]:
    with ExitStack() as stack:
        engines = []
        for name in ("a", "b"):
            engine = EmbeddedEngine.load(tiny_model_dir, dtype="float32", device="cpu", name=name)
            stack.callback(engine.close)
            server = stack.enter_context(BackgroundServer(create_engine_app(engine)))
            engines.append((engine, server.url))
        yield engines


def first_token_logprob(url: str) -> tuple[str, float, int]:
    """(token, logprob, weight version) of the greedy first token of a fixed prompt."""
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": True},
        timeout=60,
    )
    response.raise_for_status()
    first = response.json()["choices"][0]["logprobs"]["content"][0]
    version = int(response.headers["x-reins-weight-version"])
    return first["token"], first["logprob"], version


def test_every_engine_serves_each_update_as_the_same_version(
    fleet: list[tuple[EmbeddedEngine, str]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    trainer_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    backend = TorchBackend(trainer_model, BackendConfig(lr=1e-2))
    urls = [url for _, url in fleet]
    publisher = ReloadPublisher(backend, urls, tmp_path / "weights")
    seen = [first_token_logprob(urls[0])]
    for update in (1, 2, 3):
        publisher.update(lambda: backend.train_step(make_batch()))
        assert publisher.version == update
        answers = [first_token_logprob(url) for url in urls]
        assert answers[0] == answers[1], f"update {update}: the engines differ: {answers}"
        assert answers[0][2] == update
        assert answers[0][:2] != seen[-1][:2], f"update {update} changed nothing served"
        seen.append(answers[0])
    trained = trainer_model.state_dict()
    for engine, _ in fleet:
        for name, value in engine.model.state_dict().items():
            torch.testing.assert_close(value, trained[name], msg=name)
    # Versions only go up: an engine refuses an older number.
    refused = httpx.post(
        f"{urls[0]}/reins/load_weights",
        json={"path": str(tmp_path / "weights"), "version": 2},
        timeout=60,
    )
    assert refused.status_code == 409 and "only go up" in refused.json()["error"]["message"]


@pytest.mark.slow
def test_a_run_on_a_fleet_serves_each_step_from_every_engine_at_its_version(
    fleet: list[tuple[EmbeddedEngine, str]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    urls = [url for _, url in fleet]
    run = config(tmp_path, tiny_model_dir, engine_url=urls, steps=3, val_every=0, group_size=4)
    records = asyncio.run(train(run))
    assert [r["weight_version"] for r in records] == [1, 2, 3]
    assert [engine.weight_version for engine, _ in fleet] == [3, 3]
    with sqlite3.connect(f"file:{run.run_dir / 'gateway.db'}?mode=ro", uri=True) as db:
        rollout_metadata = dict(db.execute("SELECT rollout_id, metadata FROM rollouts"))
    rows = [
        (rollout_metadata[rollout_id], data["endpoint"], data["model_version"])
        for rollout_id, data in stored_calls(run.run_dir / "gateway.db")
    ]
    assert len(rows) == 3 * 2 * 4 * 2  # steps x tasks x rollouts x calls
    # Step k's rollouts ran on the weights of version k, whichever engine served them.
    served = {(json.loads(metadata)["step"], version) for metadata, _, version in rows}
    assert served == {(0, 0), (1, 1), (2, 2)}
    assert {endpoint.removesuffix("/v1") for _, endpoint, _ in rows} == set(urls)


def test_the_weights_folder_is_sent_as_an_absolute_path(
    fleet: list[tuple[EmbeddedEngine, str]],
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`runs_dir` defaults to the relative `.reins/runs`: an engine in another working directory
    found no weights there (or another run's)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    publisher = ReloadPublisher(
        TorchBackend(model, BackendConfig(lr=1e-2)), [fleet[0][1]], Path("runs/weights")
    )
    assert publisher.folder == tmp_path / "runs" / "weights"


@pytest.mark.slow
def test_a_fresh_run_on_engines_that_served_another_run_loads_its_own_weights(
    fleet: list[tuple[EmbeddedEngine, str]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Left at the first run's version 1, the engines had every call of the second run read as
    too stale (not on its lineage): it trained nothing, sampled from the first run's weights."""
    urls = [url for _, url in fleet]
    first = config(tmp_path, tiny_model_dir, engine_url=urls, steps=1, val_every=0)
    asyncio.run(train(first))
    assert [engine.weight_version for engine, _ in fleet] == [1, 1]
    second = config(
        tmp_path, tiny_model_dir, engine_url=urls, steps=1, val_every=0, run_name="second"
    )
    (record,) = asyncio.run(train(second))
    assert record["rollouts/trained"] == 4
    assert record["weight_version"] == 3  # its own weights as version 2, then its update
    versions = {data["model_version"] for _, data in stored_calls(second.run_dir / "gateway.db")}
    assert versions == {2}
    with sqlite3.connect(f"file:{second.run_dir / 'gateway.db'}?mode=ro", uri=True) as db:
        assert db.execute("SELECT count(*) FROM models").fetchone() == (2,)


@pytest.mark.slow
def test_a_sync_step_drops_groups_an_engine_served_with_other_weights(
    fleet: list[tuple[EmbeddedEngine, str]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A fleet engine restarted during a step serves its initial weights (version 0) until the
    next update: sync trained those calls as its step's, one version stale."""
    _, (second, _) = fleet
    load = second.load_weights

    def load_then_restart(path: str, version: int | None = None) -> int:
        served = load(path, version)
        if served == 1:  # "restarted" right after the first update: version 0 from now on
            second._weight_version = 0
        return served

    second.load_weights = load_then_restart  # type: ignore[method-assign]
    urls = [url for _, url in fleet]
    run = config(tmp_path, tiny_model_dir, engine_url=urls, steps=2, val_every=0, group_size=4)
    records = asyncio.run(train(run))
    served = {
        (json.loads(metadata)["step"], version)
        for metadata, version in _calls_by_step(run.run_dir / "gateway.db")
    }
    assert served == {(0, 0), (1, 1), (1, 0)}
    stale = records[1]["rollouts/stale_groups"]
    assert records[0]["rollouts/stale_groups"] == 0 and stale >= 1
    assert records[1]["rollouts/trained"] == 4 * (2 - stale)


def _calls_by_step(database: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
        metadata = dict(db.execute("SELECT rollout_id, metadata FROM rollouts"))
    return [(metadata[rid], data["model_version"]) for rid, data in stored_calls(database)]
