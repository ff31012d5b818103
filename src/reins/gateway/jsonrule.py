"""The gateway's one rule for JSON, on every write path: keep only what JSON can carry faithfully.

A value is refused, with the field that holds it, when it is
- a number that is not finite: `NaN`, `Infinity`, or one past a double's range (`1e400`, a
  5,000-digit integer). RFC 8259 has no such numbers; Python's `json` reads them, SQLite then
  calls the document malformed and PostgreSQL refuses it, so a stored one would break every
  later read;
- a string holding an unpaired UTF-16 surrogate (`"\\ud800"`): it has no UTF-8 form, so it can
  be neither stored nor answered;
- nested deeper than `MAX_DEPTH` arrays and objects (readers and serializers recurse).

Integers past 64 bits are read as doubles (as JavaScript reads them); every other JSON value is
kept as sent. The rule is applied where a value enters: request bodies are parsed with `parse`
(and the proxy parses the engine's answers with it), and the store encodes every document it
writes with `encode`, which refuses the same values, so no caller can store an unreadable row.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import pydantic_core

from reins.samples.records import CheckedTokenIds

MAX_DEPTH = 200
"""Levels of arrays and objects a document may nest: a value inside more is refused (an empty
array or object may sit at the next level). This is pydantic-core's reader's own limit, which
`parse` uses as its depth check; `tests/gateway/test_json_rule.py` holds the boundary."""

Loc = tuple[str | int, ...]
Problem = Literal["non_finite_number", "unpaired_surrogate", "too_deep", "json_invalid"]

_SURROGATE = re.compile("[\ud800-\udfff]")
_MESSAGES: dict[Problem, str] = {
    "non_finite_number": (
        "NaN, Infinity and numbers past a double's range are not JSON; send a finite number "
        "(or null, or a string)"
    ),
    "unpaired_surrogate": (
        "the string holds an unpaired UTF-16 surrogate, which has no UTF-8 form; send valid "
        "Unicode text"
    ),
    "too_deep": f"a value is nested more than {MAX_DEPTH} levels deep in arrays and objects",
    "json_invalid": "the document is not JSON",
}
# Where a too-deep value sits, the path is cut to this many parts (the rest is one bracket each).
_LOC_PARTS_SHOWN = 12


class JsonRuleError(ValueError):
    """A value the rule refuses: `loc` is where it sits, `kind` what is wrong."""

    def __init__(self, loc: Loc, kind: Problem, detail: str | None = None) -> None:
        # A key may hold the very surrogate refused: shown escaped, so the error can be sent.
        self.loc = tuple(_printable(part) if isinstance(part, str) else part for part in loc)
        self.kind = kind
        self.msg = detail or _MESSAGES[kind]
        where = ".".join(str(part) for part in self.loc) or "the document"
        super().__init__(f"{where}: {self.msg}")

    def error(self) -> dict[str, Any]:
        """As one pydantic-style error (`loc`, `msg`, `type`), for a 422 answer; a malformed
        document as FastAPI reports one (`ctx.error` says where)."""
        if self.kind == "json_invalid":
            return {
                "loc": self.loc,
                "msg": "JSON decode error",
                "type": self.kind,
                "ctx": {"error": self.msg},
            }
        return {"loc": self.loc, "msg": self.msg, "type": self.kind}


@dataclass(frozen=True, slots=True)
class Encoded:
    """A document that passed the rule, with the JSON text the store writes for it."""

    value: Any
    text: str


def parse(body: bytes | str, loc: Loc = ("body",), under: int = 0) -> Any:
    """A JSON document under the rule; raises `JsonRuleError` naming the first bad field.
    `under`: the levels the document will be stored under (a proxied request sits one level
    down in its call's record), which its own nesting may not use.

    orjson reads it (and refuses NaN, Infinity, overflowing numbers, unpaired surrogates and
    invalid UTF-8 in the same pass, in Rust); a document with more brackets than `MAX_DEPTH` is
    read again by pydantic-core's reader, whose recursion limit is `MAX_DEPTH`, for its depth
    only. A refused document is read once more by Python's lenient `json` to name the field.
    """
    try:
        value = orjson.loads(body)
        if _brackets(body) + under > MAX_DEPTH:
            pydantic_core.from_json(_nested(body, under))
        return value
    except ValueError:  # orjson.JSONDecodeError and pydantic-core's errors are ValueErrors
        raise _explain(body, loc, under) from None


def _nested(body: bytes | str, under: int) -> bytes | str:
    """`body` inside `under` arrays: as deep as it will be stored."""
    if not under:
        return body
    if isinstance(body, bytes):
        return b"[" * under + body + b"]" * under
    return "[" * under + body + "]" * under


def check(value: Any, loc: Loc = ()) -> None:
    """Raises `JsonRuleError` if a value built in Python (an engine's answer parsed elsewhere, a
    record) breaks the rule."""
    encode(value, loc)


def encode(value: Any, loc: Loc = ()) -> Encoded:
    """The JSON text of a value under the rule (what the store writes); raises `JsonRuleError`.

    One pass of pydantic-core's encoder, which refuses surrogates and deep nesting itself and
    writes non-finite floats as bare `NaN`/`Infinity`; a text that contains those words is walked
    to tell a number from a string that merely says so. (A Python int past a double's range is
    written as its digits: only `parse` and `find` refuse it, and values read by `parse` hold
    none.)

    An object's leading values that are `CheckedTokenIds` (a proxied call's token IDs, checked
    ints when the call was recorded) are written from their int32 arrays: for a long prompt
    the walk and the rule's scans over its digits were most of the encoding.
    """
    if type(value) is dict and value:
        leading = _leading_token_ids(value)
        if leading:
            return _encode_after_token_ids(value, leading, loc)
    return _encode_plain(value, loc)


def _encode_plain(value: Any, loc: Loc) -> Encoded:
    try:
        raw = pydantic_core.to_json(value, inf_nan_mode="constants")
    except pydantic_core.PydanticSerializationError:
        problem = find(value, loc)
        if problem is None:
            raise
        raise problem from None
    suspect = b"NaN" in raw or b"Infinity" in raw
    if not suspect and _brackets(raw) > MAX_DEPTH:
        try:
            pydantic_core.from_json(raw)
        except ValueError:
            suspect = True
    if suspect:
        problem = find(value, loc)
        if problem is not None:
            raise problem
    return Encoded(value, raw.decode())


def _leading_token_ids(value: dict[str, Any]) -> int:
    """How many of the object's first values are token ID lists whose arrays can be written."""
    count = 0
    for item in value.values():
        if type(item) is not CheckedTokenIds or len(item) != item.array.size:
            break
        count += 1
    return count


