"""The FSDP2 backend on CPU (torchrun, gloo on 127.0.0.1): 2 ranks train as 1, and a sharded
checkpoint resumes bit for bit.

The batches are planned with uneven micro-batches per rank, so a rank runs idle passes to keep
FSDP's collectives even (the worker asserts it). Gradients are compared whole (gathered from the
shards) at each of three steps, and the first against the float64 reference of the definitions:
weights after an Adam step alone would hide a wrong scale.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from reins.samples.batch import build_batch
from reins.trainer.backend import BackendConfig, TorchBackend
from tests.support import free_port
from tests.trainer import fsdp_worker
from tests.trainer.reference import (
    float64_model,
    reference_gradient,
    relative_error,
    split_rollouts,
)
from tests.trainer.test_gradient import TOLERANCE

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(
    ranks: int, mode: str, model_dir: Path, out: Path, checkpoint: Path
) -> subprocess.CompletedProcess[str]:
    args = (mode, model_dir, out, checkpoint)
    # TMPDIR: torchrun's log folder (`torchelastic_*`) goes with the test's folder.
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(out.parent),
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        "-m", "tests.trainer.fsdp_worker", *map(str, args),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three steps on 1 rank and on 2 ranks (the latter checkpointed after its second step)."""
    folder = tmp_path_factory.mktemp("fsdp")
    _torchrun(1, "train", tiny_model_dir, folder / "one.pt", folder / "checkpoint-one")
    _torchrun(2, "train", tiny_model_dir, folder / "two.pt", folder / "checkpoint")
    return {
        "one": torch.load(folder / "one.pt"),
        "two": torch.load(folder / "two.pt"),
        "checkpoint": folder / "checkpoint",
    }


