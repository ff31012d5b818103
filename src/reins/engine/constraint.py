"""Structured output: the tokens a response may take next, from a grammar (llguidance).

A request's `response_format` (`json_object`, or `json_schema` with its schema), a forced
`tool_choice` (`required`, or a named function) and, with `tool_choice` auto, a tool marked
`strict` make a grammar, as vLLM's structured output does: at each step the tokens that cannot
continue it are masked out before the draw, and once the grammar is complete only
end-of-sequence is left. Calls are written in the engine's tool-call convention (`chat.py`):
`<tool_call>` blocks of `{"name": ..., "arguments": ...}`, the arguments following the function's
`parameters` schema. With `tool_choice` auto the text is free until the model opens a
`<tool_call>` (a lazy trigger): the call must then name an offered function, with arguments that
follow its schema when it is `strict` (vLLM applies its structural tags to auto calls only when a
tool is strict, as here). vLLM's own request field, `structured_outputs` (`json`, `regex`,
`choice`, `grammar` in Lark or GBNF, `json_object`, `structural_tag`), is read as vLLM reads it.
A structural tag (there, or as `response_format` `{"type": "structural_tag", ...}`) is
xgrammar's first form, `structures` (`begin`, `schema`, `end`) and `triggers`: free text until
the model writes a trigger, which must then go on as one of the structures whose `begin` starts
with it, its JSON following the structure's schema, then its `end`; free text again after.

The mask reshapes the distribution the token is drawn from, not the logprob reported for it,
which stays the policy's own (`sampling.py`), as vLLM reports raw logprobs.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

JSON_OPTIONS = {"whitespace_flexible": True}
"""vLLM's default for llguidance: any JSON whitespace between tokens."""


class ConstraintError(ValueError):
    """The request's structured output cannot be compiled (the message says why)."""


def response_grammar(
    response_format: Any,
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    *,
    parallel_tool_calls: bool = True,
    structured_outputs: Any = None,
) -> str | None:
    """The grammar of a chat request's answer, or None when it is free text. A forced tool
    choice wins over the answer's format (the answer is then a call): `required`, one call or
    more (one without `parallel_tool_calls`); a named function, one call of it (as vLLM
    answers)."""
    forced = _forced_tools(tools, tool_choice)
    if forced:
        several = parallel_tool_calls and tool_choice == "required"
        return _tool_call_grammar(forced, parallel=several)
    form = format_grammar(response_format, structured_outputs)
    if form is None and tool_choice in (None, "auto"):
        return _strict_calls_grammar(_functions(tools))
    return form


def format_grammar(response_format: Any, structured_outputs: Any = None) -> str | None:
    """The grammar of a `response_format` or of vLLM's `structured_outputs` (chat or
    completions; one of the two), or None for free text."""
    if structured_outputs is not None:
        if response_format is not None:
            raise ConstraintError("give `response_format` or `structured_outputs`, not both")
        return _vllm_grammar(structured_outputs)
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ConstraintError("`response_format` must be an object with a `type`")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_grammar({"type": "object"})
    if kind == "structural_tag":
        return _structural_tag_grammar(response_format, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ConstraintError("`response_format.json_schema` must be an object")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise ConstraintError("`response_format.json_schema.schema` must be an object")
        return _json_grammar(schema)
    raise ConstraintError(
        "`response_format.type` must be text, json_object, json_schema or structural_tag, "
        f"not {kind!r}"
    )


_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _vllm_grammar(structured: Any) -> str:
    """The grammar of vLLM's `structured_outputs`: exactly one kind of constraint."""
    if not isinstance(structured, dict):
        raise ConstraintError("`structured_outputs` must be an object")
    kinds = [kind for kind in _VLLM_KINDS if structured.get(kind) not in (None, False)]
    if len(kinds) != 1:
        raise ConstraintError(
            f"`structured_outputs` takes exactly one of {', '.join(_VLLM_KINDS)}; "
            f"got {', '.join(kinds) or 'none'}"
        )
    kind, value = kinds[0], structured[kinds[0]]
    flexible = structured.get("disable_any_whitespace") is not True
    import llguidance

    try:
        if kind == "json_object":
            return _json_grammar({"type": "object"}, flexible=flexible)
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict):
                raise ConstraintError("`structured_outputs.json` must be a JSON schema object")
            return _json_grammar(schema, flexible=flexible)
        if kind == "choice":
            if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
                raise ConstraintError("`structured_outputs.choice` must be a list of strings")
            return str(llguidance.grammar_from("choice", value))  # type: ignore[arg-type]
        if kind == "regex" and isinstance(value, str):
            return str(llguidance.grammar_from("regex", value))
        if kind == "grammar" and isinstance(value, str):  # Lark or GBNF
            return str(llguidance.grammar_from("grammar", value))
        if kind == "structural_tag":
            tag = json.loads(value) if isinstance(value, str) else value
            return _structural_tag_grammar(tag, "structured_outputs.structural_tag")
    except ConstraintError:
        raise
    except ValueError as error:
        raise ConstraintError(f"`structured_outputs.{kind}` cannot be read: {error}") from error
    raise ConstraintError(f"`structured_outputs.{kind}` must be a string")


