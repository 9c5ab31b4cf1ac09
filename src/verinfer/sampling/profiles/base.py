"""What a sampler profile is: the noise a named engine adds before its argmax.

A profile only decides the Gumbel noise ``G`` of (row, token) pairs and how the engine adds it to
the scaled logits; filters and the argmax are shared (``sampling/sampler.py``), so generation and
verification cannot drift apart. Each engine profile is one module in this package citing the
source file and version it follows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from numba import njit

from verinfer.sampling.filters import KeptSet
from verinfer.sampling.params import SamplingParams


PRUNE_SLACK = 1e-3  # logits: covers the fp32 rounding of x - floor, of exp and of u in the bound tests


def reach(x: np.ndarray, floor) -> np.ndarray:
    """``exp(min(x - floor + slack, 0))`` in ``x``'s dtype, the bound of every pruned dense replay: a
    token reaches the row's best score so far (``floor``) only if its noise ``G >= floor - x``, and
    each profile's ``G`` is at most ``-log`` of a uniform-like quantity (``u`` or ``1 - u``) that must
    then be at most this."""
    f = (np.asarray(floor, dtype=np.float64) - PRUNE_SLACK).astype(x.dtype)
    return np.exp(np.minimum(x - f, x.dtype.type(0)))


@njit(cache=True)
def reaching(x, w, threshold, floor, complement, scale=1.0):
    """Indices of a row's tokens with ``x >= threshold`` that may reach ``floor``, from each token's
    uniform-like quantity ``w * scale`` (``u``, or ``1 - u`` with ``complement``) that must be at most
    ``exp(x - floor)`` (``reach``). Tested here against ``(1 + a / 8) ** -8 >= exp(-a)`` (a >= 0), a
    superset found in one compiled pass with no ``exp``; callers score every token found exactly, so
    the few extra tokens cost a logarithm each and never change a result."""
    f = np.float32(floor - PRUNE_SLACK)
    keep = np.empty(x.size, dtype=np.bool_)
    for i in range(x.size):
        a = max(f - x[i], np.float32(0)) * np.float32(0.125) + np.float32(1)
        a = a * a
        a = a * a
        a = a * a
        v = (1.0 - w[i] * scale) if complement else w[i] * scale
        keep[i] = (x[i] >= threshold) & (v * a <= 1.0)
    return np.flatnonzero(keep)


def dense_on_cpu(method):
    """For ``noised_dense_above`` of a profile whose noise comes from a CPU stream or numpy: rows whose
    logits live on another device come to the CPU (one ``[rows, V]`` transfer of the wide rows only;
    filtered rows never get here) and the pairs found go back to that device."""
    @functools.wraps(method)
    def wrapper(self, keys, rows, x, threshold, floor, kept=None):
        if x.device.type == "cpu":
            return method(self, keys, rows, x, threshold, floor, kept)
        found = method(self, keys, rows.cpu(), x.cpu(), threshold.cpu(), floor.cpu(), None)
        return tuple(t.to(x.device) for t in found)
    return wrapper


@dataclass(frozen=True)
class RowKeys:
    """What identifies the noise of each row in a block of logits."""

    requests: tuple[str, ...]  # request (trace) id per row
    seeds: np.ndarray  # [N] object array of Python ints (seeds may exceed int64)
    positions: np.ndarray  # [N] int64: 0-based position of the last input token (vLLM's `pos`)
    steps: np.ndarray  # [N] int64: index k of the output token being sampled
    params: tuple[SamplingParams, ...] = field(default=())  # per row, for profiles with per-request modes

    def moved(self, d: int) -> "RowKeys":
        """The same rows at positions ``d`` later: the noise of prompts ``d`` tokens longer."""
        return replace(self, positions=self.positions + d) if d else self


class Profile:
    """Base class: a named noise source.

    ``gumbel`` returns fp64 noise for (row, token) pairs; ``noised`` adds it to the scaled logits
    as the engine does (fp64 here unless a profile says otherwise). ``noise_bound`` is an upper
    bound on any G the profile can draw (per row): tokens whose logit plus that bound cannot
    reach the best noised score found so far cannot win, so their noise is never computed.
    """

    name: str = ""
    aliases: tuple[str, ...] = ()
    seeded: bool = True
    description: str = ""
    # Noise keyed by the token's absolute position (prompt length + step) rather than by the step: a
    # prompt longer than the claimed one moves every draw (a hidden system message shows as an offset).
    position_keyed: bool = False

    def gumbel(self, keys: RowKeys, rows: torch.Tensor, cols: torch.Tensor, vocab_size: int) -> torch.Tensor:
        raise NotImplementedError

    def noised(self, keys: RowKeys, rows: torch.Tensor, cols: torch.Tensor, x: torch.Tensor,
               vocab_size: int, kept: KeptSet | None = None) -> torch.Tensor:
        """``x + G`` for the pairs (x: fp32 scaled logits of the pairs, given as fp64), as fp64.

        ``kept`` is the rows' whole kept set, for engines whose noise depends on a token's place in
        it (e.g. a sorted rank) rather than on its id alone.
        """
        return x.double() + self.gumbel(keys, rows, cols, vocab_size).to(x.device)

    def noised_dense_above(self, keys: RowKeys, rows: torch.Tensor, x: torch.Tensor, threshold: torch.Tensor,
                           floor: torch.Tensor, kept: KeptSet | None = None):
        """Kept tokens of whole rows whose ``x + G`` can reach the row's ``floor``, and their scores.

        ``rows`` index ``keys``; ``x`` [R, V] are those rows' scaled logits, ``threshold`` and
        ``floor`` per row. Returns (local row, token id, score) of every kept token except ones
        proven to score below the floor: here those whose logit plus ``noise_bound`` falls short.
        """
        bound = self.noise_bound(keys).to(x.device)[rows].to(x.dtype)
        reach = x + bound[:, None]
        reach = reach + 1e-6 * reach.abs() + 1e-6
        r, cols = ((x >= threshold[:, None]) & (reach >= floor[:, None].to(x.dtype))).nonzero(as_tuple=True)
        return r, cols, self.noised(keys, rows[r], cols, x[r, cols].double(), x.shape[1], kept)

    def noise_bound(self, keys: RowKeys) -> torch.Tensor:
        """Per-row upper bound on G (fp64); +inf disables pruning."""
        return torch.full((len(keys.requests),), float("inf"), dtype=torch.float64, device="cpu")

    def problems(self, params: SamplingParams) -> list[str]:
        """What this profile cannot replay in ``params`` (empty when it can)."""
        out = []
        if params.fp64_gumbel:
            out.append(f"fp64_gumbel is a vLLM option; profile {self.name!r} has no fp64 mode")
        if params.stream:
            out.append(f"stream: profile {self.name!r} takes no stream fields, got {sorted(params.stream)}")
        return out

    def replay_order(self, params: Sequence[SamplingParams], keys: RowKeys, idx: torch.Tensor,
                     vocab_size: int) -> torch.Tensor:
        """``idx`` (rows of ``keys``, sampled with ``params``) in the order the sampler replays them in
        chunks: any order gives the same result; a profile with a sequential stream orders rows so that
        consecutive chunks continue it."""
        return idx

    def forget(self, request: str) -> None:
        """Release any per-request state once a request is finished (stateless profiles keep none)."""
