"""`reins train`'s config: a mistake in the file or in `--set` is a `ConfigError` that names the
field, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reins.schemas import RolloutSpec
from reins.trainer.config import ConfigError, load_config


def write_config(folder: Path, extra: str = "") -> Path:
    (folder / "train.jsonl").write_text('{"input": 1}\n')
    path = folder / "config.yaml"
    path.write_text(f"tasks: train.jsonl\nagent: 'true'\n{extra}")
    return path


def test_a_dotted_override_of_a_field_that_is_no_group_names_it(tmp_path: Path) -> None:
    path = write_config(tmp_path, "steps: 30\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path, ["steps.x=2"])
    assert str(raised.value) == (
        "override 'steps.x=2': steps is 30, not a group of fields, so it has no 'x' to set"
    )
    with pytest.raises(ConfigError, match=r"^override 'lora.r=8': lora is 3, not a group"):
        load_config(path, ["lora=3", "lora.r=8"])


def test_a_dotted_override_fills_a_group_left_null_in_the_file(tmp_path: Path) -> None:
    loaded = load_config(write_config(tmp_path, "lora:\n"), ["lora.r=8"])
    assert loaded.lora is not None
    assert (loaded.lora.r, loaded.lora.alpha) == (8, 32)


def test_an_override_that_is_not_yaml_and_a_file_not_utf8_are_config_errors(
    tmp_path: Path,
) -> None:
    """Both were tracebacks (a yaml ParserError, a UnicodeDecodeError)."""
    path = write_config(tmp_path)
    with pytest.raises(ConfigError, match=r"^override 'lr=\[bad': its value is not YAML"):
        load_config(path, ["lr=[bad"])
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("tasks: café.jsonl\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"cannot read .*latin1\.yaml: 'utf-8' codec"):
        load_config(latin1)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("lr=.inf", "lr: Input should be a finite number"),
        ("fill_reward=.nan", "fill_reward: Input should be a finite number"),
        ("fill_reward=1e13", "fill_reward: Input should be less than or equal to 1000000000000"),
        ("train_temperature=.inf", "train_temperature: Input should be a finite number"),
        ("betas=[.nan, 0.9]", r"betas\.0: Input should be a finite number"),
        ("lora.dropout=.nan", r"lora\.dropout: Input should be a finite number"),
        ("group_size=1", "group_size: Input should be greater than or equal to 2"),
        ("tis_cap=0.5", "tis_cap: Input should be greater than or equal to 1"),
    ],
)
def test_values_that_would_train_nothing_or_nan_weights_are_refused(
    tmp_path: Path, override: str, says: str
) -> None:
    """`lr: .inf` and `fill_reward: .nan` were accepted and made every weight NaN (then
    checkpointed and served); a group of one has no baseline, so every advantage was 0."""
    with pytest.raises(ConfigError, match=f"^invalid training config: {says}"):
        load_config(write_config(tmp_path), [override])


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("betas=[1.5, 0.999]", r"betas\.0: Input should be less than 1"),
        ("betas=[0.9, -0.1]", r"betas\.1: Input should be greater than or equal to 0"),
        ("lora.target_modules=[]", r"lora\.target_modules: List should have at least 1 item"),
        ("clip_low=1.5", "clip_low: Input should be less than 1"),
    ],
)
def test_values_torch_or_peft_refused_late_or_that_did_nothing_are_refused_when_read(
    tmp_path: Path, override: str, says: str
) -> None:
    """AdamW refused `betas: [1.5, 0.999]` and peft an empty `lora.target_modules` only after
    the model had loaded, in their own words (`error: Invalid beta parameter at index 0: 1.5`,
    `No target_modules passed but also no target_parameters found`), naming no field;
    `clip_low: 1.5` clipped the ratio below at -0.5, which it never reaches: no clip at all."""
    with pytest.raises(ConfigError, match=f"^invalid training config: {says}"):
        load_config(write_config(tmp_path), [override])


def test_an_engine_url_is_taken_with_or_without_its_apis_v1(tmp_path: Path) -> None:
    """`reins engine` prints its URL with `/v1`, and a run given it failed with a 404 at
    `/v1/v1/models`; `reins doctor --engine` wanted the `/v1`."""
    urls = "[http://127.0.0.1:8000/v1, 'http://127.0.0.1:8001/', http://10.0.0.2:8000/v1/]"
    loaded = load_config(write_config(tmp_path), [f"engine_url={urls}"])
    assert loaded.engine_urls == [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8001",
        "http://10.0.0.2:8000",
    ]


def test_help_config_lists_every_field_its_values_and_a_groups_fields() -> None:
    """`weight_decay`, `betas`, `estimator` and `advantage_level` had no text, the names a
    field takes were not said, `lora`'s fields were missing, `runs_dir` read `PosixPath(...)`."""
    from reins.trainer.config import TrainConfig, describe_fields

    text = describe_fields()
    heads = [line for line in text.splitlines() if not line.startswith(" ")]
    named = [line.split(":", 1)[0] for line in heads]
    assert [n for n in named if "." not in n] == list(TrainConfig.model_fields)
    assert [n for n in named if n.startswith("lora.")] == [
        "lora.r", "lora.alpha", "lora.dropout", "lora.target_modules",
    ]  # fmt: skip
    assert "runs_dir: .reins/runs" in heads
    assert "estimator: grpo  (one of: grpo, rloo)" in heads
    assert "advantage_level: rollout  (one of: rollout, sample)" in heads
    lines = text.splitlines()
    undocumented = [
        line for line, after in zip(lines, [*lines[1:], ""], strict=True)
        if not line.startswith(" ") and not after.startswith("    ")
    ]  # fmt: skip
    assert undocumented == []


