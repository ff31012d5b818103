"""Token text from the policy's tokenizer, for the rollout page (optional).

Without it the page shows response tokens by ID (unless the harness asked the engine for
logprobs, whose answer carries each token's text) and split reasons from token evidence only
(`branch` or `unknown`). With `REINS_MONITOR_TOKENIZER` naming a Hugging Face tokenizer folder
(the policy's, e.g. `~/.cache/reins/models/SmolLM2-135M-Instruct`) it shows each token's text
and names every reason (`retokenized`, `template`, `transformed`, `branch`). Needs
`transformers` (the `train` extra).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray


class TokenizerError(Exception):
    """The tokenizer cannot be loaded; the message says what to do."""


@dataclass(frozen=True)
class TokenText:
    """`texts` for the token strip, `decode` for `reins.samples.diagnose_split`."""

    tokenizer: Any

    def texts(self, ids: Sequence[int]) -> list[str]:
        """Each token decoded alone, as `batch_decode` does, through the Rust tokenizer when
        there is one (a long rollout's 90k tokens: ~0.2 s against ~1 s)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return [str(t) for t in self.tokenizer.batch_decode([[i] for i in ids])]
        decoded: list[str] = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        if getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return [str(self.tokenizer.clean_up_tokenization(t)) for t in decoded]
        return decoded

    def decode(self, ids: NDArray[np.int32]) -> str:
        return str(self.tokenizer.decode(ids.tolist()))


@functools.lru_cache(maxsize=4)
def load(path: str) -> TokenText:
    """The tokenizer in folder `path`, loaded once per process."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise TokenizerError(
            f"REINS_MONITOR_TOKENIZER={path} is not a folder: name a Hugging Face tokenizer "
            "folder (the policy's), or unset it"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise TokenizerError(
            "REINS_MONITOR_TOKENIZER needs transformers: pip install 'reins[train]'"
        ) from error
    try:
        return TokenText(AutoTokenizer.from_pretrained(str(folder)))
    except (OSError, ValueError) as error:
        raise TokenizerError(f"cannot load a tokenizer from {folder}: {error}") from error
