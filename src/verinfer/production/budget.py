"""The monitor's verification budget: which recorded traces it verifies when it cannot verify all.

A GPU engine makes tokens far faster than one CPU monitor can prefill them (RESULTS section 25:
1.6-1.7x the tokens per CPU second of this CPU engine). ``--sample FRACTION`` verifies a uniformly
random subset: a trace is chosen when the HMAC-SHA256 of its id under a secret key, read as a number
in [0, 1), is below the fraction. Without the key a provider cannot tell which of its answers will
be checked, so it cannot serve honestly only those; with the key (``--sample-key-env``) the choice
is reproducible by whoever holds it. Without one a random key is drawn per process.

At a fixed fraction the backlog grows without bound once traffic times the fraction exceeds what the
monitor verifies (``benchmarks/monitor_budget.py``: 10% of traffic ten times its rate is exactly its
rate, and it falls behind). ``--keep-up`` thins each shard by the shards waiting behind it
(``Budget.thinned``): the fraction falls as 1/(1 + waiting), so under traffic rho times what the
monitor verifies at ``--sample`` the backlog settles near rho - 1 shards instead of growing, and
each shard records the fraction it was verified at.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field

from verinfer.production.access import secret_from_env


@dataclass(frozen=True)
class Budget:
    """Verify the traces whose keyed hash falls below ``fraction`` (1.0: every trace)."""

    fraction: float = 1.0
    key: bytes = field(default_factory=lambda: os.urandom(32), repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"--sample must be in (0, 1], got {self.fraction:g}")

    def chosen(self, trace_id: str) -> bool:
        if self.fraction >= 1:
            return True
        digest = hmac.new(self.key, trace_id.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big") < self.fraction * 2**64

    def thinned(self, waiting: int) -> "Budget":
        """The budget for a shard with ``waiting`` shards queued behind it (``--keep-up``): the same key
        (the chosen traces of a thinner fraction are a subset of a thicker one's), fraction / (1 + waiting)."""
        if waiting <= 0:
            return self
        return Budget(self.fraction / (1 + waiting), self.key)

    @classmethod
    def from_options(cls, fraction: float, key_env: str | None) -> "Budget":
        """``--sample`` and ``--sample-key-env`` (a variable holding at least 16 characters)."""
        if key_env:
            return cls(fraction, secret_from_env("--sample-key-env", key_env).encode())
        return cls(fraction)


__all__ = ["Budget"]
