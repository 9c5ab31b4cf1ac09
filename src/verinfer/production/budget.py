"""The monitor's verification budget: which recorded traces it verifies when it cannot verify all.

A GPU engine makes tokens far faster than one CPU monitor can prefill them (RESULTS section 25:
1.6-1.7x the tokens per CPU second of this CPU engine). ``--sample FRACTION`` verifies a uniformly
random subset: a trace is chosen when the HMAC-SHA256 of its id under a secret key, read as a number
in [0, 1), is below the fraction. Without the key a provider cannot tell which of its answers will
be checked, so it cannot serve honestly only those; with the key (``--sample-key-env``) the choice
is reproducible by whoever holds it. Without one a random key is drawn per process.
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

    @classmethod
    def from_options(cls, fraction: float, key_env: str | None) -> "Budget":
        """``--sample`` and ``--sample-key-env`` (a variable holding at least 16 characters)."""
        if key_env:
            return cls(fraction, secret_from_env("--sample-key-env", key_env).encode())
        return cls(fraction)


__all__ = ["Budget"]
