"""Sampler profiles: which engine's noise a seeded request used, and one registry of them.

A profile only decides the Gumbel noise ``G`` of (row, token) pairs; filters and the argmax are
shared (``sampler.py``), so generation and verification cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from verinfer.sampling.noise import gumbel_from_exponential, vllm_gumbel_pairs


@dataclass(frozen=True)
class RowKeys:
    """What identifies the noise of each row in a block of logits."""

    requests: tuple[str, ...]  # request (trace) id per row
    seeds: np.ndarray  # [N] object array of Python ints (seeds may exceed int64)
    positions: np.ndarray  # [N] int64: 0-based position of the last input token (vLLM's `pos`)
    steps: np.ndarray  # [N] int64: index k of the output token being sampled


class Profile:
    """Base class: a named noise source. ``gumbel`` returns fp64 noise for (row, token) pairs."""

    name: str = ""
    seeded: bool = True
    description: str = ""

    def gumbel(self, keys: RowKeys, rows: torch.Tensor, cols: torch.Tensor, vocab_size: int) -> torch.Tensor:
        raise NotImplementedError

    def forget(self, request: str) -> None:
        """Release any per-request state once a request is finished (stateless profiles keep none)."""


class GreedyProfile(Profile):
    name = "greedy"
    seeded = False
    description = "argmax of the raw logits; no noise, no filters"

    def gumbel(self, keys, rows, cols, vocab_size):
        return torch.zeros(rows.shape[0], dtype=torch.float64)


class VllmProfile(Profile):
    name = "vllm"
    description = "vLLM's stateless seeded sampler: Murmur3 Gumbel noise G(seed, pos, token)"

    def gumbel(self, keys, rows, cols, vocab_size):
        g = vllm_gumbel_pairs(keys.seeds, keys.positions, rows.numpy(), cols.numpy())
        return torch.from_numpy(g)


@dataclass
class TorchExponentialProfile(Profile):
    """vLLM V1: a per-request ``torch.Generator``; step k uses the k-th full-vocabulary draw.

    Each request keeps only its generator and the next step it will draw, so consecutive steps
    (in generation, or in chunked verification) continue the stream without holding old draws;
    asking for an earlier step restarts the stream from the seed. Callers ``forget`` finished requests.
    """

    name = "torch-exponential"
    description = "vLLM V1 exponential race with a per-request torch.Generator (CPU stream)"
    _streams: dict = field(default_factory=dict)

    def _draws(self, request: str, seed: int, steps: np.ndarray, vocab_size: int) -> torch.Tensor:
        next_step, gen = self._streams.get(request, (0, None))
        lo, hi = int(steps.min()), int(steps.max()) + 1
        if gen is None or lo < next_step:
            gen = torch.Generator(device="cpu").manual_seed(int(seed) % 2**64)
            next_step = 0
        if lo > next_step:  # skip draws nobody asked for
            torch.empty(lo - next_step, vocab_size).exponential_(generator=gen)
        drawn = torch.empty(hi - lo, vocab_size).exponential_(generator=gen)
        self._streams[request] = (hi, gen)
        return drawn[torch.as_tensor(steps - lo)]

    def gumbel(self, keys, rows, cols, vocab_size):
        out = torch.empty(rows.shape[0], dtype=torch.float64)
        rows_np = rows.numpy()
        for request in dict.fromkeys(keys.requests):
            members = np.flatnonzero(np.asarray(keys.requests) == request)
            q = self._draws(request, keys.seeds[members[0]], keys.steps[members], vocab_size)
            local = np.full(len(keys.requests), -1)
            local[members] = np.arange(members.size)
            sel = np.flatnonzero(np.isin(rows_np, members))
            out[sel] = gumbel_from_exponential(q[local[rows_np[sel]], cols[sel]])
        return out

    def forget(self, request: str) -> None:
        self._streams.pop(request, None)


PROFILES: dict[str, type[Profile]] = {
    p.name: p for p in (GreedyProfile, VllmProfile, TorchExponentialProfile)
}


def get_profile(name: str) -> Profile:
    """A fresh profile instance by name, or a ValueError listing the known names."""
    try:
        return PROFILES[name]()
    except KeyError:
        raise ValueError(f"unknown sampler profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
