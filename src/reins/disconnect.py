"""A request's work, raced against its client hanging up (the gateway's proxy and the engine).

An ASGI server does not stop a handler when its client leaves: a non-streamed LLM call would go
on generating for nobody, and the proxy would record a full answer the harness never received.
`unless_client_leaves` runs the work as a task beside a watch on `receive()`; when the server
reports `http.disconnect` first, the work is cancelled (its `finally` blocks run: the proxy's
upstream connection is closed, so the engine sees its own client leave and cancels the
sequence) and `ClientLeft` says how long the client waited.

Invariants:
- Only call it once the request body has been read: after that, `receive()` answers nothing but
  `http.disconnect` (uvicorn: when the client closes, or once the response is complete).
- Work that finished first wins, even when the client left in the same instant: its result is
  returned (and its records kept); sending it to a closed connection is harmless.
- A cancellation of the caller cancels the work too; nothing is left running.

Streamed answers need no race: Starlette's `StreamingResponse` watches `receive()` itself and
cancels the stream when the client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.types import Receive

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499
"""The status recorded for a call whose client left before its answer (nginx's convention; no
standard code exists). No client ever receives it."""


@dataclass(frozen=True)
class ClientLeft:
    """The client hung up (or timed out and closed) before the work was done."""

    after_s: float
    """Seconds from the start of the race to the hang-up."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the server reports that the client has gone."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_client_leaves(receive: Receive, work: Coroutine[Any, Any, T]) -> T | ClientLeft:
    """`work`'s result, or `ClientLeft` (with `work` cancelled and finished) when the client
    hung up first."""
    started = time.perf_counter()
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    if task.done():
        watch.cancel()
        return task.result()
    left = ClientLeft(time.perf_counter() - started)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # its cleanup (closing the upstream connection) runs before we go on
    return left
