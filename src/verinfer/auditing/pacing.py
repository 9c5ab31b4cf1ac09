"""How many requests an audit keeps in flight at one provider: adapted to the server's latency.

A fixed ``--concurrency`` that a slow server cannot serve in time makes every request wait behind the
others until the per-operation timeout trips, and each timed-out request is paid for and generated
again (issue #42 item 4: 40 time-outs over 27 requests at ``--timeout 120 --concurrency 8``). The limit
here is additive-increase / multiplicative-decrease, as TCP's congestion window (RFC 5681): halved when
a request times out, the server says it is overloaded (429, 503, 504, 408), or an answer takes longer
than half the timeout (the sign that the next ones will not make it); raised by one after as many
answers in a row in good time as the limit itself, never above the asked ``--concurrency``. Only a
request sent after the last decrease can decrease it again, so requests that were already queued at
the server when it slowed count once, not once each.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

OVERLOADED = {408, 429, 503, 504}


class Pacer:
    """At most ``limit`` requests in flight, ``1 <= limit <= maximum``; ``slow_s``: an answer slower
    than this lowers the limit as a timeout does. ``on_change`` hears each change, as a sentence."""

    def __init__(self, maximum: int, slow_s: float, on_change: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if maximum < 1:
            raise ValueError(f"concurrency must be >= 1, got {maximum}")
        self.maximum = self.limit = self.lowest = maximum
        self.slow_s, self.on_change, self.clock = slow_s, on_change, clock
        self.active, self.in_time, self.decreases = 0, 0, 0
        self.reasons: dict[str, int] = {}  # what lowered the limit, and how often
        self._lowered_at = float("-inf")
        self._turn: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _cond(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()  # one per event loop: each ``fetch`` runs its own
        if self._turn is None or self._loop is not loop:
            self._turn, self._loop, self.active = asyncio.Condition(), loop, 0
        return self._turn

    async def acquire(self) -> float:
        """Wait for a free place; the time the request is sent (for ``answered`` / ``failed``)."""
        async with self._cond():
            await self._cond().wait_for(lambda: self.active < self.limit)
            self.active += 1
        return self.clock()

    async def release(self) -> None:
        async with self._cond():
            self.active -= 1
            self._cond().notify_all()

    def answered(self, sent: float, elapsed_s: float) -> None:
        """A request sent at ``sent`` was answered after ``elapsed_s`` (called before its ``release``)."""
        if elapsed_s > self.slow_s:
            self.failed(sent, f"answers slower than {self.slow_s:g} s")
            return
        self.in_time += 1
        if self.in_time >= self.limit and self.limit < self.maximum:
            self.in_time = 0
            self.limit += 1
            self._say(f"raised to {self.limit}")  # the waiters see it at the release that follows

    def failed(self, sent: float, reason: str) -> None:
        """A request sent at ``sent`` timed out or was refused as overload (``reason``)."""
        self.in_time = 0
        if sent <= self._lowered_at:  # it was in flight before the last decrease: already counted
            return
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self._lowered_at = self.clock()
        if self.limit > 1:
            self.limit = max(1, self.limit // 2)
            self.lowest = min(self.lowest, self.limit)
            self.decreases += 1
            self._say(f"lowered to {self.limit} ({reason})")

    def _say(self, what: str) -> None:
        if self.on_change is not None:
            self.on_change(f"concurrency {what}")

    def summary(self) -> dict:
        """For the report: the asked and lowest limits, the one at the end, and what lowered it."""
        return {"asked": self.maximum, "lowest": self.lowest, "final": self.limit, "decreases": self.decreases,
                "reasons": dict(self.reasons)}


def pacing_warning(summary: dict) -> str | None:
    """One report line when the limit had to come down; None when the server kept up."""
    if not summary or not summary.get("decreases"):
        return None
    why = ", ".join(f"{n} x {r}" for r, n in summary["reasons"].items())
    return (f"the server could not keep up with {summary['asked']} requests in flight ({why}): concurrency was "
            f"lowered to {summary['lowest']} and ended at {summary['final']}; pass a lower --concurrency or a "
            "longer --timeout for this provider")
