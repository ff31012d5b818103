"""The training run's configuration: one pydantic model, loaded from YAML, overridable per field.

Every field's default lives here and nowhere else; the docstring under each field is its
documentation (`reins train --help-config` prints them).
"""

from __future__ import annotations

import textwrap
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from reins.samples.advantage import AdvantageEstimator, AdvantageLevel
from reins.samples.loss import LossAggregation
from reins.schemas import REWARD_LIMIT
from reins.serving import engine_root


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which field and why."""


DecayRate = Annotated[float, Field(ge=0, lt=1)]
"""One of AdamW's `betas` (torch refuses others, once the model has loaded)."""


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    r: int = Field(default=16, ge=1)
    """Rank of the adapters."""
    alpha: int = Field(default=32, ge=1)
    """Scale numerator (the update is scaled by alpha / r)."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Module names that get adapters (at least one)."""


class TrainConfig(BaseModel):
    # No inf or NaN anywhere: `lr: .inf` or `fill_reward: .nan` made every weight NaN.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    # -- run ---------------------------------------------------------------------------------
    run_name: str = Field(default="run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    """Names the run's folder and tags its rollouts (`metadata.run`)."""
    runs_dir: Path = Path(".reins") / "runs"
    """Where run folders live: `<runs_dir>/<run_name>/` holds metrics, checkpoints, logs."""
    seed: int = 0
    """Seeds the task order, the engine's sampling and torch."""
    steps: int = Field(default=30, ge=1)
    """Policy updates to make."""

    # -- data --------------------------------------------------------------------------------
    tasks: Path
    """Training tasks, JSONL: one object per line with `id` (optional) and `input` (any JSON)."""
    val_tasks: Path | None = None
    """Held-out tasks, same format, run in `val` mode (greedy by default)."""
    tasks_per_step: int = Field(default=8, ge=1)
    """Tasks (GRPO groups) per policy update."""
    group_size: int = Field(default=4, ge=2)
    """Rollouts per task; client-chosen ids make a retried declare harmless. At least 2: GRPO
    and RLOO take each rollout's advantage against its group's others (a group of one has no
    baseline, so every advantage would be 0 and nothing would train)."""
    val_every: int = Field(default=5, ge=0)
    """Validate before step 0 and every this many steps, and after the last (0: never)."""
    val_temperature: float | None = Field(default=0.0, ge=0)
    """Temperature the gateway sets on `val` calls (None: the harness's own)."""
    train_temperature: float = Field(default=1.0, gt=0)
    """Temperature the gateway sets on `train` calls; the trainer's policy is
    softmax(logits / train_temperature), the distribution the engine sampled from."""

    # -- agents ------------------------------------------------------------------------------
    agent: str
    """The harness: `module:function` or a shell command line (see `reins controller`). A module
    found neither in the working directory (where agents run) nor on Python's path is refused
    before the run starts."""
    max_parallel: int = Field(default=16, ge=1)
    """Agents running at once."""
    rollout_timeout_s: float = Field(default=300.0, gt=0)
    """An attempt running longer is killed and retried; the trainer fails a rollout still not
    finished after `max_attempts` such timeouts."""
    max_attempts: int = Field(default=2, ge=1)
    """Attempts per rollout (a crash or a timeout opens the next one)."""
    failed_rollouts: Literal["drop_group", "fill"] = "drop_group"
    """A failed rollout drops its whole group from the update, or counts with `fill_reward`."""
    fill_reward: float = Field(default=0.0, ge=-REWARD_LIMIT, le=REWARD_LIMIT)
    """Reward of a failed rollout under `failed_rollouts: fill` (it trains on its calls, if any)."""

    # -- schedule ----------------------------------------------------------------------------
    mode: Literal["sync", "async"] = "sync"
    """`sync`: declare, wait for every rollout, update. `async` (collocated, paper 3.1): keep
    rollouts running; update as soon as `tasks_per_step` whole groups finished."""
    max_staleness: int = Field(default=1, ge=0)
    """`async`: rollouts start at most this many versions ahead of the weights that will train on
    them; a group with a call served by an older version is dropped (and counted), or trained
    with the importance correction (`stale_groups`). `sync` bounds it at 0."""
    stale_groups: Literal["drop", "correct"] = "drop"
    """`async`: a group with a rollout more than `max_staleness` stale is dropped (its rollouts
    were generated for nothing: `rollouts/generated_per_trained`), or trained with the
    importance correction (`correct`: needs `tis_cap` or `rollout_mask_ratio`)."""
    drain_timeout_s: float = Field(default=300.0, gt=0)
    """`async`: how long an update waits for in-flight LLM calls before going on anyway."""

    # -- model and backend -------------------------------------------------------------------
    model: Path | None = None
    """A Hugging Face model folder; None: the default model (`reins model prepare`)."""
    backend: Literal["torch", "fsdp"] = "torch"
    """`torch`: the whole model in this process. `fsdp`: FSDP2, weights, gradients and AdamW
    states sharded over the ranks of `torchrun --nproc-per-node N --no-python reins train ...`
    (alone, one rank); rank 0 runs the job, the others follow (docs/trainer.md)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Parameter and compute dtype. bf16 stores the weights in bf16 (half the memory, and lossy
    small updates: keep `lr` large enough or use fp32). With `backend: fsdp`, bf16 is mixed
    precision: fp32 weights and AdamW states, bf16 forward and backward."""
    device: str | None = None
    """cpu, cuda, cuda:1...; None: cuda when present."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (peft)."""
    distributed_timeout_s: float = Field(default=6 * 3600.0, gt=0)
    """`backend: fsdp`: how long a collective may wait, and so how long the other ranks wait
    for rank 0's next update: more than the longest step's rollouts."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass: the update's activations are the largest
    part of the trainer's peak memory (docs/benchmarks.md, "Trainer memory"); off, the backward
    runs no second forward (faster updates where memory is plentiful)."""
    malloc_mmap_threshold_mb: float | None = Field(default=1.0, gt=0, le=32)
    """`reins train`'s process: blocks of at least this many MB get their own memory map,
    handed back to the system when freed (glibc's M_MMAP_THRESHOLD, fixed): the main job peaks
    at ~2.95 GB RSS instead of ~3.8, for ~20-25 % slower updates (docs/benchmarks.md, "Trainer
    memory"). None: glibc's dynamic threshold, which keeps freed tensors resident. An exported
    `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` or `MALLOC_TOP_PAD_` wins over it;
    elsewhere than glibc, unused. `runtime.train()` called from another program leaves that
    program's allocator alone (`runtime.configure_allocator` applies the setting)."""
    lr: float = Field(default=1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW's decoupled weight decay."""
    betas: tuple[DecayRate, DecayRate] = (0.9, 0.999)
    """AdamW's moment decay rates, each from 0 to below 1."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip."""
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """PPO ratio clip below 1: ratio >= 1 - clip_low (below 1: a ratio is never negative, so
    a bound at or below 0 would never clip)."""
    clip_high: float = Field(default=0.28, ge=0)
    """PPO ratio clip above 1: ratio <= 1 + clip_high (DAPO's clip-higher)."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """The PPO ratio's denominator: recomputed by the trainer before the update, or the
    engine's logprobs from the rollout. Their gap is logged either way (`policy/logprob_gap`)."""
    tis_cap: float | None = Field(default=None, ge=1)
    """Token-level truncated importance sampling: each token's loss weighed by
    min(trainer / engine probability, tis_cap), the engine's being the weights that sampled it
    (`reins.trainer.correction`). None: off. Needs `old_logprobs: recompute`. At least 1: a cap
    below would weigh down every on-policy token (ratio 1) rather than truncate."""
    rollout_mask_ratio: float | None = Field(default=None, gt=1)
    """Rollout-level masking: a rollout whose geometric-mean trainer/engine ratio is beyond this
    bound (either way) is left out of the update whole. None: off. Needs `old_logprobs:
    recompute`."""
    spanning_rollouts: Literal["keep", "drop"] = "keep"
    """`async`: a rollout whose calls were served by more than one weight version (it spanned an
    update) is trained (with its tokens' own ratios when a correction is on) or dropped with its
    group. Counted either way (`rollouts/spanning`)."""
    kl_to_initial: bool = False
    """Log the KL to the initial policy (k3 estimator; one more forward pass per micro-batch)."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Add `kl_coef * KL(initial)` to the loss (above 0, the KL is measured and logged whether
    `kl_to_initial` is set or not)."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Entropy bonus: subtract `entropy_coef * entropy` (the policy's entropy at each response
    token, weighted as the loss) from the loss, keeping the policy from settling on one answer.
    With it every sequence has a gradient, a group of equal rewards too: none is skipped, and
    an update with no advantage anywhere still steps. 0: off (docs/trainer.md)."""
    max_tokens_per_microbatch: int | None = Field(default=4096, ge=1)
    """Micro-batch bound for gradient accumulation (None: one micro-batch)."""
    num_minibatches: int = Field(default=1, ge=1)
    """Optimizer steps per batch of rollouts."""
    estimator: AdvantageEstimator = "grpo"
    """The advantage: `grpo` (reward minus the group's mean) or `rloo` (minus the mean of the
    group's other rollouts)."""
    normalize_std: bool = True
    """GRPO: divide by the group's std."""
    advantage_level: AdvantageLevel = "rollout"
    """Whose group statistics: `rollout` (each rollout's reward once, its samples share its
    advantage) or `sample` (each training sample counts, paper 3.3)."""
    loss_aggregation: LossAggregation = "rollout-mean"
    """Paper eq. 16 (default), `token-mean` (eq. 14) or `seq-mean-token-mean` (eq. 15)."""

    # -- services ----------------------------------------------------------------------------
    gateway_url: str | None = None
    """An existing gateway; None starts one in this process on SQLite in the run folder."""
    api_key: str | None = None
    """The gateway's admin key (env REINS_API_KEY when None)."""
    engine_url: str | list[str] | None = None
    """An external engine (`reins engine`, vLLM: `http://HOST:PORT`, with or without `/v1`) to
    publish to by save + reload, or a list of them: a fleet registered under one model name
    (each rollout sticks to one; every update is loaded by all, as the same version). None: the
    embedded engine in this process, sharing the trainer's weights."""
    engine_sleep: bool = False
    """vLLM engines of `engine_url` sleep during each update (level 2), giving their GPU memory
    to the optimizer step, then wake with the new weights: for vLLM collocated on the trainer's
    GPUs (docs/scale.md)."""
    max_batch: int = Field(default=16, ge=1)
    """Embedded engine: sequences decoded together."""
    max_model_len: int = Field(default=2048, ge=16)
    """Embedded engine: prompt + response tokens, at most."""
    prefix_cache_gb: float = Field(default=2.0, ge=0)
    """Embedded engine: GiB of KV kept to reuse across a rollout's calls (0: off); a weight
    update empties it."""

    # -- outputs -----------------------------------------------------------------------------
    checkpoint_every: int = Field(default=10, ge=0)
    """Save a checkpoint every this many steps and at the end (0: only at the end)."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Older checkpoints are removed."""
    tensorboard: bool = True
    """Also write TensorBoard scalars (when the `tensorboard` package is installed)."""

    @model_validator(mode="after")
    def _engine_urls_are_urls(self) -> TrainConfig:
        # Found when the config is read, not after the model and the gateway have loaded.
        if isinstance(self.engine_url, list) and not self.engine_url:
            raise ValueError("engine_url: an empty list; leave it out for the embedded engine")
        for url in self.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine_url {url!r}: give http://HOST:PORT (or .../v1)")
        return self

    @model_validator(mode="after")
    def _correction_needs_recomputed_logprobs(self) -> TrainConfig:
        correcting = self.tis_cap is not None or self.rollout_mask_ratio is not None
        if self.stale_groups == "correct" and not correcting:
            raise ValueError(
                "stale_groups: correct trains stale groups with the importance correction: set "
                "tis_cap or rollout_mask_ratio too"
            )
        if correcting and self.old_logprobs != "recompute":
            raise ValueError(
                "tis_cap and rollout_mask_ratio compare the trainer's recomputed logprobs with "
                "the engine's: they need old_logprobs: recompute (with `rollout` the PPO ratio "
                "is already taken against the engine's)"
            )
        return self

    def async_parallel_shortfall(self) -> str | None:
        """Why `max_parallel` holds back an async run's rollouts (None when it does not): async
        keeps `max_staleness + 1` steps of groups in flight, and the local runner runs at most
        `max_parallel` agents, so the rest queue and async overlaps less."""
        in_flight = self.tasks_per_step * self.group_size * (self.max_staleness + 1)
        if self.mode != "async" or self.max_parallel >= in_flight:
            return None
        return (
            f"async keeps up to {in_flight} rollouts in flight ({self.tasks_per_step} tasks x "
            f"{self.group_size} x (max_staleness {self.max_staleness} + 1)), but max_parallel "
            f"is {self.max_parallel}: the others wait for a free agent slot, which takes away "
            f"most of what async gains; set max_parallel to at least {in_flight} (plus the "
            "validation's tasks)"
        )

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.run_name

    @property
    def engine_urls(self) -> list[str]:
        """The external engines (none: the embedded one)."""
        if self.engine_url is None:
            return []
        urls = [self.engine_url] if isinstance(self.engine_url, str) else self.engine_url
        return [engine_root(url) for url in urls]


def load_config(path: Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """A config from a YAML file (relative paths resolved against its folder) and `key=value`
    overrides (values parsed as YAML: `lr=3e-5`, `lora.r=8`, `mode=async`)."""
    data = read_config_file(path, _PATH_FIELDS, overrides)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"invalid training config: {validation_problems(error)}") from error


# runs_dir stays relative to where the command runs (`.reins/runs`), as the default is.
_PATH_FIELDS = ("tasks", "val_tasks", "model")


def read_config_file(
    path: Path | None, path_fields: tuple[str, ...], overrides: list[str] | None = None
) -> dict[str, Any]:
    """The mapping in the YAML file at `path` (none: empty), its relative `path_fields` read
    from the file's folder, then `key=value` overrides (a dotted key sets a nested field; a
    relative path given here stays relative to where the command runs). ConfigError says
    what is wrong."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError, UnicodeDecodeError) as error:  # (not UTF-8 text)
            raise ConfigError(f"cannot read {path}: {error}") from error
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a mapping of fields, not {type(loaded).__name__}")
        data = dict(loaded)
        for key in path_fields:
            value = data.get(key)
            if isinstance(value, str) and not Path(value).is_absolute():
                data[key] = str(path.parent / value)
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        target = data
        *parents, leaf = key.split(".")
        for depth, parent in enumerate(parents):
            # A field left null (`lora:` in the file) is filled by its sub-fields; any other
            # value has none to set, and indexing into it would be a TypeError.
            if target.get(parent) is None:
                target[parent] = {}
            target = target[parent]
            if not isinstance(target, dict):
                field = ".".join(parents[: depth + 1])
                raise ConfigError(
                    f"override {item!r}: {field} is {target!r}, not a group of fields, so it "
                    f"has no {key[len(field) + 1 :]!r} to set"
                )
        try:
            target[leaf] = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as error:
            problem = str(error).replace("\n", " ")
            raise ConfigError(f"override {item!r}: its value is not YAML ({problem})") from error
    return data


def validation_problems(error: ValidationError) -> str:
    """`field.sub: message; ...` for each problem pydantic found. A check across fields (no
    location; its message names the fields) is its message alone: it read `: Value error,
    stale_groups: ...`."""
    problems = []
    for problem in error.errors():
        message = problem["msg"]
        if problem["type"] == "value_error":
            message = message.removeprefix("Value error, ")
        where = ".".join(str(part) for part in problem["loc"])
        problems.append(f"{where}: {message}" if where else message)
    return "; ".join(problems)


def describe_fields(model: type[BaseModel] = TrainConfig, prefix: str = "") -> str:
    """Every field with its default (as YAML writes it), the values it takes when they are a
    few names, and its documentation, for `--help-config`; a group's fields (`lora.r`) too."""
    lines = []
    for name, info in model.model_fields.items():
        if info.is_required():
            default = "required"
        else:
            value = info.get_default(call_default_factory=True)
            default = yaml.safe_dump(_plain(value), default_flow_style=True, width=1000).strip()
            default = default.removesuffix("\n...").removesuffix("...").strip()
        names = _choices(info.annotation)
        head = f"{prefix}{name}: {default}"
        if names:
            head += f"  (one of: {', '.join(names)})"
        doc = (info.description or "").strip()
        lines.append(head + ("\n" + textwrap.indent(doc, "    ") if doc else ""))
        group = _group(info.annotation)
        if group is not None:
            lines.append(describe_fields(group, f"{prefix}{name}."))
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value


def _choices(annotation: Any) -> list[str]:
    """The names a `Literal` field (or an optional one) takes."""
    if typing.get_origin(annotation) is Literal:
        return [str(arg) for arg in typing.get_args(annotation)]
    names: list[str] = []
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is Literal:
            names += [str(item) for item in typing.get_args(arg)]
    return names


def _group(annotation: Any) -> type[BaseModel] | None:
    """The model of a field that is a group of fields (`lora: LoraConfig | None`)."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
