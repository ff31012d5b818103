"""The admission gate for collocated training (paper section 3.1, DESIGN invariant 6).

While the trainer updates weights on the GPUs that serve inference, new LLM calls wait here
(bounded), calls already in flight finish, and a drain returns once nothing is in flight. To the
harness a held call is only a slow call. The gate lives in the gateway process: with several
gateway processes, the trainer pauses each of them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass


class AdmissionTimeout(Exception):
    """A call waited longer than the gate's bound for the pause to end."""

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"the gateway was paused for a weight update for {waited_s:.0f} s")
        self.waited_s = waited_s


@dataclass
class GateStatus:
    paused: bool
    in_flight: int
    """Calls admitted and not finished (a stream counts until its last chunk)."""
    held: int
    """Calls waiting for the pause to end."""
    pauses: int
    """Pauses since the gateway started."""


class AdmissionGate:
    def __init__(self, max_wait_s: float = 600.0) -> None:
        self.max_wait_s = max_wait_s
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self._held = 0
        self._pauses = 0

    def status(self) -> GateStatus:
        return GateStatus(
            paused=not self._open.is_set(),
            in_flight=self._in_flight,
            held=self._held,
            pauses=self._pauses,
        )

    def pause(self) -> GateStatus:
        """New calls wait from now on; calls in flight go on."""
        if self._open.is_set():
            self._pauses += 1
        self._open.clear()
        return self.status()

    def resume(self) -> GateStatus:
        """Held calls proceed, in the order they arrived."""
        self._open.set()
        return self.status()

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Waits until nothing is in flight; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def enter(self) -> None:
        """Admits one call, waiting while paused; raises `AdmissionTimeout` past the bound."""
        if not self._open.is_set():
            self._held += 1
            started = time.monotonic()
            try:
                # Re-check after waking: a pause that came between resume() and this task
                # running must hold the call again, or it would run during that update.
                while not self._open.is_set():
                    remaining = self.max_wait_s - (time.monotonic() - started)
                    if remaining <= 0:
                        raise TimeoutError
                    await asyncio.wait_for(self._open.wait(), remaining)
            except TimeoutError:
                raise AdmissionTimeout(time.monotonic() - started) from None
            finally:
                self._held -= 1
        self._in_flight += 1
        self._idle.clear()

    def exit(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    @asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        await self.enter()
        try:
            yield
        finally:
            self.exit()
