"""Sampling parameters: the part of an inference specification that the sampler replays."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any

GREEDY_TEMPERATURE = 1e-5  # vLLM: T below this is plain argmax, no noise
MIN_TEMPERATURE = 0.01  # vLLM: 0 < T < 0.01 is clamped to 0.01


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling configuration, named after vLLM's ``SamplingParams``.

    ``top_k <= 0`` and ``top_p >= 1`` disable those filters, ``min_p <= 0`` disables min-p.
    ``seed`` is required by every seeded profile (anything but ``greedy``). ``fp64_gumbel`` is
    vLLM's ``use_fp64_gumbel`` engine option (the V2 sampler's fp64 noise). ``stream`` holds what an
    engine profile needs to find the request's place in its random stream beyond seed and position
    (e.g. a batch row); each profile documents and validates its keys. Neither the seed nor
    ``stream`` is part of the calibration signature. ``speculative`` claims speculative decoding as
    vLLM's model runner V2 does it (``sampling/speculative.py``): ``{"draft": <draft model>, "k": <drafts
    per step>}``, the draft given as ``layers:N`` (the claimed model's first N layers), ``wN`` (the
    claimed model with N-bit round-to-nearest weights) or a model spec (``models.derived.draft_backend``);
    it is part of the signature.
    """

    profile: str = "vllm"
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    fp64_gumbel: bool = False
    stream: dict[str, Any] | None = None
    speculative: dict[str, Any] | None = None

    @property
    def is_greedy(self) -> bool:
        return self.profile == "greedy" or self.temperature < GREEDY_TEMPERATURE

    @property
    def effective_temperature(self) -> float:
        """The temperature the engine really divides by (greedy rows never use it)."""
        return max(self.temperature, MIN_TEMPERATURE)

    def to_dict(self) -> dict[str, Any]:
        """The fields, leaving out engine options at their defaults (older readers stay compatible)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # shallow: every value is JSON-ready
        for name in ("fp64_gumbel", "stream", "speculative"):
            if not d[name]:
                d.pop(name)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Build from a mapping, refusing unknown keys so a typo cannot silently mean a default."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
        return cls(**data)

    def signature(self) -> dict[str, Any]:
        """What a calibration must share with the traces it judges: every setting but the seed."""
        d = self.to_dict()
        d.pop("seed")
        d.pop("stream", None)
        return d

    def with_(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    def problems(self) -> list[str]:
        """Everything wrong with these parameters, as short phrases (empty when valid)."""
        out = []
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            out.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            out.append(f"top_k must be an integer, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            out.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            out.append(f"seed must be an integer, got {self.seed!r}")
        elif self.seed is not None and not -(2**63) <= self.seed < 2**64:
            out.append(f"seed must fit in 64 bits (as engines take it), got {self.seed}")
        if not isinstance(self.fp64_gumbel, bool):
            out.append(f"fp64_gumbel must be true or false, got {self.fp64_gumbel!r}")
        if self.stream is not None and not isinstance(self.stream, dict):
            out.append(f"stream must be an object, got {self.stream!r}")
        out += speculative_problems(self.speculative)
        if isinstance(self.top_k, int) and not -(2**63) <= self.top_k < 2**63:
            out.append(f"top_k must fit in int64, got {self.top_k}")
        if not out and not self.is_greedy and self.seed is None:
            out.append(f"profile {self.profile!r} is seeded but no seed was given")
        return out


MAX_DRAFT_TOKENS = 32


def speculative_problems(spec: Any) -> list[str]:
    """What is wrong with a ``speculative`` claim (None: plain decoding)."""
    if spec is None:
        return []
    if not isinstance(spec, dict):
        return [f"speculative must be an object {{draft, k}}, got {spec!r}"]
    out = []
    unknown = sorted(set(spec) - {"draft", "k"})
    if unknown:
        out.append(f"speculative: unknown field(s) {', '.join(unknown)} (known: draft, k)")
    draft, k = spec.get("draft"), spec.get("k")
    if not isinstance(draft, str) or not draft or (draft.startswith("layers") and not re.fullmatch(r"layers:[1-9]\d*", draft)):
        out.append(f"speculative.draft must name a draft model: layers:N (the claimed model's first N layers), "
                   f"wN (its N-bit weights) or a model, got {draft!r}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS:
        out.append(f"speculative.k must be an integer in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
    return out


def parse_speculative(text: str) -> dict[str, Any]:
    """``DRAFT:K`` (e.g. ``layers:28:4``, ``w4:4``) as a ``speculative`` claim; ValueError otherwise."""
    draft, _, k = text.rpartition(":")
    spec: dict[str, Any] = {"draft": draft, "k": int(k) if k.isdigit() else k}
    problems = speculative_problems(spec) if draft else [f"expected DRAFT:K such as layers:28:4, got {text!r}"]
    if problems:
        raise ValueError(f"--speculative {text}: {problems[0]}")
    return spec
