"""`reins train --resume` after a crash: it goes on from a complete checkpoint or refuses with a
message that says what exists, never wipes metrics, never loses a committed step, and redoes what
the crash interrupted on the weights of its step (`reins.trainer.resume`)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from reins.trainer import checkpoint, resume
from reins.trainer.config import TrainConfig
from reins.trainer.data import TaskStream, load_tasks
from reins.trainer.metrics import MetricsLog
from reins.trainer.runtime import train
from tests.trainer.test_loop import config, metrics, tasks_file


class Told:
    """A reporter that keeps what the trainer says to the user."""

    def __init__(self) -> None:
        self.said: list[str] = []

    def say(self, message: str) -> None:
        self.said.append(message)

    def phase(self, step: int, name: str) -> None:
        pass

    def rollouts(self, done: int, total: int) -> None:
        pass

    def step_done(self, record: dict[str, Any]) -> None:
        pass


def write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


# -- refusals (nothing is trained: fast) -----------------------------------------------------


def test_resuming_a_run_that_does_not_exist_names_the_runs_there(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    (tmp_path / "runs" / "spelled-right").mkdir(parents=True)
    run = config(tmp_path, tiny_model_dir, run_name="speled-rihgt")
    with pytest.raises(ValueError, match=r"no run 'speled-rihgt'.*spelled-right"):
        asyncio.run(train(run, resume=True))
    assert not run.run_dir.exists()


def test_resuming_a_run_without_a_checkpoint_refuses_and_keeps_its_metrics(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run = config(tmp_path, tiny_model_dir)
    run.run_dir.mkdir(parents=True)
    write_lines(run.run_dir / "metrics.jsonl", [{"step": s, "reward/mean": 0.5} for s in range(3)])
    before = (run.run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"no checkpoint yet \(its metrics.jsonl holds steps 0..2"):
        asyncio.run(train(run, resume=True))
    assert (run.run_dir / "metrics.jsonl").read_bytes() == before


def test_a_model_that_is_no_model_folder_is_refused_before_the_run_folder_is_made(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run = config(tmp_path, tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=r"^model .*no-such-model is not a folder: name a"):
        asyncio.run(train(run))
    (tmp_path / "empty").mkdir()
    run = config(tmp_path, tmp_path / "empty")
    with pytest.raises(ValueError, match=r"is not a Hugging Face model folder \(it has no config"):
        asyncio.run(train(run))
    run = config(tmp_path, tiny_model_dir, tasks=tmp_path / "no-tasks.jsonl")
    with pytest.raises(ValueError, match=r"^cannot read tasks from .*no-tasks.jsonl"):
        asyncio.run(train(run))
    assert not run.run_dir.exists()


def test_an_agent_whose_module_is_nowhere_is_refused_before_the_run_folder_is_made(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Every rollout crashed on it (`cannot load agent`): the run went through all its steps,
    training on nothing, and ended as done."""
    run = config(tmp_path, tiny_model_dir, agent="no_such_agent_module.sub:run")
    with pytest.raises(ValueError) as refused:
        asyncio.run(train(run))
    assert str(refused.value) == (
        f"agent no_such_agent_module.sub:run: there is no module 'no_such_agent_module' in "
        f"{Path.cwd()} (where agents run) nor on this Python's path: check the name, run from "
        "the folder that holds it, or add that folder to PYTHONPATH"
    )
    assert not run.run_dir.exists()