def _forced_tools(tools: list[dict[str, Any]] | None, choice: Any) -> list[dict[str, Any]]:
    """The functions one of which the answer must call ([] when it need not call any)."""
    if choice in (None, "auto", "none"):
        return []
    named = _functions(tools)
    if choice == "required":
        if not named:
            raise ConstraintError("`tool_choice` is `required` but no tool is given")
        return named
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ConstraintError(
            '`tool_choice` must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )
    chosen = [f for f in named if f["name"] == name]
    if not chosen:
        raise ConstraintError(f"`tool_choice` names the function {name!r}, which is not in `tools`")
    return chosen


def _functions(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    functions = [tool.get("function") for tool in tools or [] if isinstance(tool, dict)]
    return [f for f in functions if isinstance(f, dict) and isinstance(f.get("name"), str)]


def _call_schema(functions: list[dict[str, Any]], *, strict_only: bool = False) -> str:
    """The JSON schema of one call's object: one of `functions` by name, with its arguments'
    schema (any object for a function not `strict`, when `strict_only`)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                "arguments": (
                    function.get("parameters") or {"type": "object"}
                    if function.get("strict") is True or not strict_only
                    else {"type": "object"}
                ),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for function in functions
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return json.dumps({"x-guidance": JSON_OPTIONS, **schema})


def _tool_call_grammar(functions: list[dict[str, Any]], *, parallel: bool) -> str:
    more = ' ("\\n" call)*' if parallel else ""
    lark = (
        f"start: call{more}\n"
        f'call: "<tool_call>\\n" %json {_call_schema(functions)} "\\n</tool_call>"\n'
    )
    from llguidance import LLMatcher

    return str(LLMatcher.grammar_from_lark(lark))


def _strict_calls_grammar(functions: list[dict[str, Any]]) -> str | None:
    """Free text in which each `<tool_call>` the model opens holds a call of an offered function
    (its arguments following its schema when it is `strict`); None when no tool is strict."""
    if not any(function.get("strict") is True for function in functions):
        return None
    lark = (
        "%llguidance {}\n"
        "start: call* TEXT\n"
        "call: opening WS? %json "
        + _call_schema(functions, strict_only=True)
        + ' WS? "</tool_call>"\n'
        'opening[lazy]: TEXT "<tool_call>"\n'
        "TEXT: /(.|\\n)*/\n"
        "WS: /[ \\t\\r\\n]+/\n"
    )
    from llguidance import LLMatcher

    return str(LLMatcher.grammar_from_lark(lark))


def _structural_tag_grammar(tag: Any, where: str) -> str:
    """Free text in which each trigger goes on as one of the structures it begins (see the
    module's doc)."""
    if not isinstance(tag, dict) or tag.get("type", "structural_tag") != "structural_tag":
        raise ConstraintError(f"`{where}` must be an object of type structural_tag")
    if "format" in tag:
        raise ConstraintError(
            f"`{where}`: xgrammar's `format` form of a structural tag is not supported here; "
            "give `structures` and `triggers`"
        )
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(triggers, list) or not triggers:
        raise ConstraintError(f"`{where}.triggers` must be a non-empty list of strings")
    if not all(isinstance(t, str) and t for t in triggers):
        raise ConstraintError(f"`{where}.triggers` must be a non-empty list of strings")
    if not isinstance(structures, list) or not structures:
        raise ConstraintError(f"`{where}.structures` must be a non-empty list")
    rules, tags, used = [], [], set()
    for index, structure in enumerate(structures):
        path = f"{where}.structures[{index}]"
        if not isinstance(structure, dict):
            raise ConstraintError(f"`{path}` must be an object with begin, schema and end")
        begin, end = structure.get("begin"), structure.get("end")
        schema = structure.get("schema")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise ConstraintError(f"`{path}` needs `begin` and `end` strings")
        if schema is None:
            schema = {}
        if not isinstance(schema, dict):
            raise ConstraintError(f"`{path}.schema` must be a JSON schema object")
        opening = max((t for t in triggers if begin.startswith(t)), key=len, default=None)
        if opening is None:
            raise ConstraintError(f"`{path}.begin` {begin!r} starts with none of the triggers")
        trigger = triggers.index(opening)
        used.add(trigger)
        rest = json.dumps(begin[len(opening) :]) if len(begin) > len(opening) else ""
        content = json.dumps({"x-guidance": JSON_OPTIONS, **schema})
        rules.append(f"tag_{index}: trigger_{trigger} {rest} %json {content} {json.dumps(end)}")
        tags.append(f"tag_{index}")
    lark = "\n".join(
        [
            "%llguidance {}",
            "start: tagged* TEXT",
            f"tagged: {' | '.join(tags)}",
            *rules,
            *(f"trigger_{k}[lazy]: TEXT {json.dumps(triggers[k])}" for k in sorted(used)),
            "TEXT: /(.|\\n)*/",
        ]
    )
    from llguidance import LLMatcher

    try:
        return str(LLMatcher.grammar_from_lark(lark))
    except ValueError as error:
        raise ConstraintError(f"`{where}` cannot be read: {error}") from error


def _json_grammar(schema: dict[str, Any], *, flexible: bool = True) -> str:
    from llguidance import LLMatcher

    options = {"whitespace_flexible": flexible}
    try:
        return str(LLMatcher.grammar_from_json_schema(schema, defaults=options))  # type: ignore[arg-type]
    except ValueError as error:
        raise ConstraintError(f"the JSON schema cannot be read: {error}") from error


class Grammars:
    """One engine's compiler of grammars against its tokenizer (built on first use, ~1 s).

    A compiled grammar is kept (the last `COMPILED` ones): a harness sends the same schema or
    tools at every call, and each response starts from a copy of the compiled matcher, which
    costs next to nothing where compiling a large schema takes milliseconds or more."""

    COMPILED = 64

    def __init__(self, tokenizer: Any, eos_token_ids: set[int]) -> None:
        self._hf_tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, eos_token=self._eos
                    )
                except ValueError as error:  # a slow (Python) tokenizer
                    raise ConstraintError(
                        f"structured output needs a fast tokenizer: {error}"
                    ) from error
            return self._tokenizer

    def check(self, grammar: str) -> None:
        """Compiles `grammar` (kept for `matcher`); raises ConstraintError, with llguidance's
        reason, when it does not compile. Slow for a large grammar: call it off the event loop."""
        self._prototype(grammar)

    def matcher(self, grammar: str) -> Matcher:
        """A matcher at the start of `grammar` (compiled now unless `check` compiled it)."""
        return Matcher(self._prototype(grammar).deep_copy())

    def _prototype(self, grammar: str) -> Any:
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        from llguidance import LLMatcher

        compiled = LLMatcher(self.tokenizer(), grammar, log_level=0)
        if compiled.is_error():
            raise ConstraintError(
                f"the structured output cannot be compiled: {compiled.get_error()}"
            )
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.COMPILED:
                self._compiled.popitem(last=False)
        return compiled


class Matcher:
    """Where one response stands in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def allowed(self, width: int) -> torch.Tensor:
        """Which of `width` token IDs (the logits' width) may come next, as booleans; IDs past
        the tokenizer's vocabulary (a padded embedding matrix) never may."""
        bits = np.unpackbits(
            np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
        )
        allowed = np.zeros(width, dtype=bool)
        allowed[: min(width, len(bits))] = bits[:width]
        self._check()
        return torch.from_numpy(allowed)

    def advance(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"structured output failed: {self._matcher.get_error()}")
