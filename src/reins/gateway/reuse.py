"""Token reuse: a chat call that extends an earlier call of its attempt is sent to the engine with
that call's prompt and sampled response token IDs, so that its prompt starts with them exactly.

Why: a harness sends its history back as text; rendered and tokenized again, a sampled response
can come back as other tokens (` b|ros|per` sampled, ` bro|s|per` re-encoded) and the rollout
splits into several training sequences (`retokenized`). With reuse the engine consumes
*earlier prompt + earlier response + the template's rendering of only what was added*, so the
calls merge (reins.samples.merge) and every recorded prompt is still exactly what the engine
consumed (DESIGN invariant 1: nothing is stitched).

What this module decides (pure but for its bounded memory; no I/O, no model-specific code):
- `ReuseMemory.prefix_for`: the call extends a remembered call of the same attempt when its
  messages start with that call's messages (compared by digest, message by message), the next
  message is an assistant turn (that call's answer, as the harness sends it back), at least one
  message follows, and the model, tools and tool choice are the same. Of several, the one with
  the most messages wins, then the one whose answer text is the one sent back. The answer is
  the token IDs to send as `reins_prefix_token_ids` (None: no reuse).
- The engine (`reins.engine.chat.extend_prompt`) makes the final check with its own template:
  the new messages' rendering must start with the text of those IDs. Where the harness changed
  its history (an edited or dropped turn, an answer re-serialized, a template that strips
  reasoning, compaction, other tools or system prompt), the check fails, the engine renders the
  prompt as usual and answers `x-reins-token-reuse: fallback`; the split then happens and
  `reins.samples.diagnose` names its reason. So a wrong match here costs nothing but the bytes.
- `ReuseMemory.remember`: after a successful call with one choice, its messages' digests and
  its prompt + response IDs join the attempt's few remembered calls (the call it extended stays,
  so that a retry of the call is prompted the same and deduplicated). A gateway restart forgets
  everything: the next call of each attempt is rendered as usual, and reuse resumes from it.

Memory is bounded: `per_attempt` calls for each of the `attempts` most recently used attempts,
and `max_tokens` token IDs in all (least recently used attempts go first).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import orjson
from numpy.typing import NDArray

from reins.samples.records import CheckedTokenIds, token_ids

PREFIX_FIELD = "reins_prefix_token_ids"
"""The chat request's extension field the engine reads (`reins.engine.api.ChatRequest`)."""
REUSE_HEADER = "x-reins-token-reuse"
"""The engine's answer header: `reused` or `fallback`. An engine that does not answer it does
not know the field: the proxy stops sending it there. A vLLM engine is not sent the field: the
proxy reuses through vLLM's own routes instead (`reuse_vllm.py`)."""

AttemptKey = tuple[str, int]