def _encode_after_token_ids(value: dict[str, Any], leading: int, loc: Loc) -> Encoded:
    """`encode`'s text for an object whose first `leading` values are `CheckedTokenIds`: those
    from their arrays (ints, which the rule has nothing to refuse in), the rest as usual."""
    rest = encode(dict(itertools.islice(value.items(), leading, None)), loc)
    try:
        head = b",".join(
            orjson.dumps(key) + b":" + orjson.dumps(ids.array, option=orjson.OPT_SERIALIZE_NUMPY)
            for key, ids in itertools.islice(value.items(), leading)
        )
    except orjson.JSONEncodeError:  # a key the rule refuses: said by the usual path
        return _encode_plain(value, loc)
    tail = "}" if rest.text == "{}" else "," + rest.text[1:]
    return Encoded(value, "{" + head.decode() + tail)


def find(value: Any, loc: Loc = (), under: int = 0) -> JsonRuleError | None:
    """The first place where a Python value breaks the rule, walking it (without recursion);
    `under` as `parse` takes it."""
    stack: list[tuple[Any, Loc, int]] = [(value, loc, under)]
    while stack:
        item, where, depth = stack.pop()
        kind = type(item)
        if kind is float:
            if not math.isfinite(item):
                return JsonRuleError(where, "non_finite_number")
        elif kind is str:
            if _SURROGATE.search(item):
                return JsonRuleError(where, "unpaired_surrogate")
        elif isinstance(item, dict | list | tuple):
            if depth >= MAX_DEPTH and item:
                return _too_deep(_cut(where), under)
            if isinstance(item, dict):
                children: Sequence[tuple[str | int, Any]] = list(item.items())
                for key, _ in children:
                    if isinstance(key, str) and _SURROGATE.search(key):
                        return JsonRuleError((*where, key), "unpaired_surrogate")
            else:
                children = list(enumerate(item))
            stack.extend((child, (*where, key), depth + 1) for key, child in reversed(children))
        elif isinstance(item, int) and not isinstance(item, bool) and item.bit_length() > 1024:
            return JsonRuleError(where, "non_finite_number")  # past a double's range
        elif isinstance(item, float) and not math.isfinite(item):
            return JsonRuleError(where, "non_finite_number")
    return None


