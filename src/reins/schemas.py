"""Wire types shared by the gateway, the controller, the trainer and the harness helpers.

Shapes follow Agent Lightning v1.0 where it has one (paper appendix A.1), so its users can switch:
a rollout's state lives at ``rollout["status"]["state"]``; ``GET /api/rollouts/{id}`` returns
``{"rollout": ..., "attempts": [...]}``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationError,
)
from pydantic_core import PydanticCustomError

NUL_TEXT_MESSAGE = (
    "the text holds a NUL character (\\u0000), which the store's text fields cannot keep; "
    "send text without it"
)
"""Why a field the store keeps as text (not JSON) refuses a NUL: PostgreSQL's text cannot hold
one, and SQLite refuses it too so that both stores keep the same values."""


def _no_nul(text: str) -> str:
    if "\x00" in text:
        raise PydanticCustomError("nul_character", NUL_TEXT_MESSAGE)
    return text


NulFreeText = Annotated[str, AfterValidator(_no_nul)]
"""A text field of a request that the store keeps as text: refused with a NUL at the door, where
the error names the field in the body (`body.1.idempotency_key`), not only in the store."""

RolloutState = Literal["queuing", "running", "succeeded", "failed"]
AttemptState = Literal["running", "succeeded", "failed"]
Mode = Literal["train", "val"]

TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed"})

# The rollout state machine (paper figure 11). The PATCH route checks this table and nothing else;
# setting a rollout to the state it is already in is an idempotent no-op, not a transition.
VALID_TRANSITIONS: dict[str, frozenset[str]] = {
    "queuing": frozenset({"running", "failed"}),
    "running": frozenset({"succeeded", "failed"}),
    "succeeded": frozenset(),
    "failed": frozenset(),
}

MODEL_REQUEST = "model_request"
REWARD = "reward"
TOOL = "tool"
"""A harness's tool use, posted by `reins.agent.report_tool`: {name, input, output, ok, seconds}."""
AGENT_LAUNCH = "agent_launch"
"""Posted by the controller when it launched an attempt's agent: which runner, where."""
AGENT_LOG = "agent_log"
"""Posted by the controller when an attempt's agent ended: outcome, exit code, log tail."""

RESERVED_EVENT_TYPES: frozenset[str] = frozenset({MODEL_REQUEST, AGENT_LAUNCH, AGENT_LOG})
"""Event types the gateway (a proxied call) and the controller write. The admin key may post
them; an attempt's scoped token may not (403): a harness could otherwise make up calls the
trainer trains on (token IDs the engine never sampled), or take the controller's fixed
idempotency keys first."""

Identifier = Annotated[
    str,
    StringConstraints(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:\-]*$"),
]
"""Rollout, group and model ids: URL-safe so they can sit in a proxy path unescaped."""

EventType = Annotated[
    str, StringConstraints(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.:\-]+$")
]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutConfig(BaseModel):
    """How a rollout is executed. Unknown keys are kept for custom runners."""

    model_config = ConfigDict(extra="allow")

    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Wall-clock limit of one attempt; the controller kills the agent past it."""
    max_attempts: int | None = Field(default=None, ge=1, le=100)
    """Attempts before the rollout fails; overrides the controller's default."""
    agent: str | None = None
    """`module:function` or a command line; overrides the controller's default agent."""


class RolloutSpec(_Wire):
    """One rollout to declare. A client-chosen ``rollout_id`` makes a retried declare harmless."""

    rollout_id: Identifier | None = None
    """Client-chosen id; generated when absent (then a retried declare creates a second one)."""
    input: JsonValue = None
    """The task, as the agent will receive it."""
    group_id: Identifier | None = None
    """Rollouts sampled from the same example share it (the GRPO group)."""
    mode: Mode = "train"
    """`train` or `val`: selects the proxy's sampling settings."""
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    """Free-form labels (dataset, step, ...)."""
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    """Execution settings (timeout, attempts, agent)."""


class RolloutStatus(_Wire):
    state: RolloutState
    reason: str | None = Field(default=None, max_length=10_000)
    """Why the rollout is in this state (a failure's cause, say)."""


