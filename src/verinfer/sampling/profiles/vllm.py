"""vLLM's seeded sampler in the model runner V2 (the default of vLLM 0.32's GPU worker).

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

Bit-exactness: on CPU the arithmetic is numpy's fp32 and the C library's fp64 ``log``
(``sampling/libm.py``), which is what vLLM's kernels computed when run in Triton's interpreter
(checked against recorded kernel outputs in the tests; numpy's AVX-512 fp64 ``log`` missed 9 of
the 2,048 recorded fp64 values). numpy and
torch disagree in the last ulp of fp32 ``log`` on about 20% of inputs, and a CUDA build uses yet
another ``log`` (and may fuse the series' multiply-adds): such ulp differences move a margin by
~1e-6 and flip a token only on near-exact ties. On other devices the noise is computed with torch.

Speed: a token can only win if ``x + G`` reaches the best score found so far (``floor``); since
``G <= -log u``, that needs ``u <= exp(x - floor)``, so in fp32 mode the logarithms are computed
only for the few hashes under that bound (``noised_above``): the result is identical.
"""

from __future__ import annotations

import numpy as np
import torch

from verinfer.sampling import murmur3
from verinfer.sampling.libm import log_c
from verinfer.sampling.profiles.base import Profile, RowKeys, reach, reaching

DRAFT_NOISE_SALT = 1 << 30
FP64_HASH_SEED = 0x9E3779B9
# Largest G each mode can draw (at the smallest / largest uniform), rounded up.
MAX_GUMBEL_FP32 = 22.875
MAX_GUMBEL_FP64 = 36.75
_F = np.float32


def uniform32(h: np.ndarray) -> np.ndarray:
    """``(h + 0.5) * 2**-32`` as the fp32 sum of two exact halves (``murmur3_uniform32``)."""
    return (h >> np.uint32(16)).astype(_F) * _F(2.0**-16) + ((h & np.uint32(0xFFFF)).astype(_F) + _F(0.5)) * _F(2.0**-32)


def gumbel32(u: np.ndarray) -> np.ndarray:
    """fp32 ``-log(-log(1 - u))`` with the degree-8 series below 0.25 (``_log1p_neg_stable``)."""
    poly = np.full_like(u, _F(1 / 8))
    for c in (1 / 7, 1 / 6, 1 / 5, 1 / 4, 1 / 3, 1 / 2, 1.0):
        poly = _F(c) + u * poly
    series = -u * poly
    direct = np.log(np.maximum(_F(1) - u, _F(5.960464477539063e-08)))
    return -np.log(-np.where(u < _F(0.25), series, direct))


