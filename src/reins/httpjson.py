"""A JSON response that can send any string a message quotes: a text with an unpaired UTF-16
surrogate (an engine's error that escaped one, a harness's input echoed in an error) has no UTF-8
form, and Starlette's response then failed the answer with a bare 500. It goes out as its
`\\udXXX` escape, as the engine wrote it; every other answer is Starlette's, byte for byte."""

from __future__ import annotations

import json
from typing import Any

from starlette import responses


class JSONResponse(responses.JSONResponse):
    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            text = json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
            return text.encode()
