"""What the proxy asks of the engine, shows the harness, and records: pure functions on JSON.

The engine is asked for the token IDs it consumed and sampled (vLLM's `return_token_ids`) and
for the sampled tokens' logprobs; the recorded `model_request` takes them from the engine's answer
as they are, never re-tokenized (DESIGN invariant 1). The harness gets back only what it asked
for: the extra fields are removed from what it sees.

Field paths read (vLLM >= 0.10 and the embedded engine):
- chat: top-level `prompt_token_ids`; `choices[i].token_ids`;
  `choices[i].logprobs.content[j].logprob`.
- completions: `choices[i].prompt_token_ids` (or top-level); `choices[i].token_ids`;
  `choices[i].logprobs.token_logprobs`.
- streaming: the same fields on each chunk, token IDs and logprobs of that chunk's delta only;
  `prompt_token_ids` on the first chunk that carries it.

A call that did not end in an answer (the engine's `error`, an answer with no choices, a stream
that broke off, carried an error chunk, or ended with a choice that has no finish reason: a
truncated answer) is recorded as one failed call (status 502, its error, no tokens), never as a
trainable answer: the harness was told it failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from reins.disconnect import CLIENT_CLOSED_REQUEST
from reins.gateway.wire import tool_call_index
from reins.samples.records import checked, token_ids
from reins.schemas import ModelRequest

Kind = Literal["chat", "completions"]


class SamplingPolicy(BaseModel):
    """Sampling settings a mode applies to every proxied call."""

    # A field it does not know is refused: `REINS_TRAIN_SAMPLING='{"temperature": 0.5}'` was
    # read as no setting at all, losing the default temperature 1.0 and top_p 1.0 unsaid.
    model_config = ConfigDict(extra="forbid")

    set: dict[str, JsonValue] = Field(default_factory=dict)
    """Request fields set on every call of this mode (e.g. `{"temperature": 1.0}`)."""
    keep_harness: list[str] = Field(default_factory=list)
    """Of those fields, the ones where a value the harness sent wins (`null` is no value)."""


_ALIASES: dict[str, tuple[str, ...]] = {
    "max_tokens": ("max_completion_tokens",),
    "max_completion_tokens": ("max_tokens",),
}
"""Request fields that are one setting under two names: chat's `max_completion_tokens` is its
newer `max_tokens`, and vLLM and the embedded engine take it first. A mode's policy that sets one
sets the setting, whichever name the harness used."""


def upstream_body(
    body: dict[str, Any], *, kind: Kind, model: str, policy: SamplingPolicy
) -> dict[str, Any]:
    """The request sent to the engine: the harness's, the mode's settings, token capture on."""
    out = dict(body)
    out["model"] = model
    for key, value in policy.set.items():
        names = (key, *_ALIASES.get(key, ()))
        # A harness's `null` is no value of its own (the openai SDK sends `temperature=None`
        # as null): the mode's value applies, not the engine's default.
        if key in policy.keep_harness and any(body.get(name) is not None for name in names):
            continue
        out[key] = value
        for alias in names[1:]:
            if alias not in policy.set:  # else the engine would take the harness's instead
                out.pop(alias, None)
    out["return_token_ids"] = True
    if kind == "chat":
        out["logprobs"] = True
    elif not isinstance(body.get("logprobs"), int) or isinstance(body.get("logprobs"), bool):
        out["logprobs"] = 0  # the sampled token's logprob, no alternatives
    return out


DISTRIBUTION_CHANGING = (
    *("top_k", "min_p"),  # truncate it
    *("presence_penalty", "frequency_penalty", "repetition_penalty"),  # reweight by history
    *("logit_bias", "bad_words", "allowed_token_ids"),  # reweight or mask tokens
    "min_tokens",  # masks the end of sequence until then
    "logits_processors",  # vLLM's: anything
)
"""Request fields (vLLM's names, in chat and completions requests) that make the engine sample
from another distribution than the policy's. Constrained decoding (`response_format`, tool
choice) masks it too, but is kept: the harness needs an answer it can parse."""


def without_distribution_changes(sent: dict[str, Any], policy: SamplingPolicy) -> list[str]:
    """Train mode samples the policy's own distribution, so the tokens it trains on are drawn
    from the probabilities it trains with: removes, in place, the distribution-changing fields
    the harness sent (those the mode's policy sets stay); the names of those that had a value,
    for the record's notes (a `null`, as the openai SDK sends `presence_penalty=None`, changed
    nothing)."""
    removed = [name for name in DISTRIBUTION_CHANGING if name in sent and name not in policy.set]
    changing = [name for name in removed if sent[name] is not None]
    for name in removed:
        del sent[name]
    return changing


OPENAI_RANGES = {
    "temperature": (0, 2),
    "top_p": (0, 1),
    "presence_penalty": (-2, 2),
    "frequency_penalty": (-2, 2),
}
"""What OpenAI's chat and text completions accept for these fields (else a 400)."""


def out_of_range(body: dict[str, Any]) -> str | None:
    """Why OpenAI would refuse the request's sampling fields or its `stream`, if it would:
    refused here in every mode, so a harness meets the same errors in training (where the train
    policy then replaces those fields) as when deployed."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        # An engine reads `"false"` as false and answers whole, where the proxy, taking any
        # other value for a stream, relayed nothing and blamed the engine (a 502).
        return f"stream: must be true or false, not {_sample(stream)}"
    for name, (least, most) in OPENAI_RANGES.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{name}: must be a number from {least} to {most}"
        if not least <= value <= most:
            return f"{name}: {value} is not from {least} to {most}"
    return None


def _asked_logprobs(body: dict[str, Any], kind: Kind) -> bool:
    value = body.get("logprobs")
    if kind == "chat":
        return bool(value)
    return isinstance(value, int) and not isinstance(value, bool)


def strip_for_harness(payload: dict[str, Any], body: dict[str, Any], kind: Kind) -> dict[str, Any]:
    """Removes, in place, the fields the proxy asked for and the harness did not."""
    if not body.get("return_token_ids"):
        payload.pop("prompt_token_ids", None)
    keep_logprobs = _asked_logprobs(body, kind)
    for choice in payload.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if not body.get("return_token_ids"):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not keep_logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    return payload


def _logprobs_of(choice: dict[str, Any], kind: Kind) -> list[float]:
    """The choice's logprobs; none when the engine's are not numbers (the record then says
    that their count does not match the tokens')."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return []
    try:
        if kind == "chat":
            return [float(item["logprob"]) for item in logprobs.get("content") or ()]
        return [float(value) for value in logprobs.get("token_logprobs") or () if value is not None]
    except (TypeError, ValueError, KeyError):
        return []


def _sample(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class CallFacts:
    """What the proxy knows of a call besides the engine's answer."""

    kind: Kind
    mode: str
    request: dict[str, Any]
    model: str
    endpoint: str
    model_version: int | None
    latency_s: float
    stream: bool
    api: str | None = None
    """The wire API the harness spoke when not this `kind` (`responses`, `messages`): the
    recorded event's `kind`; `request` and the recorded answer are in that API's shape."""
    notes: list[str] = field(default_factory=list)
    """What the translation from that API dropped or ignored, recorded with the call."""

    @property
    def recorded_kind(self) -> str:
        return self.api or self.kind


def answer_and_records(
    facts: CallFacts, payload: dict[str, Any]
) -> tuple[dict[str, Any], list[ModelRequest]]:
    """A successful non-streamed answer: what the harness sees, and one record per choice.

    The token IDs and logprobs are taken from the engine's answer before the fields the harness
    did not ask for are removed from it (in place: no copy of a long prompt's IDs).
    """
    top_prompt = payload.get("prompt_token_ids")
    taken = [
        (
            int(choice.get("index", 0)),
            choice.get("prompt_token_ids") or top_prompt or [],
            choice.get("token_ids") or [],
            _logprobs_of(choice, facts.kind),
            choice.get("finish_reason"),
            choice.get("stop_reason"),
        )
        for choice in payload.get("choices") or ()
        if isinstance(choice, dict)
    ]
    shown = strip_for_harness(payload, facts.request, facts.kind)
    choices = shown.get("choices") or []
    records = [
        _record(
            facts,
            prompt=prompt,
            response=response,
            logprobs=logprobs,
            shown={**shown, "choices": [choices[position]]},
            choice_index=index,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        for position, (index, prompt, response, logprobs, finish_reason, stop_reason) in enumerate(
            taken
        )
    ]
    return shown, records


def error_text(error: Any) -> str:
    """The message of an engine's `error` field (OpenAI's `{"message": ...}` or a string)."""
    message = error.get("message") if isinstance(error, dict) else error
    return str(message or error)


def answer_failure(payload: dict[str, Any], facts: CallFacts) -> str | None:
    """Why an engine's 200 answer is no answer (its `error`, no choices, or a choice it owed
    without a finish reason, the rule `StreamCapture.end` applies to a stream); None when it
    is one."""
    if payload.get("error") is not None:
        return f"the engine answered an error: {error_text(payload['error'])}"
    choices = payload.get("choices")
    if not isinstance(choices, list) or not any(isinstance(c, dict) for c in choices):
        return "the engine answered with no choices"
    finishes: dict[int, Any] = {}
    for position, choice in enumerate(choices):
        if isinstance(choice, dict):
            index = choice.get("index", position)
            finishes[index if isinstance(index, int) else position] = choice.get("finish_reason")
    unfinished = unfinished_choices(finishes, owed_choices(facts))
    if unfinished:
        return (
            "the engine's answer has no finish_reason for choice "
            f"{', '.join(map(str, unfinished))}: it may be truncated"
        )
    return None


def owed_choices(facts: CallFacts) -> int:
    """How many choices the engine owes a call: a chat or completions request's `n`, else 1
    (the other wire APIs ask for one)."""
    asked = facts.request.get("n") if facts.api is None else None
    return asked if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0 else 1


def unfinished_choices(finishes: dict[int, Any], owed: int) -> list[int]:
    """The choices (of the `owed` ones and any others seen) that did not end with a finish
    reason, as vLLM and the embedded engine end each one."""
    return [index for index in sorted(set(range(owed)) | set(finishes)) if not finishes.get(index)]


def error_record(facts: CallFacts, status: int, error: str) -> ModelRequest:
    """The record of a call the engine refused or could not be reached for."""
    return ModelRequest.model_construct(
        request=facts.request,
        response={},
        prompt_token_ids=[],
        response_token_ids=[],
        response_logprobs=None,
        finish_reason=None,
        model=facts.model,
        endpoint=facts.endpoint,
        model_version=facts.model_version,
        latency_s=facts.latency_s,
        status=status,
        error=error[:10_000],
        kind=facts.recorded_kind,
        mode=facts.mode,
        stream=facts.stream,
        **_notes(facts),
    )


def abandoned_records(facts: CallFacts, partial: list[ModelRequest]) -> list[ModelRequest]:
    """The records of a call whose harness hung up (or timed out) before its answer was
    complete: `abandoned`, status 499 (`CLIENT_CLOSED_REQUEST`), with what was streamed so far
    (`partial`, a `StreamRecorder`'s records; none for a non-streamed call), never trained on.
    The answer the harness went on with, if any, is a later call (its retry)."""
    message = (
        f"abandoned: the client hung up after {facts.latency_s:.2f} s, before the answer was "
        "complete; the engine's generation was cancelled and the call is not trained on"
    )
    status = {
        "status": CLIENT_CLOSED_REQUEST,
        "abandoned": True,
        "finish_reason": None,
        "error": message,
    }
    if not partial:
        return [error_record(facts, CLIENT_CLOSED_REQUEST, message).model_copy(update=status)]
    return [record.model_copy(update=status) for record in partial]


def _record(
    facts: CallFacts,
    *,
    prompt: list[int],
    response: list[int],
    logprobs: list[float],
    shown: dict[str, Any],
    choice_index: int,
    finish_reason: str | None,
    stop_reason: str | int | None = None,
) -> ModelRequest:
    problem = None
    prompt_array, response_array = token_ids(prompt), token_ids(response)
    if prompt_array is None or response_array is None:
        # Not recorded as sent (they would break token reuse and the store's packing); the
        # harness still gets its answer, as for an engine that returned no token IDs.
        problem = (
            "the engine returned token IDs that are not ints from 0 to 2**31 - 1 (prompt "
            f"{_sample(prompt)}, response {_sample(response)}); this call cannot be trained on"
        )
        prompt, response, logprobs = [], [], []
    elif prompt and not response and finish_reason == "stop":
        problem = "the response is empty (it ended at once, at a stop); nothing to train on"
    elif not prompt or not response:
        problem = (
            "the engine returned no token IDs (it must support `return_token_ids`, as vLLM and "
            "the embedded engine do); this call cannot be trained on"
        )
    elif logprobs and len(logprobs) != len(response):
        problem = f"the engine returned {len(logprobs)} logprobs for {len(response)} tokens"
    if prompt_array is not None and response_array is not None:
        # Checked once, here: the token reuse memory and the store's packing take the arrays.
        prompt, response = checked(prompt, prompt_array), checked(response, response_array)
    # The engine's own answer, built by us: constructed, not validated again (a long prompt's
    # IDs would cost a validation per token).
    return ModelRequest.model_construct(
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_logprobs=logprobs if logprobs and len(logprobs) == len(response) else None,
        request=facts.request,
        response=shown,
        model=facts.model,
        endpoint=facts.endpoint,
        model_version=facts.model_version,
        latency_s=facts.latency_s,
        status=200,
        finish_reason=finish_reason,
        error=problem,
        kind=facts.recorded_kind,
        mode=facts.mode,
        stream=facts.stream,
        choice_index=choice_index,
        **_notes(facts),
        # vLLM's `stop_reason`: the stop string or token ID that ended the response, which the
        # response's token IDs and text stop before (docs/proxy.md, fidelity).
        **_stop_reason(stop_reason),
    )


def _stop_reason(stop_reason: str | int | None) -> dict[str, Any]:
    return {"stop_reason": stop_reason} if stop_reason is not None else {}


def _notes(facts: CallFacts) -> dict[str, Any]:
    return {"notes": list(facts.notes)} if facts.notes else {}


_COMPLETION_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
"""A text completion's logprobs: parallel lists, one entry per token."""


@dataclass
class _ChoiceState:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    text: str = ""
    reasoning: str = ""
    reasoning_key: str = "reasoning_content"
    """The name the engine streams reasoning under: `reasoning_content`, or `reasoning` as newer
    vLLM names it; the assembled answer keeps the harness's name."""
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    sent_stop_reason: bool = False
    """The engine's chunks carried `stop_reason` (vLLM's and the embedded engine's do): the
    assembled answer has it too, as the non-streamed answer would."""
    last_call: int | None = None
    """The index of the tool call the last tool-call delta added to."""
    shown_logprobs: dict[str, Any] | None = None
    """The logprobs the harness was sent, when it asked for them: chat's `content` entries, or
    completions' parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""


class StreamRecorder:
    """Follows a streamed answer chunk by chunk; assembles the call for the record."""

    def __init__(self, facts: CallFacts) -> None:
        self.facts = facts
        self.prompt_token_ids: list[int] | None = None
        self.choices: dict[int, _ChoiceState] = {}
        self.head: dict[str, Any] = {}
        self.usage: Any = None
        self.error: str | None = None
        """Why the stream failed (an engine error chunk, a break-off), once it has."""
        self.shows_logprobs = facts.api is None and _asked_logprobs(facts.request, facts.kind)
        """The harness asked for logprobs: the assembled answer carries those it was sent."""

    def fail(self, error: str) -> None:
        """The stream failed: its call is recorded as failed (the first reason is kept)."""
        if self.error is None:
            self.error = error

    def end(self) -> None:
        """The engine's stream ended (closed, or `[DONE]`): it is no answer unless every choice
        it owed ended with a finish reason, as vLLM and the embedded engine end each one (all
        `n` of a chat or completions call). One that stopped short is a truncated answer, a
        failed call like a stream that broke off."""
        if not self.choices:
            self.fail("the engine's stream ended with no answer (no choices)")
            return
        finishes = {index: state.finish_reason for index, state in self.choices.items()}
        unfinished = unfinished_choices(finishes, owed_choices(self.facts))
        if unfinished:
            self.fail(
                "the engine's stream ended before its answer did (no finish_reason for choice "
                f"{', '.join(map(str, unfinished))}); the answer may be truncated"
            )

    def feed(self, chunk: dict[str, Any]) -> None:
        if chunk.get("error") is not None:
            self.fail(f"the engine's stream ended in an error: {error_text(chunk['error'])}")
            return
        if not self.head:
            self.head = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        if chunk.get("prompt_token_ids"):
            self.prompt_token_ids = list(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            state = self.choices.setdefault(int(choice.get("index", 0)), _ChoiceState())
            state.token_ids.extend(choice.get("token_ids") or ())
            state.logprobs.extend(_logprobs_of(choice, self.facts.kind))
            if self.shows_logprobs:
                self._keep_shown_logprobs(state, choice.get("logprobs"))
            if choice.get("prompt_token_ids"):
                state.prompt_token_ids = list(choice["prompt_token_ids"])
            if choice.get("finish_reason"):
                state.finish_reason = choice["finish_reason"]
            if "stop_reason" in choice:
                state.sent_stop_reason = True
            if choice.get("stop_reason") is not None:
                state.stop_reason = choice["stop_reason"]
            if self.facts.kind == "completions":
                state.text += _text(choice.get("text"))
                continue
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            state.text += _text(delta.get("content"))
            for key in ("reasoning_content", "reasoning"):
                if _text(delta.get(key)):
                    state.reasoning += _text(delta[key])
                    state.reasoning_key = key
                    break
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                if not isinstance(call, dict):
                    continue
                state.last_call = tool_call_index(call, state.last_call)
                slot = state.tool_calls.setdefault(
                    state.last_call,
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] = call.get("id") or slot["id"]
                function = call.get("function")
                function = function if isinstance(function, dict) else {}
                slot["function"]["name"] += _text(function.get("name"))
                slot["function"]["arguments"] += _text(function.get("arguments"))

    def _keep_shown_logprobs(self, state: _ChoiceState, logprobs: Any) -> None:
        """Adds a chunk's logprobs (as the harness is sent them) to its choice's."""
        if not isinstance(logprobs, dict):
            return
        if state.shown_logprobs is None:
            state.shown_logprobs = {}
        kept = state.shown_logprobs
        keys = ("content",) if self.facts.kind == "chat" else _COMPLETION_LOGPROBS
        for key in keys:  # the entries are not changed after (`strip_for_harness` keeps them)
            value, current = logprobs.get(key), kept.get(key)
            if isinstance(value, list):
                if not isinstance(current, list):
                    kept[key] = current = []
                current.extend(value)
            elif key not in kept:
                kept[key] = None if key == "top_logprobs" else []

    def assembled(self, index: int, state: _ChoiceState) -> dict[str, Any]:
        """The answer as the harness received it, as one non-streamed response would be."""
        if self.facts.kind == "completions":
            choice: dict[str, Any] = {
                "index": index,
                "text": state.text,
                "finish_reason": state.finish_reason,
            }
            kind = "text_completion"
        else:
            message: dict[str, Any] = {"role": "assistant", "content": state.text or None}
            if state.reasoning:
                message[state.reasoning_key] = state.reasoning
            if state.tool_calls:
                message["tool_calls"] = [state.tool_calls[i] for i in sorted(state.tool_calls)]
            choice = {"index": index, "message": message, "finish_reason": state.finish_reason}
            kind = "chat.completion"
        if state.sent_stop_reason:
            choice["stop_reason"] = state.stop_reason
        if self.shows_logprobs:
            choice["logprobs"] = state.shown_logprobs
        return {**self.head, "object": kind, "choices": [choice], "usage": self.usage}

    def records(self) -> list[ModelRequest]:
        """One record per choice; one failed call's (502) when the stream is no answer."""
        if self.error is not None:
            return [error_record(self.facts, 502, self.error)]
        return [
            _record(
                self.facts,
                prompt=state.prompt_token_ids or self.prompt_token_ids or [],
                response=state.token_ids,
                logprobs=state.logprobs,
                shown=self.assembled(index, state),
                choice_index=index,
                finish_reason=state.finish_reason,
                stop_reason=state.stop_reason,
            )
            for index, state in sorted(self.choices.items())
        ]


def _text(value: Any) -> str:
    """A streamed piece of text; an engine's non-string piece counts as none."""
    return value if isinstance(value, str) else ""
