"""Whether a path is a Hugging Face model folder, said before transformers is asked to load it:
transformers takes a folder that does not exist for a hub id (and answers about repo id
syntax), and a folder without a model with advice about tokenizer packages."""

from __future__ import annotations

from pathlib import Path


def check_model_folder(folder: Path, *, setting: str = "--model") -> None:
    """A ValueError naming `setting` (the flag or config field that chose `folder`) when it is
    no model folder: no folder there, or one without the `config.json` `save_pretrained` writes."""
    if not folder.is_dir():
        raise ValueError(
            f"{setting} {folder} is not a folder: name a Hugging Face model folder (offline, "
            "a hub id cannot be fetched)"
        )
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{setting} {folder} is not a Hugging Face model folder (it has no config.json): "
            "name a folder written by save_pretrained, with its tokenizer"
        )