class Rollout(_Wire):
    rollout_id: str
    input: JsonValue
    group_id: str | None
    mode: Mode
    metadata: dict[str, JsonValue]
    config: RolloutConfig
    status: RolloutStatus
    attempt_count: int
    """Attempts opened so far; the latest one is ``attempt_count``."""
    change_seq: int
    """Gateway-wide sequence number of this rollout's last change: the list cursor."""
    created_at: datetime
    updated_at: datetime


class RolloutUpdate(_Wire):
    """``PATCH /api/rollouts/{id}``: a status change, a metadata merge, or both."""

    status: RolloutStatus | None = None
    metadata: dict[str, JsonValue] | None = None
    """Keys to set in the rollout's metadata (merged, not replaced)."""


class Attempt(_Wire):
    rollout_id: str
    attempt_id: int
    """1-based; a retry after a crash or timeout opens ``attempt_id + 1``."""
    state: AttemptState
    reason: str | None = None
    created_at: datetime
    ended_at: datetime | None = None
    token: str | None = None
    """Scoped token for this attempt (proxy calls and event posts only); returned to admins."""


class AttemptCreate(_Wire):
    """``POST /api/rollouts/{id}/attempts``: open the next attempt.

    Naming ``attempt_id`` makes the call idempotent: if that attempt exists it is returned as is.
    """

    attempt_id: int | None = Field(default=None, ge=1)
    reason: NulFreeText | None = Field(default=None, max_length=10_000)
    """Why the previous attempt ended (crash, timeout), recorded on it."""


class RolloutDetail(_Wire):
    rollout: Rollout
    attempts: list[Attempt]


class RolloutStats(_Wire):
    """A rollout's latest attempt in figures, computed in the database (the dashboard's table,
    ``POST /api/rollouts/stats``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    calls: int = 0
    """`model_request` events."""
    failed_calls: int = 0
    """Of those, calls whose status is not 200."""
    prompt_tokens: int = 0
    response_tokens: int = 0
    min_version: int | None = None
    max_version: int | None = None
    """Weight versions that served the calls the trainer trains (status 200, not abandoned, with
    prompt and response tokens); None when there is none."""
    reward: float | None = None
    """Value of the last `reward` event; None when there is none."""
    started_at: float | None = None
    """Unix time the first attempt opened."""
    ended_at: float | None = None
    """Unix time the latest attempt ended; None while it runs."""
    events: int = 0
    """Events of every attempt."""
    last_seq: int = 0
    """The highest event seq of any attempt (0: none): it changes whenever an event is added."""


class RolloutPage(_Wire):
    items: list[Rollout]
    next_cursor: int
    """Pass back as ``cursor`` to get the rollouts that changed after this page. Below the
    ``cursor`` given only when the database's changes end before it (the gateway came back on
    an older copy of its database): what the cursor's follower knows may no longer hold; read
    again from cursor 0."""
    database_id: str | None = None
    """The gateway's database, a random id made with it. A cursor counts that database's
    changes only: a follower that sees another id (the gateway restarted on a fresh SQLite file
    or another PostgreSQL database) reads again from cursor 0. None from an older gateway."""


class EventIn(_Wire):
    type: EventType
    # `Any`, not `JsonValue`: the body is parsed JSON already, and JsonValue's validator costs a
    # Python call per value (a model_request carries thousands of token IDs).
    data: dict[str, Any] = Field(default_factory=dict)
    idempotency_key: NulFreeText | None = Field(default=None, min_length=1, max_length=200)
    """A retried post with the same key is stored once."""


class Event(_Wire):
    seq: int
    """Server sequence number: events of a rollout read back in this order."""
    rollout_id: str
    attempt_id: int
    type: str
    data: dict[str, Any]
    idempotency_key: str
    created_at: datetime


class PackedEvent(_Wire):
    """An event as the store keeps it (`GET /api/rollouts/{id}/events/packed`). A packed
    `model_request` has its token IDs, logprobs, request and response in `packed` (base64 of a
    `reins.packed` blob, stored against an earlier call of its attempt) and its other fields in
    `data`; `reins.packed.unpack_events` restores the events. Other events are whole, `packed`
    null. Not a subclass of `Event`: its `data` is not the event's, so it must not pass for one
    (`rollout_from_events` would read a packed call as a call without tokens)."""

    seq: int
    rollout_id: str
    attempt_id: int
    type: str
    data: dict[str, Any]
    idempotency_key: str
    created_at: datetime
    packed: str | None = None


class EventAck(_Wire):
    """The answer to an event post: the stored event without its data."""

    seq: int
    rollout_id: str
    attempt_id: int
    type: str
    idempotency_key: str
    created_at: datetime


class ModelRequest(BaseModel):
    """Data of a ``model_request`` event: one LLM call as the engine saw it.

    Token IDs are exactly what the engine consumed and sampled, never re-tokenized.
    """

    model_config = ConfigDict(extra="allow")

    prompt_token_ids: list[int] = Field(default_factory=list)
    response_token_ids: list[int] = Field(default_factory=list)
    response_logprobs: list[float] | None = None
    request: dict[str, Any] = Field(default_factory=dict)
    """The request body as the harness sent it."""
    response: dict[str, Any] = Field(default_factory=dict)
    """The response body as the harness received it."""
    model: str | None = None
    endpoint: str | None = None
    model_version: int | None = None
    """Weight version of the engine that served this call."""
    latency_s: float | None = None
    status: int = 200
    """HTTP status the engine answered with."""
    finish_reason: str | None = None
    error: str | None = None
    abandoned: bool = False
    """The harness hung up (or timed out) before the answer was complete: recorded with status
    499 and whatever was streamed so far, its generation cancelled; never trained on."""


REWARD_LIMIT = 1e12
"""The largest reward magnitude: the spread of a group of rewards near 1e308 overflows, and
GRPO would give the whole group advantage 0 without a word."""


class Reward(BaseModel):
    """Data of a ``reward`` event: the gateway refuses (422) a reward event whose data does not
    fit, and the trainer reads one that does not (stored before this check) as missing."""

    model_config = ConfigDict(extra="allow")

    value: float = Field(strict=True, allow_inf_nan=False, ge=-REWARD_LIMIT, le=REWARD_LIMIT)
    """A finite number within +-1e12 (an integer is taken as a float; a string, a bool or null
    is refused)."""
    source: str | None = None
    reason: str | None = None


def parse_reward(data: Any) -> Reward | str:
    """A ``reward`` event's data as a `Reward`, or what is wrong with it (its first field)."""
    try:
        return Reward.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "data"
        return f"{field}: {first['msg']}"


