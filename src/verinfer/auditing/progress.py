"""Progress of an audit's long stages (reference draws, scoring) as stage lines with an estimate.

A customer's audit spent up to 29 minutes drawing and scoring without a word (issue #42 item 4). A
stage reports how much is done and, from the rate so far, about how long is left, at most once per
``every`` seconds and once at the end, through the same ``on_stage`` the audit's other lines take.
"""

from __future__ import annotations

import time
from typing import Callable


class StageProgress:
    """Counts ``total`` units of one stage; ``advance`` reports through ``on_stage``."""

    def __init__(self, on_stage: Callable[[str], None] | None, label: str, total: int, unit: str,
                 every: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.on_stage, self.label, self.total, self.unit, self.every, self.clock = on_stage, label, total, unit, every, clock
        self.done = 0
        self.start = self.last = clock()

    def advance(self, n: int) -> None:
        self.done += n
        now = self.clock()
        if self.on_stage is None or (now - self.last < self.every and self.done < self.total):
            return
        self.last = now
        spent = now - self.start
        left = spent / self.done * (self.total - self.done) if self.done else float("nan")
        tail = "done" if self.done >= self.total else f"about {_duration(left)} left"
        self.on_stage(f"{self.label}: {self.done}/{self.total} {self.unit} in {_duration(spent)}, {tail}")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"
