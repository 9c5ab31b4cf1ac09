"""vLLM's seeded sampler in the model runner V2 (the default from vLLM 0.32's GPU worker).

Follows ``vllm/v1/worker/gpu/sample/gumbel.py`` of vLLM 0.32.0 (``gumbel_noised_argmax``,
``murmur3_uniform32``, ``murmur3_uniform64``, ``_log1p_neg_stable``; REFERENCE.md 1.2). Noise is a
pure function of (seed, pos, token): no generator state, so batching, preemption and prefix
caching cannot move it.

- Hash: MurmurHash3_x86_32 of ``[seed_lo, seed_hi, pos, token]`` with hash seed 0 (``murmur3.py``).
  A speculative draft hashes ``pos + 2**30`` (``_DRAFT_NOISE_SALT``; ``VllmProfile(draft=True)``).
- fp32 mode (default): ``u = hi16 * 2**-16 + (lo16 + 0.5) * 2**-32`` in fp32 (the correctly rounded
  ``(h + 0.5) * 2**-32``); ``L = log(1 - u)`` as ``-u * (1 + u(1/2 + u(1/3 + ... + u/8)))`` (Horner,
  fp32) for ``u < 0.25``, else ``log(max(1 - u, 2**-24))``; ``G = -log(-L)``; the engine adds G to
  the fp32 scaled logits in fp32 and takes the argmax (first index on ties). No +inf: the largest
  G is ``-log(2**-33)`` = 22.87.
- fp64 mode (``use_fp64_gumbel``; sampling field ``fp64_gumbel``): a second hash with hash seed
  0x9E3779B9 gives the high word; ``u = ((hi << 32 | lo) >> 11 + 0.5) * 2**-53`` in fp64 (1.0 maps
  to ``1 - 2**-53``), ``G = -log(-log u)``, added to the logits in fp64.

Bit-exactness: on CPU the logarithms are numpy's fp32/fp64 ``log``, which is what vLLM's kernels
compute when run in Triton's interpreter (checked on recorded kernel outputs in the tests). numpy
and torch disagree in the last ulp of fp32 ``log`` on about 20% of inputs, and a CUDA build uses
yet another ``log``; such ulp differences move a margin by ~1e-6 and flip a token only on
near-exact ties. On a non-CPU device the noise is computed with torch on that device.
"""

from __future__ import annotations

import numpy as np
import torch

from verinfer.sampling import murmur3
from verinfer.sampling.profiles.base import Profile, RowKeys

DRAFT_NOISE_SALT = 1 << 30
FP64_HASH_SEED = 0x9E3779B9
# Largest G each mode can draw (at the smallest / largest uniform), rounded up.
MAX_GUMBEL_FP32 = 22.875
MAX_GUMBEL_FP64 = 36.75


def _log(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.from_numpy(np.log(x.numpy()))
    return torch.log(x)


def uniform32(h: torch.Tensor) -> torch.Tensor:
    """``(h + 0.5) * 2**-32`` as the fp32 sum of two exact halves (``murmur3_uniform32``)."""
    hi16 = (h >> 16).to(torch.float32)
    lo16 = (h & 0xFFFF).to(torch.float32)
    return hi16 * 2.0**-16 + (lo16 + 0.5) * 2.0**-32


def gumbel32(u: torch.Tensor) -> torch.Tensor:
    """fp32 ``-log(-log(1 - u))`` with the degree-8 series below 0.25 (``_log1p_neg_stable``)."""
    poly = torch.full_like(u, 1.0 / 8.0)
    for c in (1 / 7, 1 / 6, 1 / 5, 1 / 4, 1 / 3, 1 / 2, 1.0):
        poly = np.float32(c) + u * poly
    series = -u * poly
    direct = _log(torch.clamp_min(1.0 - u, 5.960464477539063e-08))
    return -_log(-torch.where(u < 0.25, series, direct))


def uniform64(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """53-bit uniform from two 32-bit hashes (``murmur3_uniform64``), open at 1."""
    random53 = (hi << 21) | (lo >> 11)  # ((hi << 32) | lo) >> 11 without leaving int64
    u = (random53.to(torch.float64) + 0.5) * 2.0**-53
    return torch.where(u == 1.0, u - 2.0**-53, u)


def _fp64_rows(keys: RowKeys, device: torch.device) -> torch.Tensor:
    return torch.tensor([p.fp64_gumbel for p in keys.params] if keys.params else [False] * len(keys.requests),
                        dtype=torch.bool, device=device)


class VllmProfile(Profile):
    name = "vllm"
    description = "vLLM model runner V2 (0.32): Murmur3 Gumbel noise G(seed, pos, token), fp32 or fp64"

    def __init__(self, draft: bool = False):
        self.draft = draft  # a speculative draft's noise: positions salted with 2**30

    def _noise(self, keys: RowKeys, rows: torch.Tensor, cols: torch.Tensor):
        """(fp32 G for fp32-mode pairs, fp64 G for fp64-mode pairs, fp64 flag per pair)."""
        fp64 = _fp64_rows(keys, cols.device)
        pos = torch.as_tensor(np.asarray(keys.positions, dtype=np.int64), device=cols.device)
        pos = pos + DRAFT_NOISE_SALT * self.draft
        lo = murmur3.hash_tokens(murmur3.prefix(keys.seeds, pos)[rows], cols)
        wide = fp64[rows]
        g32 = gumbel32(uniform32(lo[~wide]))
        g64 = torch.empty(0, dtype=torch.float64, device=cols.device)
        if bool(wide.any()):
            hi_prefix = murmur3.prefix(keys.seeds, pos, domain=FP64_HASH_SEED)
            hi = murmur3.hash_tokens(hi_prefix[rows[wide]], cols[wide])
            g64 = -_log(-_log(uniform64(lo[wide], hi)))
        return g32, g64, wide

    def gumbel(self, keys, rows, cols, vocab_size):
        g32, g64, wide = self._noise(keys, rows, cols)
        out = torch.empty(rows.shape[0], dtype=torch.float64, device=cols.device)
        out[~wide] = g32.double()
        out[wide] = g64
        return out

    def noised(self, keys, rows, cols, x, vocab_size, kept=None):
        g32, g64, wide = self._noise(keys, rows, cols)
        out = torch.empty(rows.shape[0], dtype=torch.float64, device=cols.device)
        out[~wide] = (x[~wide].float() + g32).double()  # the engine's fp32 add
        out[wide] = x[wide].double() + g64
        return out

    def noise_bound(self, keys):
        fp64 = _fp64_rows(keys, torch.device("cpu"))
        return torch.where(fp64, MAX_GUMBEL_FP64, MAX_GUMBEL_FP32).double()

    def problems(self, params):
        return [f"stream: profile 'vllm' takes no stream fields, got {sorted(params.stream)}"] if params.stream else []