def digest(message: Any) -> bytes:
    """A message's fingerprint: its JSON with sorted keys, hashed."""
    try:
        text = orjson.dumps(message, option=orjson.OPT_SORT_KEYS, default=str)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits
        text = json.dumps(message, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.blake2b(text, digest_size=16).digest()


def request_view(chat: dict[str, Any]) -> tuple[list[bytes], bytes] | None:
    """(message digests, digest of the rest that shapes the prompt) of a chat request; None when
    it has no list of messages. The model is part of the rest: another model's token IDs mean
    nothing to it (a harness's judge or summarizer model in the same attempt)."""
    messages = chat.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    shape = digest([chat.get("model"), chat.get("tools"), chat.get("tool_choice")])
    return [digest(message) for message in messages], shape


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _content(message: Any) -> Any:
    return message.get("content") if isinstance(message, dict) else None


@dataclass
class _Remembered:
    messages: list[bytes]
    shape: bytes
    tokens: array[int]
    """The call's prompt + response token IDs."""
    answer: str | None = None
    """The answer's text as the harness was shown it (None: not known): of two calls with the
    same messages (two threads of a harness asking the same thing), the one whose answer the
    next call sends back is the one it extends."""


@dataclass(frozen=True)
class Ticket:
    """One call's reuse decision, kept until its record comes back (`ReuseMemory.remember`)."""

    key: AttemptKey
    messages: list[bytes]
    shape: bytes


class ReuseMemory:
    """Per attempt, the last few successful chat calls (see the module docstring)."""

    def __init__(
        self, *, attempts: int = 65_536, per_attempt: int = 6, max_tokens: int = 32_000_000
    ) -> None:
        # `attempts` is far above the rollouts that run at once: past it, the attempts that
        # take turns (each call's rollout waits for the others' calls) each forgot their last
        # call before their next one, and none was reused. `max_tokens` bounds the memory.
        self.attempts = attempts
        self.per_attempt = per_attempt
        self.max_tokens = max_tokens
        self._calls: OrderedDict[AttemptKey, list[_Remembered]] = OrderedDict()
        self._tokens = 0

    @property
    def tokens(self) -> int:
        """Token IDs held in all."""
        return self._tokens

    def prefix_for(
        self, key: AttemptKey, chat: dict[str, Any]
    ) -> tuple[NDArray[np.int32] | None, Ticket | None]:
        """The token IDs this chat request's prompt should start with (None: no reuse), and the
        ticket to pass to `remember` with the call's records (None: nothing to remember). An
        array, which the proxy writes into the engine's request as it is (orjson's numpy
        support): as a list, a 128k-token prefix cost ~1.7 ms to make and more to encode."""
        view = request_view(chat)
        if view is None:
            return None, None
        messages, shape = view
        chosen: int | None = None
        best = (-1, False)  # the longest history, then the answer sent back
        for index, call in enumerate(self._calls.get(key, ())):
            size = len(call.messages)
            if (
                call.shape == shape
                and len(messages) > size + 1
                and messages[:size] == call.messages
                and _role(chat["messages"][size]) == "assistant"
            ):
                sent_back = call.answer is not None and call.answer == _content(
                    chat["messages"][size]
                )
                if (size, sent_back) >= best:  # on a tie, the most recently used
                    chosen, best = index, (size, sent_back)
        if chosen is None:
            return None, Ticket(key, messages, shape)
        self._calls.move_to_end(key)
        calls = self._calls[key]
        calls.append(calls.pop(chosen))  # the most recently used last
        return np.frombuffer(calls[-1].tokens, dtype=np.int32).copy(), Ticket(key, messages, shape)

    def remember(
        self,
        ticket: Ticket,
        prompt: Sequence[int],
        response: Sequence[int],
        answer: str | None = None,
    ) -> None:
        """A successful call of `ticket` joins its attempt's remembered calls (the least recently
        used one out past `per_attempt`). The call it extended stays: a retry of this call
        extends it again, gets the same prompt, and is deduplicated (`reins.samples`). An
        earlier try of this same call is replaced, unless both answers are known and differ
        (two threads asking the same thing: each goes on with its own)."""
        if not prompt or not response:
            return
        entry = _Remembered(ticket.messages, ticket.shape, _int32s(prompt), answer)
        entry.tokens.extend(_int32s(response))
        calls = self._calls.setdefault(ticket.key, [])
        self._calls.move_to_end(ticket.key)
        replaced = [
            c
            for c in calls
            if (c.messages, c.shape) == (entry.messages, entry.shape)
            and (c.answer is None or answer is None or c.answer == answer)
        ]
        for call in replaced:
            calls.remove(call)
            self._tokens -= len(call.tokens)
        calls.append(entry)
        if len(calls) > self.per_attempt:
            self._tokens -= len(calls.pop(0).tokens)
        self._tokens += len(entry.tokens)
        while self._calls and (len(self._calls) > self.attempts or self._tokens > self.max_tokens):
            _, dropped = self._calls.popitem(last=False)
            self._tokens -= sum(len(call.tokens) for call in dropped)


def _int32s(ids: Sequence[int]) -> array[int]:
    """The IDs in an int32 array; from a recorded call's array when the proxy made one (a copy
    of its bytes, not a conversion of each of a long prompt's ints)."""
    checked = token_ids(ids) if type(ids) is CheckedTokenIds else None
    return array("i", checked.tobytes()) if checked is not None else array("i", ids)


Outcome = Literal["reused", "fallback", "none", "asked"]
"""What became of a call's reuse, recorded as its `token_reuse`: `reused` (the prompt starts with
the earlier call's tokens), `fallback` (the engine rendered it as usual: the history changed),
`none` (it extends no remembered call: the first call, a new conversation, a restart; or the
engine does not take the field, or a vLLM engine does not reuse this kind of call:
`reuse_vllm.py`). `asked` only while the engine has not answered."""


@dataclass
class _Pending:
    request: dict[str, Any]
    ticket: Ticket
    outcome: Outcome


class TokenReuse:
    """The proxy's side of token reuse: asks (`prepare`), hears the engine (`answered`), learns
    from the call's records (`recorded`). Calls are told apart by their request object, which
    every record of the call carries (`CallFacts.request`)."""

    def __init__(self, memory: ReuseMemory | None = None) -> None:
        self.memory = memory or ReuseMemory()
        self._pending: dict[int, _Pending] = {}
        """Calls in flight, by `id(request)` (the request is held, so the id stays its own),
        each until its records come (`recorded`) or the call ends without them (`ended`). Not
        bounded by a count: the gateway bounds no calls in flight, and a call dropped while in
        flight (past 1,024 of them, before) was recorded without `token_reuse`, though its
        prompt was reused, and its attempt's next call was not reused."""
        self.unsupported: set[str] = set()
        """Endpoints that answered without `REUSE_HEADER`: they do not know the field."""

    def prepare(
        self, key: AttemptKey, request: dict[str, Any], sent: dict[str, Any], endpoint: str
    ) -> None:
        """Adds `PREFIX_FIELD` to the engine's chat body `sent` when the call extends a
        remembered call of attempt `key`; `request` is the call's `CallFacts.request`."""
        prefix, ticket = self.memory.prefix_for(key, sent)
        if ticket is None:
            return
        outcome: Outcome = "none"
        # One choice: `n` 1, absent or null (the openai SDK sends `n=None` as null).
        one = sent.get("n") in (None, 1)
        if prefix is not None and endpoint not in self.unsupported and one:
            sent[PREFIX_FIELD] = prefix
            outcome = "asked"
        self._pending[id(request)] = _Pending(request, ticket, outcome)

    def ended(self, request: dict[str, Any]) -> None:
        """The call of `request` is over (its answer sent, or the harness gone): forgotten if its
        records never came, so that nothing stays of a call past its end."""
        pending = self._pending.get(id(request))
        if pending is not None and pending.request is request:
            del self._pending[id(request)]

    def answered(self, request: dict[str, Any], endpoint: str, header: str | None) -> None:
        """The engine's 2xx answer to the call arrived, with `REUSE_HEADER`'s value (`none`: the
        engine takes reuse but not for this call, `reuse_vllm.py`)."""
        pending = self._pending.get(id(request))
        if pending is None or pending.request is not request or pending.outcome != "asked":
            return
        heard: dict[str | None, Outcome] = {"reused": "reused", "fallback": "fallback"}
        pending.outcome = heard.get(header, "none")
        if header not in heard and header != "none":
            self.unsupported.add(endpoint)

    def recorded(self, records: Sequence[Any]) -> None:
        """The call's records (`ModelRequest`s), before they are stored: a successful call with
        one choice is remembered; each record gets `token_reuse` (the `Outcome`)."""
        if not records:
            return
        request = getattr(records[0], "request", None)
        pending = self._pending.get(id(request))
        if pending is None or pending.request is not request:
            return
        del self._pending[id(request)]
        # No 2xx answer came (the engine refused or failed the call, or the harness left before
        # it): nothing was reused into the record, which has no tokens. Said all the same: a
        # call of a gateway with reuse on always has `token_reuse`.
        outcome = "none" if pending.outcome == "asked" else pending.outcome
        for record in records:
            record.token_reuse = outcome
        if pending.outcome == "asked":
            return
        if len(records) == 1 and records[0].status == 200:
            record = records[0]
            self.memory.remember(
                pending.ticket,
                record.prompt_token_ids,
                record.response_token_ids,
                _shown_text(record.response),
            )


def _shown_text(answer: Any) -> str | None:
    """A chat answer's text as the harness got it (None for another API's answer, or none)."""
    try:
        text = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    return text if isinstance(text, str) else None