def test_a_device_torch_cannot_use_is_refused_before_the_run_folder_is_made(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without
    run = config(tmp_path, tiny_model_dir, device="gpu0")
    with pytest.raises(ValueError, match=r"^device 'gpu0' is not a torch device: set cpu, cuda"):
        asyncio.run(train(run))
    run = config(tmp_path, tiny_model_dir, device="cuda:1")
    with pytest.raises(ValueError, match=r"^device cuda:1: torch sees 0 CUDA device\(s\) here"):
        asyncio.run(train(run))
    assert not run.run_dir.exists()


def test_a_run_folder_that_cannot_be_made_is_a_clear_error(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    (tmp_path / "a-file").write_text("")
    run = config(tmp_path, tiny_model_dir, runs_dir=tmp_path / "a-file" / "runs")
    with pytest.raises(ValueError, match=r"^cannot create the run folder .*a-file/runs/t \("):
        asyncio.run(train(run))


def test_a_run_another_process_runs_is_refused_saying_which(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Two `reins train` of one run (a --resume typed while it still runs, one command in two
    terminals) shared its gateway database and agents, and wrote each step's line twice."""
    run = config(tmp_path, tiny_model_dir)
    run.run_dir.mkdir(parents=True)
    with (run.run_dir / "run.lock").open("w") as other:  # as the running trainer holds it
        other.write("4242\n")
        other.flush()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for resuming in (False, True):
            with pytest.raises(FileExistsError) as refused:
                asyncio.run(train(run, resume=resuming))
            assert str(refused.value) == (
                f"run 't' is being run by another process (pid 4242, which holds "
                f"{run.run_dir / 'run.lock'}): wait for it to end, or stop it, before running "
                "or resuming it here"
            )
    assert sorted(p.name for p in run.run_dir.iterdir()) == ["run.lock"]


def damaged_checkpoints(run: Any, model: Path) -> tuple[Path, Path]:
    """Two checkpoints (steps 1 and 2) of `run`'s untrained weights, as a run would save them."""
    from reins.trainer.backend import BackendConfig, TorchBackend
    from reins.trainer.runtime import load_policy

    backend = TorchBackend(load_policy(run)[0], BackendConfig())
    folders = []
    for step in (1, 2):
        state = checkpoint.TrainerState(step, 2 * step, 0, checkpoint.capture_rng(), [0])
        folders.append(checkpoint.save(run.run_dir, backend, state, keep=2))
    return folders[0], folders[1]


def test_a_damaged_checkpoint_is_refused_naming_the_one_before_it(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A `step-*` folder is complete when renamed into place, but a disk, a copy or a hand can
    still damage it: the resume says so and which checkpoint it could go on from instead."""
    run = config(tmp_path, tiny_model_dir)
    first, second = damaged_checkpoints(run, tiny_model_dir)
    for damage in ("trainer.json", "model.pt"):
        kept = (second / damage).read_bytes()
        (second / damage).write_bytes(kept[: len(kept) // 2])
        with pytest.raises(resume.ResumeError) as refused:
            asyncio.run(train(run, resume=True))
        assert str(refused.value).startswith(f"checkpoint {second} cannot be loaded (")
        assert str(refused.value).endswith(
            f"move it out of {second.parent} to resume from {first.name}, the one before it"
        )
        (second / damage).write_bytes(kept)
    (first / "trainer.json").unlink()
    shutil.rmtree(second)
    with pytest.raises(resume.ResumeError, match="there is no earlier checkpoint: start the run"):
        asyncio.run(train(run, resume=True))


def test_a_checkpoints_files_are_on_the_disk_before_it_is_renamed_into_place(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Else a power loss after the rename could leave a `step-*` name on files the disk never
    received (a rename can reach the disk before the data it names)."""
    synced: set[str] = set()
    renamed: dict[str, set[str]] = {}
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(descriptor: int) -> None:
        synced.add(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)

    def rename(self: Path, target: Any) -> Any:
        renamed[Path(target).name] = set(synced)
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    run = config(tmp_path, tiny_model_dir)
    _, second = damaged_checkpoints(run, tiny_model_dir)
    staging = second.with_name(f".{second.name}{checkpoint.STAGING}")
    files = {str(p).replace(str(second), str(staging)) for p in second.rglob("*")}
    assert {"model.pt", "optimizer.pt", "trainer.json"} <= {p.name for p in second.iterdir()}
    assert files <= renamed[second.name]
    assert str(staging) in renamed[second.name]  # the folder's entries too


def test_a_crash_while_a_checkpoint_is_deleted_leaves_no_half_of_it(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pruning (or replacing a step's checkpoint) deleted the `step-*` folder in place: a crash
    midway left a folder of that name without some of its files, which a resume then took for
    a checkpoint."""
    run = config(tmp_path, tiny_model_dir)
    first, second = damaged_checkpoints(run, tiny_model_dir)
    real_rmtree = shutil.rmtree

    def killed_midway(path: Any, *args: Any, **kwargs: Any) -> None:
        folder = Path(path)
        if folder.is_dir() and checkpoint.PREFIX in folder.name:
            (folder / "model.pt").unlink()
            raise SystemExit("killed while deleting")
        real_rmtree(path, *args, **kwargs)

    backend_files = sorted(p.name for p in first.iterdir())
    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_midway)
    from reins.trainer.backend import BackendConfig, TorchBackend
    from reins.trainer.runtime import load_policy

    backend = TorchBackend(load_policy(run)[0], BackendConfig())
    for step in (3, 3):  # the prune of step 1, then a new save of step 3 over the old one
        state = checkpoint.TrainerState(step, 2 * step, 0, checkpoint.capture_rng(), [0])
        with pytest.raises(SystemExit):
            checkpoint.save(run.run_dir, backend, state, keep=2)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    left = sorted((run.run_dir / "checkpoints").glob(f"{checkpoint.PREFIX}*"))
    assert [f.name for f in left] == [second.name]
    assert sorted(p.name for p in left[0].iterdir()) == backend_files
    removed = checkpoint.remove_partial(run.run_dir)
    # The new save of step 3 was killed too: its staging folder goes with the trash.
    assert sorted(p.name for p in removed) == [
        f".{first.name}{checkpoint.TRASH}",
        f".step-000003{checkpoint.STAGING}",
        f".step-000003{checkpoint.TRASH}",
    ]
    assert sorted(p.name for p in (run.run_dir / "checkpoints").iterdir()) == [second.name]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"seed": 7}, "seed was 0, is 7"),
        ({"words": ["ant", "bee", "cat", "dog", "eel", "fox", "gnu"]}, "6 tasks then, 7 now"),
        ({"words": ["ant", "bee", "cat", "dog", "eel", "owl"]}, "6 tasks then, 6 now, other ones"),
    ],
    ids=["seed", "one-more-task", "another-task"],
)
def test_a_resume_whose_task_stream_changed_is_refused_saying_what_changed(
    tmp_path: Path, tiny_model_dir: Path, change: dict[str, Any], says: str
) -> None:
    """The checkpoint's data position (and the groups it declares again) count positions in the
    seeded task stream: with other tasks or another seed they named other tasks, silently."""
    run = config(tmp_path, tiny_model_dir)
    stream = TaskStream(load_tasks(run.tasks), run.seed)
    state = checkpoint.TrainerState(2, 4, 2, checkpoint.capture_rng(), [0, 1, 2])
    state.stream = stream.identity()
    from reins.trainer.backend import BackendConfig, TorchBackend
    from reins.trainer.runtime import load_policy

    saved = checkpoint.save(
        run.run_dir, TorchBackend(load_policy(run)[0], BackendConfig()), state, keep=1
    )
    resumed = run.model_copy(update={"seed": change.get("seed", run.seed)})
    if "words" in change:
        tasks_file(tmp_path, "train.jsonl", change["words"])
    with pytest.raises(resume.ResumeError) as refused:
        asyncio.run(train(resumed, resume=True))
    assert str(refused.value) == (
        f"run 't' cannot go on from {saved.name}: "
        + ("" if "seed" in change else f"the training tasks ({run.tasks}) changed: ")
        + says
        + ". Its stream position would name other tasks: put them back as they were, or start "
        "a new run under another run_name"
    )
    tasks_file(tmp_path, "train.jsonl", ["ant", "bee", "cat", "dog", "eel", "fox"])
    point = resume.find(run)  # as they were: no refusal
    resume.check_stream(point, TaskStream(load_tasks(run.tasks), run.seed).identity(), run)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"backend": "fsdp"}, "backend was 'torch', is 'fsdp'"),
        ({"lora": {"r": 4}}, "lora was None, is {'r': 4, 'target_modules': ["),
    ],
)
def test_a_resume_with_another_backend_or_lora_shape_is_refused_saying_what_changed(
    tmp_path: Path, tiny_model_dir: Path, change: dict[str, Any], says: str
) -> None:
    """Its checkpoint was read as damaged ("move it out ... to resume from the one before"),
    which no checkpoint of the run could help; LoRA adapters loaded onto another model."""
    run = config(tmp_path, tiny_model_dir)
    state = checkpoint.TrainerState(2, 4, 2, checkpoint.capture_rng(), [0, 1, 2])
    state.setup = resume.setup_of(run)
    from reins.trainer.backend import BackendConfig, TorchBackend
    from reins.trainer.runtime import load_policy

    saved = checkpoint.save(
        run.run_dir, TorchBackend(load_policy(run)[0], BackendConfig()), state, keep=1
    )
    resume.check_setup(resume.find(run), run)  # the same: no refusal
    changed = TrainConfig.model_validate({**run.model_dump(), **change})
    with pytest.raises(resume.ResumeError) as refused:
        resume.check_setup(resume.find(changed), changed)
    message = str(refused.value)
    assert message.startswith(f"run 't' cannot go on from {saved.name}: {says}"), message
    assert message.endswith("set it back, or start a new run under another run_name")


def test_a_resume_with_another_lora_alpha_is_refused_and_an_older_checkpoint_still_resumes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`lora.alpha` scales what the adapters add (`alpha / r * B @ A`): a resume under another
    loaded the trained adapters without a word and served, from its first call, weights the run
    never trained (alpha 32 -> 64: twice the trained update). A checkpoint written before the
    scale was kept (its `lora` holds no `alpha`) is compared on its shape alone, as before."""
    run = config(tmp_path, tiny_model_dir, lora={"r": 4, "alpha": 32})
    state = checkpoint.TrainerState(2, 4, 2, checkpoint.capture_rng(), [0, 1, 2])
    state.setup = resume.setup_of(run)
    from reins.trainer.backend import BackendConfig, TorchBackend
    from reins.trainer.runtime import load_policy

    backend = TorchBackend(load_policy(run)[0], BackendConfig())
    saved = checkpoint.save(run.run_dir, backend, state, keep=1)
    resume.check_setup(resume.find(run), run)
    doubled = TrainConfig.model_validate({**run.model_dump(), "lora": {"r": 4, "alpha": 64}})
    with pytest.raises(resume.ResumeError) as refused:
        resume.check_setup(resume.find(doubled), doubled)
    assert str(refused.value).startswith(
        f"run 't' cannot go on from {saved.name}: lora was {{'r': 4, 'target_modules': "
        "['q_proj', 'k_proj', 'v_proj', 'o_proj'], 'alpha': 32}, is {'r': 4, "
        "'target_modules': ['q_proj', 'k_proj', 'v_proj', 'o_proj'], 'alpha': 64}"
    ), str(refused.value)
    older = {k: v for k, v in (state.setup["lora"] or {}).items() if k != "alpha"}
    state.setup = {**state.setup, "lora": older}
    checkpoint.save(run.run_dir, backend, state, keep=1)
    resume.check_setup(resume.find(doubled), doubled)  # its shape is the same: no refusal


@pytest.mark.parametrize(
    ("rng", "says"),
    [
        (lambda rng: {k: v for k, v in rng.items() if k != "numpy"}, "state lacks numpy"),
        (lambda rng: {**rng, "torch": rng["torch"][:10]}, "state cannot be restored"),
        (lambda rng: {**rng, "cuda": "gpu"}, "GPU states are str, not a list"),
        (lambda rng: {**rng, "cuda": [[]]}, "holds a malformed GPU state"),
    ],
    ids=["missing-key", "truncated", "gpus-not-a-list", "gpu-state-empty"],
)
def test_a_checkpoint_whose_rng_state_is_damaged_is_refused_before_loading(
    tmp_path: Path, tiny_model_dir: Path, rng: Any, says: str
) -> None:
    """It was a raw KeyError (or torch's RuntimeError) after the weights were loaded."""
    run = config(tmp_path, tiny_model_dir)
    first, second = damaged_checkpoints(run, tiny_model_dir)
    saved = json.loads((second / "trainer.json").read_text())
    (second / "trainer.json").write_text(json.dumps({**saved, "rng": rng(saved["rng"])}))
    with pytest.raises(resume.ResumeError) as refused:
        asyncio.run(train(run, resume=True))
    assert str(refused.value).startswith(f"checkpoint {second} cannot be loaded (")
    assert says in str(refused.value)
    assert str(refused.value).endswith(f"to resume from {first.name}, the one before it")


def test_a_checkpoint_whose_rank_rng_state_is_damaged_is_refused_before_loading(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A sharded checkpoint's other ranks' random states (`rng/rank-N.json`) were read only by
    their rank, after every rank had loaded its weights: a damaged one ended that rank with a
    traceback. Checked with `trainer.json`, before anything is loaded."""
    run = config(tmp_path, tiny_model_dir)
    first, second = damaged_checkpoints(run, tiny_model_dir)
    ranks = second / checkpoint.RANK_RNG
    ranks.mkdir()
    state = json.dumps(checkpoint.capture_rng(), default=checkpoint.plain)
    (ranks / "rank-0.json").write_text(state)
    (ranks / "rank-1.json").write_text(json.dumps({"python": json.loads(state)["python"]}))
    with pytest.raises(resume.ResumeError) as refused:
        asyncio.run(train(run, resume=True))
    assert str(refused.value).startswith(
        f"checkpoint {second} cannot be loaded (rng/rank-1.json: its random number "
        "generators' state lacks numpy, torch)"
    )
    assert str(refused.value).endswith(f"to resume from {first.name}, the one before it")


def test_the_rng_state_holds_gpu_states_only_where_the_process_uses_cuda() -> None:
    """This machine has no GPU (and the process never started CUDA): no `cuda` entry."""
    assert not torch.cuda.is_available() or not torch.cuda.is_initialized()
    assert sorted(checkpoint.capture_rng()) == ["numpy", "python", "torch"]


def test_a_checkpoint_from_a_machine_with_other_gpus_restores_the_rest_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The GPUs' states were not kept at all; now a checkpoint that holds 2 GPUs' states
    resumes on a machine with another number of them (here none) with a warning that names
    both counts, its CPU generators restored."""
    state = checkpoint.capture_rng()
    want = torch.rand(4)
    # Two GPUs' states as `torch.cuda.get_rng_state_all` gives them (seed and offset bytes).
    state["cuda"] = [list(range(16)), list(range(16, 32))]
    checkpoint.check_rng(state)
    torch.rand(7)  # moves the CPU generator on
    with caplog.at_level("WARNING", logger="reins.trainer.checkpoint"):
        checkpoint.restore_rng(json.loads(json.dumps(state, default=checkpoint.plain)))
    assert torch.equal(torch.rand(4), want)
    assert [r.getMessage() for r in caplog.records] == [
        "the checkpoint holds the random state of 2 GPU(s), this machine has 0: the GPUs' "
        "random streams start afresh"
    ]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("next_step", "1", "next_step holds '1', not an integer >= 0"),
        ("weight_version", "x", "weight_version holds 'x', not an integer >= 0"),
        ("data_position", -5, "data_position holds -5, not an integer >= 0"),
        ("lineage", [0, True], "lineage holds True, not an integer >= 0"),
        ("pending", 3, "pending is 3, not a list"),
        ("record", [1], r"record is \[1\], not an object"),
    ],
)
def test_a_checkpoint_whose_counts_are_damaged_is_refused_before_loading(
    tmp_path: Path, tiny_model_dir: Path, field: str, value: Any, says: str
) -> None:
    """A count written as a string was a TypeError traceback at the first comparison, and a
    negative one resumed as if valid."""
    run = config(tmp_path, tiny_model_dir)
    _, second = damaged_checkpoints(run, tiny_model_dir)
    saved = json.loads((second / "trainer.json").read_text())
    (second / "trainer.json").write_text(json.dumps({**saved, field: value}))
    with pytest.raises(resume.ResumeError, match=f"cannot be loaded \\(trainer.json: {says}\\)"):
        asyncio.run(train(run, resume=True))


def test_checkpoints_are_ordered_by_step_number_and_other_folders_left_alone(
    tmp_path: Path,
) -> None:
    """Sorted by name, a user's `step-000001-copy` was the latest (a resume went back to it) and
    pruning deleted real checkpoints to keep it; a step past 999999 sorted first."""

    class Saves:
        def save_checkpoint(self, folder: Path) -> None:
            folder.mkdir(parents=True)

    root = tmp_path / "checkpoints"
    (root / "step-000001-copy").mkdir(parents=True)
    for step in (999_999, 1_000_000, 1_000_001):
        state = checkpoint.TrainerState(step, 0, 0, {}, [0])
        checkpoint.save(tmp_path, Saves(), state, keep=2)  # type: ignore[arg-type]
    assert sorted(p.name for p in root.iterdir()) == [
        "step-000001-copy", "step-1000000", "step-1000001",
    ]  # fmt: skip
    assert checkpoint.latest(tmp_path) == root / "step-1000001"


# -- metrics on resume (pure) ----------------------------------------------------------------


def test_settle_puts_back_the_checkpoints_line_and_moves_redone_steps_aside(
    tmp_path: Path,
) -> None:
    log = MetricsLog(tmp_path, tensorboard=False)
    write_lines(log.path, [{"step": 0, "x": 0}, {"step": 1, "x": 1}, {"step": 3, "x": 3}])
    with log.path.open("a") as out:
        out.write('{"step": 4, "x"')  # torn by a crash mid-write
    moved = log.settle(3, steps=10, checkpoint_record={"step": 2, "x": 2})
    assert [r["step"] for r in log.records()] == [0, 1, 2]
    assert [r["step"] for r in moved] == [3]
    discarded = (tmp_path / "metrics.discarded.jsonl").read_text().splitlines()
    assert [json.loads(line)["x"] for line in discarded] == [3]


def test_settle_keeps_a_finished_runs_final_validation(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, tensorboard=False)
    write_lines(log.path, [{"step": 0}, {"step": 1}, {"step": 2, "val/reward_mean": 0.25}])
    assert log.settle(2, steps=2, checkpoint_record=None) == []
    assert log.has_final_validation(2)


# -- crashes inside a step commit (real runs on the tiny model: slow) ------------------------


class SimulatedCrash(Exception):
    pass


@pytest.mark.slow
def test_a_crash_while_a_checkpoint_is_saved_loses_no_committed_step(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = config(tmp_path, tiny_model_dir, steps=2, val_every=0, checkpoint_every=1)
    save = checkpoint.save

    def crash_in_second_save(run_dir: Path, backend: Any, state: Any, *, keep: int) -> Path:
        if state.next_step == 2:
            staging = run_dir / "checkpoints" / ".step-000002.partial"
            staging.mkdir(parents=True)
            (staging / "model.safetensors").write_bytes(b"half")
            raise SimulatedCrash
        return save(run_dir, backend, state, keep=keep)

    monkeypatch.setattr(checkpoint, "save", crash_in_second_save)
    with pytest.raises(SimulatedCrash):
        asyncio.run(train(run))
    # The step whose checkpoint did not complete is not committed: no metrics line.
    assert [line["step"] for line in metrics(run.run_dir)] == [0]
    monkeypatch.setattr(checkpoint, "save", save)

    told = Told()
    records = asyncio.run(train(run, resume=True, reporter=told))
    assert [r["step"] for r in records] == [1]
    assert [line["step"] for line in metrics(run.run_dir)] == [0, 1]
    folder = run.run_dir / "checkpoints" / "step-000001"
    assert told.said[0].startswith(f"resumed run t from step 1 (checkpoint {folder})")
    assert not (run.run_dir / "checkpoints" / ".step-000002.partial").exists()


@pytest.mark.slow
def test_resuming_a_finished_run_keeps_its_final_validation_or_redoes_it(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run = config(tmp_path, tiny_model_dir, steps=1, val_every=1, checkpoint_every=1)
    asyncio.run(train(run))
    lines = metrics(run.run_dir)
    assert [line["step"] for line in lines] == [0, 1]
    told = Told()
    assert asyncio.run(train(run, resume=True, reporter=told)) == []
    assert metrics(run.run_dir) == lines
    assert told.said == ["run t is finished (1 step): nothing to do"]

    # A crash during the final validation: the resume validates the final weights again.
    write_lines(run.run_dir / "metrics.jsonl", lines[:1])
    assert asyncio.run(train(run, resume=True)) == []
    again = metrics(run.run_dir)
    assert [line["step"] for line in again] == [0, 1]
    assert isinstance(again[1]["val/reward_mean"], float)
    assert again[1]["weight_version"] == lines[1]["weight_version"]
    # The resumed run's engine only: the first one's port stayed registered, and sticky
    # routing sent calls there (after a few resumes every step's calls failed).
    with sqlite3.connect(f"file:{run.run_dir / 'gateway.db'}?mode=ro", uri=True) as db:
        assert db.execute("SELECT count(*) FROM models").fetchone() == (1,)


@pytest.mark.slow
def test_a_stopped_trainer_leaves_no_rollout_queuing_or_running(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Ctrl-C (asyncio.run cancels the main task) while agents run: the run's rollouts end."""
    run = config(tmp_path, tiny_model_dir, agent="tests.trainer.paced_agents:paced", val_every=0)
    db = run.run_dir / "gateway.db"

    def running() -> int:
        if not db.exists():
            return 0
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
            (count,) = connection.execute(
                "SELECT count(*) FROM rollouts WHERE state IN ('queuing', 'running')"
            ).fetchone()
        return int(count)

    async def interrupted() -> None:
        task = asyncio.create_task(train(run))
        deadline = time.monotonic() + 120
        while running() == 0:
            assert not task.done() and time.monotonic() < deadline
            await asyncio.sleep(0.05)  # polling the database, bounded by the deadline
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupted())
    assert running() == 0
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
        reasons = [r for (r,) in connection.execute("SELECT reason FROM rollouts")]
    assert reasons and all(r == "the trainer stopped before this rollout ended" for r in reasons)


@pytest.mark.slow
def test_a_run_stopped_before_its_first_line_is_not_started_again_on_its_old_rollouts(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Stopped in step 0 (nothing committed: no metrics line, no checkpoint), the same command
    again was allowed, and the gateway handed its declares back the stopped run's failed
    rollouts, by id: step 0 "ran" in milliseconds, trained nothing, and the run ended as done."""
    run = config(tmp_path, tiny_model_dir, agent="tests.trainer.paced_agents:paced", val_every=0)
    db = run.run_dir / "gateway.db"

    def declared() -> bool:
        if not db.exists():
            return False
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
            return bool(connection.execute("SELECT count(*) FROM rollouts").fetchone()[0])

    async def stopped() -> None:
        task = asyncio.create_task(train(run))
        deadline = time.monotonic() + 120
        while not declared():
            assert not task.done() and time.monotonic() < deadline
            await asyncio.sleep(0.05)  # polling the database, bounded by the deadline
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(stopped())
    assert not (run.run_dir / "metrics.jsonl").exists()
    with pytest.raises(FileExistsError) as refused:
        asyncio.run(train(run))
    assert str(refused.value).startswith(
        f"the gateway of {run.run_dir} (gateway.db) already holds rollouts of a run named 't' "
        "(such as t.t0000000."
    )
    assert str(refused.value).endswith(
        f"start it under another run_name, or delete {run.run_dir} to start this run afresh"
    )
    assert not (run.run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize("text", ["{", '{"highest": 3}', '["highest", 3]', '{"highest": "x"}'])
def test_a_versions_file_that_cannot_be_read_is_a_resume_error(tmp_path: Path, text: str) -> None:
    """Not JSON was refused; a valid JSON without its numbers was a KeyError or TypeError."""
    (tmp_path / resume.VERSIONS).write_text(text)
    with pytest.raises(resume.ResumeError, match=r"does not hold the highest weight version"):
        resume.VersionLedger.open(tmp_path)


FULL_DISK_SAVE = """
import resource, signal, sys
from pathlib import Path
from reins.trainer import checkpoint
from reins.trainer.backend import BackendConfig, TorchBackend
from transformers import AutoModelForCausalLM

run_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
backend = TorchBackend(AutoModelForCausalLM.from_pretrained(model_dir), BackendConfig())
state = checkpoint.TrainerState(2, 4, 1, checkpoint.capture_rng(), [0, 1])
checkpoint.save(run_dir, backend, state, keep=2)
# From here no file may grow past 100 kB, as on a disk that just filled up: writes fail.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
state.next_step = 4
try:
    checkpoint.save(run_dir, backend, state, keep=2)
except checkpoint.CheckpointWriteError as error:
    print("refused:", error)
"""


def test_a_checkpoint_the_disk_cannot_hold_is_a_clear_error_that_leaves_no_partial_files(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """torch's write failure (`RuntimeError: [enforce fail at inline_container.cc] unexpected
    pos`) stopped `reins train` with a traceback, and the half-written staging folder kept the
    space a full disk lacked until a resume."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK_SAVE, str(run_dir), str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert len(said) == 1, done.stdout
    assert "checkpoint step-000004 could not be written" in said[0]
    assert "`--resume` goes on from step-000002" in said[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002"]
    assert checkpoint.latest(run_dir) == run_dir / "checkpoints" / "step-000002"
    assert checkpoint.read_state(run_dir / "checkpoints" / "step-000002").next_step == 2


def test_a_sharded_checkpoint_the_disk_cannot_hold_is_the_same_clear_error(
    tmp_path: Path,
) -> None:
    """A sharded save (`torch.distributed.checkpoint`) reports a failed write as a
    `CheckpointException`, a BaseException, which the save's error handling let through: a
    traceback, and the partial folder left on the full disk."""
    from torch.distributed.checkpoint.api import CheckpointException

    class FullDisk:
        def save_checkpoint(self, folder: Path) -> None:
            folder.mkdir(parents=True)
            (folder / "__0_0.distcp").write_bytes(b"half")
            full = OSError(28, "No space left on device")
            raise CheckpointException("save failed", {0: (full, None)})  # type: ignore[dict-item]

    state = checkpoint.TrainerState(1, 2, 0, checkpoint.capture_rng(), [0])
    with pytest.raises(checkpoint.CheckpointWriteError) as refused:
        checkpoint.save(tmp_path, FullDisk(), state, keep=2)  # type: ignore[arg-type]
    said = str(refused.value)
    assert "step-000001 could not be written" in said and "\n" not in said, said
    assert "(rank 0: [Errno 28] No space left on device)" in said, said
    assert list((tmp_path / "checkpoints").iterdir()) == []