def test_tasks_a_preparation_step_makes_are_named_with_it_when_missing(tmp_path: Path) -> None:
    """`reins train examples/swe/config.yaml` before `reins swe prepare` said only "No such
    file"."""
    from reins.trainer.data import load_tasks

    (tmp_path / "prepare.yaml").write_text("repos: []\n")
    missing = tmp_path / "prepared" / "train.jsonl"
    with pytest.raises(ValueError, match=r"prepare them first: reins swe prepare .*prepare\.yaml$"):
        load_tasks(missing)
    with pytest.raises(ValueError, match=r"No such file or directory: '[^']*'$"):
        load_tasks(tmp_path / "elsewhere" / "deeper" / "train.jsonl")


@pytest.mark.parametrize("task_id", ["é1", "task٣", "a b", "a/b"])
def test_a_task_id_outside_the_gateways_ids_is_refused_where_it_is_read(
    tmp_path: Path, task_id: str
) -> None:
    """A non-ASCII letter passed `str.isalnum`: the tasks loaded, and every declare of the run
    then failed with pydantic's pattern error (`RolloutSpec`), after the model had loaded."""
    from reins.trainer.data import load_tasks
    from reins.trainer.loop import fitted_id

    tasks = tmp_path / "train.jsonl"
    tasks.write_text(json.dumps({"id": task_id, "input": {}}) + "\n")
    with pytest.raises(ValueError, match=r"train\.jsonl:1: task id .* \[A-Za-z0-9\._:-\]$"):
        load_tasks(tasks)
    tasks.write_text(json.dumps({"id": "ok-1.a:b_c", "input": {}}) + "\n")
    (task,) = load_tasks(tasks)
    RolloutSpec(rollout_id=fitted_id("run.t0000000.", task.id, ".0"))  # what the trainer declares


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("[]", "engine_url: an empty list"),
        ("127.0.0.1:8000", "engine_url '127.0.0.1:8000': give http://HOST:PORT"),
        ("[http://127.0.0.1:1, 'localhost:2']", "engine_url 'localhost:2'"),
    ],
)
def test_an_engine_url_that_is_none_is_refused_when_the_config_is_read(
    tmp_path: Path, value: str, says: str
) -> None:
    """It was refused after the model and the gateway had loaded."""
    with pytest.raises(ConfigError, match=says):
        load_config(write_config(tmp_path), [f"engine_url={value}"])


@pytest.mark.parametrize(
    ("device", "environ", "expected"),
    [
        ("cpu", {"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, "cpu"),
        ("cuda", {"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, "cuda:1"),
        ("cuda", {}, "cuda"),
        ("cuda:1", {}, "cuda:1"),
        ("cuda:0", {"LOCAL_RANK": "0", "WORLD_SIZE": "1"}, "cuda:0"),
    ],
)
def test_each_torchrun_rank_trains_on_the_gpu_of_its_local_rank(
    device: str, environ: dict[str, str], expected: str
) -> None:
    from reins.trainer.runtime import rank_device

    assert rank_device(device, environ) == expected


def test_a_gpu_named_by_index_under_several_ranks_is_refused() -> None:
    """Every rank's model went to that one GPU."""
    from reins.trainer.runtime import rank_device

    with pytest.raises(ValueError, match="puts every rank on that one GPU: set device to cuda"):
        rank_device("cuda:0", {"LOCAL_RANK": "1", "WORLD_SIZE": "2"})


def test_the_config_a_run_keeps_reads_back_from_its_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tasks given relative to where the command ran were saved so: read back from the run
    folder's `config.yaml` (relative paths are read against the file's folder), `--resume`
    looked for `RUN_DIR/data/train.jsonl`."""
    import yaml

    from reins.trainer.runtime import saved_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"input": 1}\n')
    config = load_config(None, ["tasks=data/train.jsonl", "agent=mod:fn", "runs_dir=runs"])
    run_dir = tmp_path / "runs" / "x"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved_config(config)))
    again = load_config(run_dir / "config.yaml")
    assert again.tasks == tmp_path / "data" / "train.jsonl"
    assert again.runs_dir == tmp_path / "runs"
    assert again.model_dump(exclude={"tasks", "runs_dir"}) == config.model_dump(
        exclude={"tasks", "runs_dir"}
    )


def test_a_check_across_fields_reads_as_its_own_message(tmp_path: Path) -> None:
    """It read `invalid training config: : Value error, stale_groups: ...`."""
    with pytest.raises(ConfigError) as raised:
        load_config(write_config(tmp_path), ["stale_groups=correct"])
    assert str(raised.value) == (
        "invalid training config: stale_groups: correct trains stale groups with the "
        "importance correction: set tis_cap or rollout_mask_ratio too"
    )