def uniform64(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """53-bit uniform from two 32-bit hashes (``murmur3_uniform64``), open at 1."""
    random53 = (hi.astype(np.uint64) << np.uint64(21)) | (lo.astype(np.uint64) >> np.uint64(11))
    u = (random53.astype(np.float64) + 0.5) * 2.0**-53
    return np.where(u == 1.0, u - 2.0**-53, u)


def _torch_gumbel32(h: torch.Tensor) -> torch.Tensor:
    """The fp32 mode with torch on any device (same formula; the device's own ``log``)."""
    u = (h >> 16).float() * 2.0**-16 + ((h & 0xFFFF).float() + 0.5) * 2.0**-32
    poly = torch.full_like(u, 1 / 8)
    for c in (1 / 7, 1 / 6, 1 / 5, 1 / 4, 1 / 3, 1 / 2, 1.0):
        poly = float(np.float32(c)) + u * poly
    log1mu = torch.where(u < 0.25, -u * poly, torch.log(torch.clamp_min(1.0 - u, 5.960464477539063e-08)))
    return -torch.log(-log1mu)


class VllmProfile(Profile):
    name = "vllm"
    position_keyed = True
    description = "vLLM model runner V2 (0.32): Murmur3 Gumbel noise G(seed, pos, token), fp32 or fp64"

    def __init__(self, draft: bool = False):
        self.draft = draft  # a speculative draft's noise: positions salted with 2**30

    @staticmethod
    def _fp64(keys: RowKeys) -> np.ndarray:
        return np.array([p.fp64_gumbel for p in keys.params] if keys.params else [False] * len(keys.requests), bool)

    def _rows(self, keys: RowKeys):
        """(hash state per row, hash position per row, fp64 flag per row)."""
        pos = np.asarray(keys.positions, dtype=np.int64) + DRAFT_NOISE_SALT * self.draft
        return murmur3.prefix_ints(keys.seeds, pos), pos, self._fp64(keys)

    def _noised(self, keys, rows, cols, x, vocab_size, floor=None):
        """(which pairs can reach ``floor``, their noised scores as fp64); every pair without a floor."""
        state, pos, fp64 = self._rows(keys)
        device = cols.device
        if device.type != "cpu":
            if not fp64.any():
                return self._noised_torch(state, rows, cols, x)
            # fp64 mode hashes twice and takes fp64 logarithms with the C library's log: on the CPU
            found = self._noised(keys, rows.cpu(), cols.cpu(), x.cpu(), vocab_size,
                                 None if floor is None else floor.cpu())
            return tuple(t.to(device) for t in found)
        rows_np, cols_np, x_np = rows.numpy(), cols.numpy(), x.numpy()
        vocab = max(vocab_size, int(cols_np.max()) + 1 if cols_np.size else 1)
        h = murmur3.hash_pairs_np(state, rows_np, cols_np, vocab)
        wide = fp64[rows_np]
        keep = np.ones(rows_np.shape[0], dtype=bool)
        if floor is not None:  # G <= -log u: only u <= exp(x - floor) can reach the floor
            limit = reach(x_np, floor.numpy()[rows_np]) * 2.0**32
            keep = wide | (h <= limit)
        scores = np.empty(rows_np.shape[0], dtype=np.float64)
        narrow = keep & ~wide
        scores[narrow] = (x_np[narrow].astype(_F) + gumbel32(uniform32(h[narrow]))).astype(np.float64)
        if wide.any():
            hi = murmur3.hash_pairs_np(murmur3.prefix_ints(keys.seeds, pos, FP64_HASH_SEED), rows_np[wide],
                                       cols_np[wide], vocab)
            scores[wide] = x_np[wide] - log_c(-log_c(uniform64(h[wide], hi)))
        return torch.from_numpy(keep), torch.from_numpy(scores[keep])

    def _noised_torch(self, state, rows, cols, x):
        """fp32 mode on the logits' device (torch Murmur3 and the kernel's series)."""
        h = murmur3.hash_pairs_torch(state, rows, cols)
        scores = (x.float() + _torch_gumbel32(h)).double()
        return torch.ones(rows.shape[0], dtype=torch.bool, device=cols.device), scores

    def gumbel(self, keys, rows, cols, vocab_size):
        x = torch.zeros(rows.shape[0], dtype=torch.float64, device=cols.device)
        return self._noised(keys, rows, cols, x, vocab_size)[1]

    def noised(self, keys, rows, cols, x, vocab_size, kept=None):
        return self._noised(keys, rows, cols, x, vocab_size)[1]

    def noised_above(self, keys, rows, cols, x, floor, vocab_size, kept=None):
        return self._noised(keys, rows, cols, x, vocab_size, floor)

    def noised_dense_above(self, keys, rows, x, threshold, floor, kept=None):
        """Whole rows on the CPU: hash every token (cheap integer work), then take logarithms only
        for tokens whose uniform lets them reach the floor: fp32 mode needs ``u <= exp(x - floor)``
        (``G <= -log u``), fp64 mode ``u >= 1 - exp(x - floor)`` (``G <= -log(1 - u)``)."""
        if x.device.type != "cpu":
            return super().noised_dense_above(keys, rows, x, threshold, floor, kept)
        state, pos, fp64 = self._rows(keys)
        hi_state = murmur3.prefix_ints(keys.seeds, pos, FP64_HASH_SEED) if fp64.any() else None
        words = murmur3.token_words(x.shape[1])
        out_r, out_c, out_s = [], [], []
        for i, r in enumerate(rows.tolist()):
            xr, tau = x[i].numpy(), threshold[i].item()
            ids = None if tau == float("-inf") else np.flatnonzero(xr >= tau)  # a wide top-p row: its kept tokens
            xs, w = (xr, words) if ids is None else (xr[ids], words[ids])
            h = murmur3.finish_np(state[r], w)
            if fp64[r]:  # 1 - u >= 1 - (hi + 1) 2**-32 must be at most exp(x - floor)
                hi = murmur3.finish_np(hi_state[r], w)
                sel = reaching(xs, hi.astype(np.float64) + 1.0, float("-inf"), float(floor[i]), True, 2.0**-32)
                scores = xs[sel] - log_c(-log_c(uniform64(h[sel], hi[sel])))
            else:  # u >= h 2**-32 must be at most exp(x - floor)
                sel = reaching(xs, h, float("-inf"), float(floor[i]), False, 2.0**-32)
                scores = (xs[sel] + gumbel32(uniform32(h[sel]))).astype(np.float64)
            cols = sel if ids is None else ids[sel]
            out_r.append(np.full(cols.size, i))
            out_c.append(cols)
            out_s.append(scores)
        cat = lambda parts, dtype: torch.from_numpy(np.concatenate(parts).astype(dtype))  # noqa: E731
        return cat(out_r, np.int64), cat(out_c, np.int64), cat(out_s, np.float64)

    def noise_bound(self, keys):
        return torch.from_numpy(np.where(self._fp64(keys), MAX_GUMBEL_FP64, MAX_GUMBEL_FP32))  # no hashing needed

    def problems(self, params):
        return [f"stream: profile 'vllm' takes no stream fields, got {sorted(params.stream)}"] if params.stream else []