@pytest.mark.slow
def test_two_ranks_step_on_one_ranks_gradients_and_reach_its_weights(
    trained: dict[str, Any], tiny_model_dir: Path
) -> None:
    one, two = trained["one"], trained["two"]
    want = reference_gradient(
        float64_model(tiny_model_dir), build_batch(split_rollouts()).sequences
    )
    assert relative_error(two["gradients"][0], want) < TOLERANCE
    assert relative_error(one["gradients"][0], want) < TOLERANCE
    for step, (got, single) in enumerate(zip(two["gradients"], one["gradients"], strict=True)):
        error = relative_error(got, [g.double() for g in single])
        assert error < TOLERANCE, f"step {step}: 2 ranks' gradient is {error:.2e} off 1 rank's"
    # The loss is the whole batch's on both (summed over ranks, not rank 0's share).
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4, abs=1e-6)
    initial = float64_model(tiny_model_dir).state_dict()
    moved = [two["weights"][name].double() - initial[name] for name in initial]
    single = [one["weights"][name].double() - initial[name] for name in initial]
    assert sum(float(m.abs().sum()) for m in single) > 0
    assert relative_error(moved, single) < 1e-3
    # Step 1 (two mini-batches) recomputed the old logprobs first: each rank those of its own
    # micro-batches, in as many passes as the rank with the most. Every rank recomputed every
    # sequence of the batch before, one at a time.
    sequences = len(build_batch(split_rollouts()).sequences)
    for passes in (one["recompute_passes"], two["recompute_passes"]):
        assert passes[0] == passes[2] == (0, 0)
        assert passes[1][0] == passes[1][1] > 0
    assert two["recompute_passes"][1][0] < sequences


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_bit_for_bit(
    trained: dict[str, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    _torchrun(2, "resume", tiny_model_dir, tmp_path / "resumed.pt", trained["checkpoint"])
    assert_resumes_the_third_step(torch.load(tmp_path / "resumed.pt"), trained["two"])


def assert_resumes_the_third_step(resumed: dict[str, Any], two: dict[str, Any]) -> None:
    """The resumed third step made the same loss, gradients and weights, bit for bit."""
    assert resumed["losses"][0] == two["losses"][2]
    for got, want in zip(resumed["gradients"][0], two["gradients"][2], strict=True):
        assert torch.equal(got, want)
    for name, want in two["weights"].items():
        assert torch.equal(resumed["weights"][name], want), name


@pytest.fixture(scope="module")
def dropout_trained(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Three steps on 2 ranks of the model with attention dropout, checkpointed after the
    second."""
    folder = tmp_path_factory.mktemp("fsdp-dropout")
    _torchrun(2, "train-dropout", tiny_model_dir, folder / "two.pt", folder / "checkpoint")
    return {"two": torch.load(folder / "two.pt"), "checkpoint": folder / "checkpoint"}


@pytest.mark.slow
def test_each_rank_resumes_its_own_random_state_and_drops_as_an_unbroken_run(
    dropout_trained: dict[str, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Only rank 0's random state was saved (in `trainer.json`): rank 1 resumed on a fresh
    stream and dropped other units in the redone step than the unbroken run."""
    saved = dropout_trained["checkpoint"] / "rng"
    states = [json.loads((saved / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    # The ranks drew apart (each its own micro-batches): rank 0's state would not do for both.
    assert states[0]["torch"] != states[1]["torch"]
    _torchrun(
        2, "resume-dropout", tiny_model_dir, tmp_path / "resumed.pt", dropout_trained["checkpoint"]
    )
    assert_resumes_the_third_step(torch.load(tmp_path / "resumed.pt"), dropout_trained["two"])


@pytest.mark.slow
def test_a_sharded_checkpoint_resumed_on_another_number_of_ranks_says_what_it_restores(
    dropout_trained: dict[str, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Resharded by `torch.distributed.checkpoint`; the random streams cannot go on as the 2
    ranks' did (the batches split otherwise), and the run says so rather than nothing."""
    done = _torchrun(
        1, "resume-dropout", tiny_model_dir, tmp_path / "resumed.pt", dropout_trained["checkpoint"]
    )
    assert (
        f"checkpoint {dropout_trained['checkpoint']} was written by 2 ranks, this run has 1: "
        "the weights and optimizer are resharded; ranks with a saved random state of their "
        "number restore it, the others' random streams (dropout) start afresh"
    ) in done.stderr
    # It made the third step (the worker checks it loaded 2 steps done).
    assert len(torch.load(tmp_path / "resumed.pt")["losses"]) == 1


@pytest.fixture(scope="module")
def lora_trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three steps with LoRA adapters on 2 ranks (checkpointed after the second), and the same
    three on one process with the torch backend and peft's own merge."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("fsdp-lora")
    _torchrun(2, "train-lora", tiny_model_dir, folder / "two.pt", folder / "checkpoint")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = fsdp_worker.lora_model(base)
    backend = TorchBackend(model, BackendConfig(lr=1e-3, grad_clip=1e9))
    steps = [fsdp_worker.step(backend, batch) for batch in fsdp_worker.batches(1)]
    merged = model.merge_and_unload().state_dict()
    return {
        "two": torch.load(folder / "two.pt"),
        "losses": [stats.loss for stats, _ in steps],
        "gradients": [gradient for _, gradient in steps],
        "merged": merged,
        "checkpoint": folder / "checkpoint",
    }


@pytest.mark.slow
def test_lora_on_two_ranks_trains_as_the_torch_backend_and_merges_as_peft(
    lora_trained: dict[str, Any], tiny_model_dir: Path
) -> None:
    two = lora_trained["two"]
    for index, (got, want) in enumerate(
        zip(two["gradients"], lora_trained["gradients"], strict=True)
    ):
        assert len(got) == len(want) == 2 * 3 * 2  # layers x adapted projections x (A, B)
        error = relative_error(got, [g.double() for g in want])
        assert error < TOLERANCE, f"step {index}: the adapters' gradient is {error:.2e} off"
    assert two["losses"] == pytest.approx(lora_trained["losses"], rel=1e-4, abs=1e-6)
    # What an engine loads: the base model's names, every adapter merged in, as peft merges.
    merged, want = two["weights"], lora_trained["merged"]
    assert sorted(merged) == sorted(want)
    initial = float64_model(tiny_model_dir).state_dict()
    moved = [merged[name].double() - initial[name] for name in want]
    expected = [want[name].double() - initial[name] for name in want]
    assert sum(float(m.abs().sum()) for m in expected) > 0
    assert relative_error(moved, expected) < 1e-3


@pytest.mark.slow
def test_a_lora_checkpoint_holds_the_adapters_and_resumes_bit_for_bit(
    lora_trained: dict[str, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(lora_trained["checkpoint"] / "sharded").read_metadata()
    weights = [key for key in saved.state_dict_metadata if key.startswith("model.")]
    assert weights and all(".lora_" in key for key in weights), weights
    _torchrun(2, "resume-lora", tiny_model_dir, tmp_path / "resumed.pt", lora_trained["checkpoint"])
    assert_resumes_the_third_step(torch.load(tmp_path / "resumed.pt"), lora_trained["two"])


@pytest.mark.slow
def test_published_weights_are_in_the_compute_precision_each_tied_weight_once(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The fp32 master weights were saved as they are, and a tied weight under both its names:
    twice the bytes an engine reads at every update (36 GB a publish for a 9B model in bf16)."""
    from safetensors import safe_open

    folder = tmp_path / "weights"
    _torchrun(2, "publish", tiny_model_dir, tmp_path / "unused.pt", folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as saved:
        names = set(saved.keys())
        dtypes = {saved.get_tensor(name).dtype for name in names}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert dtypes == {torch.bfloat16}
    # Readable as the umask allows: safetensors wrote the weights 0600, which an engine
    # running as another user could not load.
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {path.name: path.stat().st_mode & 0o777 for path in folder.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes
