"""One rollout's page, as data: its calls in order, their logprobs, and the merge or split decision
at each boundary, taken from `reins.samples` exactly as the trainer takes it.

Pure: events in, a view out. The dashboard renders it; tests read it.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from reins.monitor import transcript
from reins.samples import Decode, dedup_calls, merge_calls, rollout_from_events
from reins.schemas import AGENT_LOG, MODEL_REQUEST, REWARD, TOOL, Event, ModelRequest

MAX_TOKENS_SHOWN = 2000
"""Response tokens drawn with their logprobs; the rest are counted, not drawn."""
MAX_TEXT = 20_000
"""Characters of one message or response shown; the raw event has all of it."""
MAX_LOG_TAIL = 50_000
"""Characters of an agent log's tail shown, its last ones (a harness's tail of megabytes made
the page megabytes); the raw event has all of it."""
LOW_P = 0.1
"""A token sampled with a probability below this is marked low."""

TokenTexts = Callable[[Sequence[int]], list[str]]
"""Token IDs to the text of each token (a tokenizer); used when the response carries none."""

BoundaryKind = Literal["first", "merge", "split", "retry", "skipped", "unknown"]


def probability(logprob: float) -> float:
    """The probability of a logprob, at most 1. The gateway stores logprobs as recorded: one
    above 0 (an engine's rounding, an event posted by hand) is no probability, and `math.exp`
    of one above ~709 overflows."""
    return math.exp(min(logprob, 0.0))


def mean_logprob(logprobs: Sequence[float]) -> float:
    """Their mean, finite for finite logprobs: each is divided before the sum (two of
    -1.7e308 summed to -inf, which `reins export` then wrote as `-Infinity`, no JSON)."""
    count = len(logprobs)
    return sum(value / count for value in logprobs)


@dataclass(frozen=True)
class Token:
    text: str
    token_id: int
    logprob: float | None
    is_id: bool = False
    """No text is known for the token: `text` is its ID."""

    @property
    def p(self) -> float | None:
        return None if self.logprob is None else probability(self.logprob)


@dataclass(frozen=True)
class Message:
    role: str
    text: str
    truncated: int = 0
    """Characters not shown."""


@dataclass(frozen=True)
class Boundary:
    """What the Sample Adapter did with this call, relative to the call before it."""

    kind: BoundaryKind
    text: str
    """One sentence for a person: `merged into sequence 1`, `split (branch): ...`."""
    reason: str | None = None
    """The split reason (`retokenized`, `template`, `transformed`, `branch`, `unknown`)."""
    sequence: int | None = None
    """1-based training sequence the call belongs to; None when it is not trained on."""


@dataclass
class CallView:
    index: int
    """1-based position among the attempt's calls (`call_numbers`)."""
    seq: int
    record: ModelRequest
    prompt_tokens: int
    response_tokens: int
    messages: list[Message]
    """The prompt: only what is new since the previous call, for chat calls that continue it."""
    earlier_messages: int
    """Leading messages of the prompt not shown (the same as in the previous call)."""
    previous_index: int | None
    """The `index` of the call shown before this one (whose messages those are)."""
    response: list[Message]
    tokens: list[Token]
    hidden_tokens: int
    """Response tokens not drawn (past `MAX_TOKENS_SHOWN`)."""
    boundary: Boundary
    min_logprob: float | None = None
    mean_logprob: float | None = None
    low_tokens: int = 0
    """Tokens sampled with p < LOW_P."""


@dataclass(frozen=True)
class ToolUse:
    """A `tool` event (`reins.agent.report_tool`): what the harness ran and what came back."""

    name: str
    input: Message
    output: Message
    ok: bool
    seconds: float | None


@dataclass
class Item:
    """One entry of the attempt's timeline, in event order."""

    seq: int
    type: str
    call: CallView | None = None
    data: dict[str, Any] = field(default_factory=dict)
    pretty: str = ""
    """Pretty JSON of a custom event's data (truncated)."""
    tool: ToolUse | None = None


@dataclass
class AttemptView:
    attempt_id: int
    items: list[Item]
    calls: list[CallView]
    rewards: list[dict[str, Any]]
    logs: list[dict[str, Any]]
    """`agent_log` events: {outcome, exit_code, path, tail}."""
    sequences: int | None
    """Training sequences the calls make; None when samples could not be built."""
    split_counts: dict[str, int]
    samples_error: str | None = None
    prompt_tokens: int = 0
    response_tokens: int = 0


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif isinstance(part, dict):
                pieces.append(f"[{part.get('type', 'part')}]")
            else:
                pieces.append(str(part))
        return "".join(pieces)
    return json.dumps(content, ensure_ascii=False)


def _message(role: str, text: str) -> Message:
    if len(text) > MAX_TEXT:
        return Message(role, text[:MAX_TEXT], len(text) - MAX_TEXT)
    return Message(role, text)


def _chat_message(raw: Any) -> Message:
    if not isinstance(raw, dict):
        return _message("?", _text(raw))
    text = _text(raw.get("content"))
    reasoning = raw.get("reasoning_content") or raw.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        text = f"[reasoning]\n{reasoning}\n[/reasoning]\n{text}"
    if isinstance(raw.get("tool_calls"), list):
        calls = [_tool_call_text(call) for call in raw["tool_calls"]]
        text = "\n".join([text, *calls] if text else calls)
    role = str(raw.get("role", "?"))
    if raw.get("name"):
        role += f" ({raw['name']})"
    if raw.get("tool_call_id"):
        role += f" [{raw['tool_call_id']}]"
    return _message(role, text)


def _tool_call_text(call: Any) -> str:
    """`→ run_shell [call_1]` and its arguments as indented JSON (parsed when they parse)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return "→ tool call: " + json.dumps(call, ensure_ascii=False)
    function = call["function"]
    arguments: Any = function.get("arguments")
    if isinstance(arguments, str):
        # Else shown as the model wrote it: not JSON, or nested past the reader's stack (a
        # harness's own arguments of ~1,000 brackets made the rollout's page a 500).
        with contextlib.suppress(ValueError, RecursionError):
            arguments = json.loads(arguments)
    shown = (
        arguments
        if isinstance(arguments, str)
        else json.dumps(arguments, ensure_ascii=False, indent=1)
    )
    tag = f" [{call['id']}]" if call.get("id") else ""
    return f"→ {function.get('name', '?')}{tag}\n{shown}"


def _tool_use(data: dict[str, Any]) -> ToolUse:
    raw_input = data.get("input")
    shown = (
        raw_input
        if isinstance(raw_input, str)
        else json.dumps(raw_input, ensure_ascii=False, indent=1)
    )
    seconds = data.get("seconds")
    return ToolUse(
        name=str(data.get("name", "?")),
        input=_message("input", shown),
        output=_message("output", _text(data.get("output"))),
        ok=data.get("ok") is not False,
        seconds=float(seconds) if isinstance(seconds, int | float) else None,
    )


def _response(record: ModelRequest) -> list[Message]:
    if record.status != 200:
        return [_message(f"error ({record.status})", record.error or f"status {record.status}")]
    shown = _answer(record)
    if record.error:
        # A 200 whose capture failed (no token IDs, say): the harness got this answer, which
        # is not trained on; both are shown.
        shown = [*shown, _message("capture problem", record.error)] if record.response else []
        return shown or [_message("error (200)", record.error)]
    return shown


def _answer(record: ModelRequest) -> list[Message]:
    messages = transcript.answer_messages(record)
    if messages is not None:
        return [_chat_message(m) for m in messages]
    choice = transcript.choice(record)
    if "text" in choice:
        return [_message("completion", _text(choice.get("text")))]
    return [_message("response", json.dumps(record.response, ensure_ascii=False)[:MAX_TEXT])]


def _response_token_texts(record: ModelRequest) -> list[str] | None:
    """Token texts the engine gave the harness (when it asked for logprobs), if they line up."""
    texts = transcript.response_token_texts(record)
    if texts is None or len(texts) != len(record.response_token_ids):
        return None
    if not all(isinstance(t, str) for t in texts):
        return None
    return [str(t) for t in texts]


def _tokens(record: ModelRequest, token_texts: TokenTexts | None) -> list[Token]:
    ids = record.response_token_ids[:MAX_TOKENS_SHOWN]
    texts = _response_token_texts(record)
    if texts is None and token_texts is not None and ids:
        try:
            texts = token_texts(ids)
        except Exception:  # a tokenizer that fails on some id must not break the page
            texts = None
    is_id = not texts
    texts = texts[: len(ids)] if texts else [str(i) for i in ids]
    logprobs = record.response_logprobs
    if logprobs is not None and len(logprobs) != len(record.response_token_ids):
        logprobs = None
    return [
        Token(text, token_id, None if logprobs is None else float(logprobs[i]), is_id)
        for i, (text, token_id) in enumerate(zip(texts, ids, strict=False))
    ]


def _prompt(record: ModelRequest, previous: ModelRequest | None) -> tuple[list[Message], int]:
    """The prompt's messages that are new since `previous` (and how many were left out)."""
    messages = transcript.prompt_messages(record)
    if messages is not None:
        shared = 0
        before = None if previous is None else transcript.prompt_messages(previous)
        if previous is not None and before is not None:
            while shared < min(len(before), len(messages)) and before[shared] == messages[shared]:
                shared += 1
            if shared == len(before) and shared < len(messages):
                # The previous response, sent back as the next turn, is not news either.
                answer = (transcript.answer_messages(previous) or [None])[0]
                turn = messages[shared]
                if (
                    isinstance(answer, dict)
                    and isinstance(turn, dict)
                    and turn.get("role") == "assistant"
                    and _text(turn.get("content")) == _text(answer.get("content"))
                ):
                    shared += 1
            if shared < len(before):
                shared = 0  # the history changed: show all of it
        return [_chat_message(m) for m in messages[shared:]], shared
    prompt = record.request.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return [_message("prompt", f"[{len(prompt)} token IDs]")], 0
    text = _text(prompt)
    if len(text) > MAX_TEXT:
        return [Message("prompt (tail)", text[-MAX_TEXT:], len(text) - MAX_TEXT)], 0
    return [_message("prompt", text)], 0


def call_numbers(events: Sequence[Event], attempt_id: int) -> dict[int, int]:
    """The number each `model_request` event of the attempt is shown as (`call 3`), by its seq:
    its 1-based position among the attempt's calls, failed and unreadable ones included, as
    the rollout page and `reins export` list them."""
    seqs = sorted(e.seq for e in events if e.attempt_id == attempt_id and e.type == MODEL_REQUEST)
    return {seq: number for number, seq in enumerate(seqs, start=1)}


def decisions(
    rollout_id: str, events: list[Event], attempt_id: int, decode: Decode | None
) -> tuple[dict[int, Boundary], int | None, dict[str, int], str | None]:
    """What the Sample Adapter does with each call of one attempt, keyed by event seq (failed and
    token-less calls are absent), the sequence count, the split counts by reason, and an error
    when samples cannot be built (then only the error). Calls are named by `call_numbers`."""
    try:
        record = rollout_from_events(
            events, rollout_id=rollout_id, attempt_id=attempt_id, missing_reward=0.0
        )
    except ValueError as error:
        return {}, None, {}, str(error)
    kept = dedup_calls(record.calls)
    sequences, splits = merge_calls(kept, rollout_id=rollout_id, decode=decode)
    sequence_of = {seq: i + 1 for i, s in enumerate(sequences) for seq in s.call_seqs}
    split_at = {split.after_seq: split for split in splits}
    # Numbered among all the attempt's calls, not only those trained on: counted among these,
    # a failed call before it made "call 11" name the page's call 12.
    index_of = call_numbers(events, attempt_id)
    out: dict[int, Boundary] = {}
    kept_seqs = {call.seq for call in kept}
    for call in record.calls:
        if call.seq in kept_seqs:
            continue
        retry = next(
            (c for c in kept if c.seq > call.seq and np.array_equal(c.prompt, call.prompt)),
            None,
        )
        later = f"call {index_of[retry.seq]}" if retry is not None else "a later call"
        out[call.seq] = Boundary(
            "retry", f"dropped as a retry: {later} has the same prompt and is kept"
        )
    counts: dict[str, int] = {}
    for position, call in enumerate(kept):
        number = sequence_of[call.seq]
        if position == 0:
            out[call.seq] = Boundary("first", f"opens sequence {number}", sequence=number)
        elif call.seq in split_at:
            split = split_at[call.seq]
            counts[split.reason] = counts.get(split.reason, 0) + 1
            before = index_of[split.before_seq]
            out[call.seq] = Boundary(
                "split",
                f"split ({split.reason}): the prompt shares {split.shared_tokens} leading tokens "
                f"with call {before}'s prompt + response; opens sequence {number}",
                reason=split.reason,
                sequence=number,
            )
        else:
            out[call.seq] = Boundary(
                "merge",
                f"merged into sequence {number}: the prompt extends the previous call's "
                "prompt + response token for token",
                sequence=number,
            )
    return out, len(sequences), counts, None


def _stats(tokens: list[Token], record: ModelRequest) -> tuple[float | None, float | None, int]:
    logprobs = record.response_logprobs
    if not logprobs or len(logprobs) != len(record.response_token_ids):
        return None, None, 0
    low = sum(1 for lp in logprobs if probability(lp) < LOW_P)
    return min(logprobs), mean_logprob(logprobs), low


def _log(data: Any, seq: int) -> dict[str, Any]:
    """An `agent_log` event's data with its tail cut to `MAX_LOG_TAIL` characters (`tail_cut`:
    how many earlier ones are not shown)."""
    fields = data if isinstance(data, dict) else {}
    tail = _text(fields.get("tail"))
    cut = max(0, len(tail) - MAX_LOG_TAIL)
    return {**fields, "seq": seq, "tail": tail[cut:], "tail_cut": cut}


def _pretty(data: dict[str, Any], limit: int = 5000) -> str:
    text = json.dumps(data, ensure_ascii=False, indent=1, default=str)
    return text if len(text) <= limit else text[:limit] + f"\n... ({len(text) - limit} more)"


def _record(data: Any) -> tuple[ModelRequest, int]:
    """A call's record and its prompt's length. A prompt restored as an array (`token_arrays`,
    `reins.packed.unpack`) is not validated as a list of ints, nor kept: the page shows its
    length only, and `reins.samples` reads it from the event."""
    prompt = data.get("prompt_token_ids") if isinstance(data, dict) else None
    if isinstance(prompt, np.ndarray):
        return ModelRequest.model_validate({**data, "prompt_token_ids": []}), int(prompt.size)
    record = ModelRequest.model_validate(data)
    return record, len(record.prompt_token_ids)


def _with_lists(data: Any) -> Any:
    """`data` as JSON can show it (a prompt restored as an array as its list)."""
    if isinstance(data, dict) and isinstance(data.get("prompt_token_ids"), np.ndarray):
        return {**data, "prompt_token_ids": data["prompt_token_ids"].tolist()}
    return data


def attempt_view(
    rollout_id: str,
    attempt_id: int,
    events: Sequence[Event],
    *,
    decode: Decode | None = None,
    token_texts: TokenTexts | None = None,
) -> AttemptView:
    """The view of one attempt from its events (events of other attempts are ignored)."""
    mine = sorted((e for e in events if e.attempt_id == attempt_id), key=lambda e: e.seq)
    boundaries, sequences, counts, error = decisions(rollout_id, mine, attempt_id, decode)
    numbers = call_numbers(mine, attempt_id)
    items: list[Item] = []
    calls: list[CallView] = []
    rewards: list[dict[str, Any]] = []
    logs: list[dict[str, Any]] = []
    previous: ModelRequest | None = None
    previous_index: int | None = None
    for event in mine:
        if event.type == MODEL_REQUEST:
            try:
                record, prompt_tokens = _record(event.data)
            except ValueError as invalid:
                data = _with_lists(event.data)
                why = f"call {numbers[event.seq]} is no valid call record: {invalid}"
                items.append(Item(event.seq, "invalid", data=data, pretty=why))
                continue
            boundary = boundaries.get(event.seq)
            if boundary is None:
                why = (
                    f"failed call (status {record.status})"
                    if record.status != 200
                    else "no token IDs recorded"
                    if not (prompt_tokens and record.response_token_ids)
                    else "samples could not be built"
                )
                boundary = Boundary("skipped", f"not trained on: {why}")
            messages, earlier = _prompt(record, previous)
            tokens = _tokens(record, token_texts)
            low_min, mean, low = _stats(tokens, record)
            call = CallView(
                index=numbers[event.seq],
                seq=event.seq,
                record=record,
                prompt_tokens=prompt_tokens,
                response_tokens=len(record.response_token_ids),
                messages=messages,
                earlier_messages=earlier,
                previous_index=previous_index,
                response=_response(record),
                tokens=tokens,
                hidden_tokens=max(0, len(record.response_token_ids) - len(tokens)),
                boundary=boundary,
                min_logprob=low_min,
                mean_logprob=mean,
                low_tokens=low,
            )
            calls.append(call)
            items.append(Item(event.seq, event.type, call=call))
            previous, previous_index = record, numbers[event.seq]
        elif event.type == REWARD:
            rewards.append({**event.data, "seq": event.seq})
            items.append(Item(event.seq, event.type, data=event.data))
        elif event.type == TOOL and isinstance(event.data, dict):
            items.append(Item(event.seq, event.type, data=event.data, tool=_tool_use(event.data)))
        elif event.type == AGENT_LOG:
            log = _log(event.data, event.seq)
            logs.append(log)
            items.append(Item(event.seq, event.type, data=log))
        else:
            items.append(Item(event.seq, event.type, data=event.data, pretty=_pretty(event.data)))
    return AttemptView(
        attempt_id=attempt_id,
        items=items,
        calls=calls,
        rewards=rewards,
        logs=logs,
        sequences=sequences,
        split_counts=counts,
        samples_error=error,
        prompt_tokens=sum(c.prompt_tokens for c in calls),
        response_tokens=sum(c.response_tokens for c in calls),
    )
