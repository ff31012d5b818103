"""How a write to the gateway is retried, by `reins.agent` and `reins.client.GatewayClient` alike.

A write that meets a transport error or a 5xx answer is tried again, with the same idempotency
key (so it is stored once), after exponentially growing jittered waits, until `RETRY_FOR_S` has
passed since its first try. That outlasts a gateway restart, its database recovery included: an
agent that finished its work must not lose its reward to a restart. An agent's retries end with
the agent anyway: the controller kills it at its attempt's timeout.

Standard library only: `reins.agent` runs in every agent's short process.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

RETRY_FOR_S = 120.0
"""How long one write is retried, from its first try."""


def retry_delays(
    retry_for_s: float = RETRY_FOR_S, *, first_s: float = 0.1, max_s: float = 5.0
) -> Iterator[float]:
    """The waits before each retry of one write: `first_s * 2**n`, capped at `max_s`, jittered
    (x0.5 to x1.5, so that clients cut off together do not retry together), the last one
    shortened to end `retry_for_s` after this was called; then none (give up).

    Not a generator: a generator's body, and so its deadline, would start at the first wait,
    after the first try had failed, and a first try that timed out (10 s for an agent's event
    post) was added to `retry_for_s`."""
    return _delays(time.monotonic() + retry_for_s, first_s, max_s)


def _delays(deadline: float, first_s: float, max_s: float) -> Iterator[float]:
    for n in range(1_000_000):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        yield min(left, min(max_s, first_s * 2 ** min(n, 60)) * (0.5 + random.random()))
