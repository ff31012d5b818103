"""A token as OpenAI's logprobs show it: its text, and the exact bytes it stands for.

The text is the token's own text (" world", not the vocabulary's piece "Ġworld"), as vLLM shows
it. A token may hold part of a multi-byte character; its text then ends in U+FFFD, and its bytes
are still the exact ones, so that a client joining the bytes of a response's tokens gets its UTF-8
text back (what OpenAI's `bytes` field is for):
- byte-level BPE (GPT-2's scheme: SmolLM2, Qwen, Llama 3): the piece read through the byte-level
  alphabet;
- SentencePiece's scheme (Llama 2, Mistral, Gemma: pieces with "▁" for a space, `<0xNN>` for a
  byte the vocabulary lacks): the piece with "▁" as a space (decoding a token alone strips the
  space a word's first piece starts with), a byte piece its byte;
- any other tokenizer: the token decoded alone, and that text's UTF-8.
Added tokens (`<|im_end|>`, `<tool_call>`) are their text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

SPACE_PIECE = "▁"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """Each token's (text, bytes), kept once computed (a response repeats its tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = _decoder(tokenizer)
        self._byte_of: dict[str, int] | None = (
            {char: byte for byte, char in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]
            if decoder.get("type") == "ByteLevel"
            else None
        )
        self._sentencepiece = _writes_spaces_as_pieces(decoder)
        # Read once: transformers builds this mapping afresh at each access.
        self._added = set(tokenizer.added_tokens_decoder)
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
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        # Added tokens are stored as their text, in neither scheme.
        if not isinstance(piece, str) or token_id in self._added:
            return text, list(text.encode())
        if self._byte_of is not None and all(char in self._byte_of for char in piece):
            return text, [self._byte_of[char] for char in piece]
        if self._sentencepiece:
            byte = _BYTE_PIECE.fullmatch(piece)
            if byte is not None:
                return text, [int(byte.group(1), 16)]
            shown = piece.replace(SPACE_PIECE, " ")
            return shown, list(shown.encode())
        return text, list(text.encode())


def _decoder(tokenizer: Any) -> dict[str, Any]:
    """The fast tokenizer's decoder as its JSON (empty for a slow tokenizer)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return {}
    state: dict[str, Any] = json.loads(decoder.__getstate__())
    return state


def _writes_spaces_as_pieces(decoder: dict[str, Any]) -> bool:
    """Whether the decoder turns "▁" into a space (Metaspace, or a Replace in a sequence)."""
    steps = decoder.get("decoders") if decoder.get("type") == "Sequence" else [decoder]
    for step in steps or ():
        if step.get("type") == "Metaspace":
            return True
        if step.get("type") == "Replace" and step.get("pattern", {}).get("String") == SPACE_PIECE:
            return True
    return False