def _too_deep(where: Loc, stored_under: int) -> JsonRuleError:
    if not stored_under:
        return JsonRuleError(where, "too_deep")
    levels = "1 level" if stored_under == 1 else f"{stored_under} levels"
    detail = (
        f"a value is nested more than {MAX_DEPTH - stored_under} levels deep in arrays and "
        f"objects: the gateway stores this document {levels} down in its record, where "
        f"{MAX_DEPTH} is the limit"
    )
    return JsonRuleError(where, "too_deep", detail)


def _printable(text: str) -> str:
    """`text` with unpaired surrogates written as `\\udXXX` escapes."""
    return text.encode("utf-8", "backslashreplace").decode() if _SURROGATE.search(text) else text


def _brackets(text: bytes | str) -> int:
    """An upper bound of a document's depth."""
    if isinstance(text, str):
        return text.count("[") + text.count("{")
    return text.count(b"[") + text.count(b"{")


def _cut(loc: Loc) -> Loc:
    return loc if len(loc) <= _LOC_PARTS_SHOWN else loc[:_LOC_PARTS_SHOWN]


def _lenient_int(text: str) -> int | float:
    # Python refuses to read integers of more than 4,300 digits; any past ~309 is infinite as a
    # double, which is how `find` reports it.
    return float(text) if len(text) > 400 else int(text)


def _explain(body: bytes | str, loc: Loc, under: int = 0) -> JsonRuleError:
    """Why `parse` refused a document, with the field: read it leniently and walk it."""
    if isinstance(body, bytes):
        try:
            # As `json.loads` decodes it: a surrogate's bytes pass, to be named by `find`.
            body.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as error:
            # orjson says "str is not valid UTF-8: surrogates not allowed: line 1 column 1"
            # wherever the byte is and whatever it is (a Latin-1 "é", the first of a gzip).
            return JsonRuleError(
                loc,
                "json_invalid",
                f"the document is not UTF-8 text (byte 0x{body[error.start]:02x} at offset "
                f"{error.start}); send JSON encoded as UTF-8",
            )
    try:
        value = json.loads(body, parse_int=_lenient_int, parse_constant=float)
    except RecursionError:
        return _too_deep(loc, under)
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        return JsonRuleError(loc, "json_invalid", _malformed(body, error))
    problem = find(value, loc, under)
    if problem is not None:
        return problem
    return JsonRuleError(loc, "json_invalid", _malformed(body, None))


def _malformed(body: bytes | str, error: ValueError | None) -> str:
    """orjson's own description of a malformed document (with its line and column)."""
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError as refused:
        return str(refused)
    return str(error) if error is not None else _MESSAGES["json_invalid"]