def _reachable_url(url: str) -> str:
    """An endpoint a request can be sent to: a host, and a port in range when one is given
    (`http://[::1/v1` or port 99999 passed the pattern, and every call to the model failed)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  # a ValueError past 65535 or for a port that is no number
    except ValueError as error:
        raise ValueError(f"{url!r} is not a URL a request can be sent to: {error}") from None
    if not parts.hostname:
        raise ValueError(f"{url!r} names no host")
    return url


class ModelEndpointIn(_Wire):
    """``POST /api/models`` body (or a list of them), as in Agent Lightning v1.0."""

    model: Identifier
    endpoint: Annotated[
        str,
        StringConstraints(pattern=r"^https?://\S+$", max_length=2000),
        AfterValidator(_no_nul),
        AfterValidator(_reachable_url),
    ]
    """Base URL of an OpenAI-compatible server, e.g. ``http://127.0.0.1:8000/v1``."""
    engine: NulFreeText = Field(default="openai", max_length=100)
    """`embedded`, `vllm`, `sglang` or `openai` (any other compatible server)."""
    weight_version: int = Field(default=0, ge=0, le=2**62)


class Model(_Wire):
    """A named inference target: one or more endpoints serving the same weights."""

    model: str
    endpoints: list[str]
    engine: str
    """The kind of the most recently registered endpoint."""
    engines: list[str] = Field(default_factory=list)
    """Per endpoint, in the order of `endpoints`, its kind: a fleet may mix engines."""
    weight_version: int
    updated_at: datetime


LEASE_NOT_HELD = "lease not held: "
"""How the gateway's refusal (409) of a write under a lease that is not the writer's begins."""


class Lease(_Wire):
    """A named role's holder among the clients of one gateway (`POST /api/leases/{name}`): the
    rollout controller holds `controller`."""

    name: str
    holder: str
    """Who holds it now: the claimer when `granted`, else the other holder."""
    since: float
    """When this holder took it (Unix time)."""
    expires_at: float
    granted: bool
    token: str | None = None
    """When granted: what the holder's writes under the lease carry (`/api/leases/{name}/
    rollouts/...`). It names this tenure, and changes when the lease changes hands; None from
    a gateway older than fenced writes."""
