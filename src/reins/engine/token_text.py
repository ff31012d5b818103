"""A token as OpenAI's logprobs show it: its text, and the exact bytes it stands for.

The text is the token decoded alone (" world", not the vocabulary's piece "Ġworld"), as vLLM
shows it. A byte-level BPE token (GPT-2's scheme: SmolLM2, Qwen, Llama 3) may hold part of a
multi-byte character; its text then ends in U+FFFD, and its bytes are still the exact ones, read
from the piece through the byte-level alphabet, so that a client joining the bytes of a response's
tokens gets its UTF-8 text back (what OpenAI's `bytes` field is for). Other tokenizers' bytes are
their text's UTF-8.
"""

from __future__ import annotations

from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode


class TokenTexts:
    """Each token's (text, bytes), kept once computed (a response repeats its tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_of: dict[str, int] | None = (
            {char: byte for byte, char in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]
            if type(decoder).__name__ == "ByteLevel"
            else None
        )
        self._known: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._compute(token_id)
        return known

    def text(self, token_id: int) -> str:
        return self(token_id)[0]

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        # Added tokens (`<|im_end|>`, `<tool_call>`) are stored as their text, not byte-level.
        if self._byte_of is not None and token_id not in self.tokenizer.added_tokens_decoder:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(char in self._byte_of for char in piece):
                return text, [self._byte_of[char] for char in piece]
        return text, list(text.encode())
