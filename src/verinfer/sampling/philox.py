"""Triton's counter-based Philox4x32-10 (``triton.language.random``, Triton 3.x), compiled with numba.

vLLM 0.32's speculative rejection test draws its acceptance uniform as ``tl_rand32(seed, pos)``
(``vllm/v1/worker/gpu/sample/gumbel.py``): Triton's ``tl.rand(seed, pos)`` clamped below at
4.6566127342e-10. ``tl.rand`` runs ten Philox rounds on the counter ``(pos_lo, pos_hi, 0, 0)`` with
the key ``(seed_lo, seed_hi)`` (the int64 seed's two 32-bit words), keeps the first output word,
reads it as int32, folds negatives with ``~x`` and multiplies by 4.6566127342e-10 in fp32.
Checked bit for bit against the kernel run in Triton's interpreter (``tests/test_vllm_spec_kernel.py``)
and Random123's known answers. One compiled pass per entry replaces numpy's dozens of array
temporaries (the CUDA stream of ``profiles/vllm_v1.py`` hashes thousands of entries per row).
"""

from __future__ import annotations

import numpy as np
from numba import njit

ROUND_A = np.uint64(0xD2511F53)
ROUND_B = np.uint64(0xCD9E8D57)
KEY_A = np.uint64(0x9E3779B9)
KEY_B = np.uint64(0xBB67AE85)
SCALE = np.float32(4.6566127342e-10)  # largest s with (2**31 - 1) * s < 1 in fp32
RAND_MIN = np.float32(4.6566127342e-10)  # vLLM's _TL_RAND_MIN: the uniform never reaches 0
MASK32 = np.uint64(0xFFFFFFFF)
SHIFT32 = np.uint64(32)


def int64_words(values) -> tuple[np.ndarray, np.ndarray]:
    """Low and high 32-bit words of int64 values taken as two's complement (Triton's ``.to(uint64)``)."""
    v = np.asarray([int(x) & 0xFFFFFFFFFFFFFFFF for x in np.ravel(values)], dtype=np.uint64)
    return (v & MASK32).astype(np.uint32), (v >> np.uint64(32)).astype(np.uint32)


@njit(cache=True, inline="always")
def philox4(c0, c1, c2, c3, k0, k1):
    """Ten Philox4x32 rounds (``philox_impl``) on uint64 scalars holding 32-bit words: each product of
    two 32-bit words is exact in 64 bits, and the key bumps wrap at 2**32."""
    for _ in range(10):
        p0 = c0 * ROUND_A
        p2 = c2 * ROUND_B
        c0, c1, c2, c3 = (p2 >> SHIFT32) ^ c1 ^ k0, p2 & MASK32, (p0 >> SHIFT32) ^ c3 ^ k1, p0 & MASK32
        k0 = (k0 + KEY_A) & MASK32
        k1 = (k1 + KEY_B) & MASK32
    return c0, c1, c2, c3


@njit(cache=True)
def _philox4x32(c0, c1, c2, c3, k0, k1):
    out = np.empty((4, c0.size), dtype=np.uint32)
    for i in range(c0.size):
        w = philox4(c0[i], c1[i], c2[i], c3[i], k0[i], k1[i])
        out[0, i], out[1, i], out[2, i], out[3, i] = w[0], w[1], w[2], w[3]
    return out


def philox4x32(c0, c1, c2, c3, k0, k1):
    """Ten Philox4x32 rounds on (broadcast) uint32 arrays, as ``philox_impl``: the four counter words."""
    args = np.broadcast_arrays(*(np.asarray(a, dtype=np.uint64) for a in (c0, c1, c2, c3, k0, k1)))
    out = _philox4x32(*(np.ascontiguousarray(a).ravel() for a in args))
    return tuple(w.reshape(args[0].shape) for w in out)


def randint(seeds, offsets) -> np.ndarray:
    """``tl.randint(seed, offset)`` for an int64 offset: the first Philox word, as uint32."""
    k0, k1 = int64_words(seeds)
    lo, hi = int64_words(offsets)
    zero = np.zeros_like(lo)
    return philox4x32(lo, hi, zero, zero, k0, k1)[0]


def uniform(x: np.ndarray) -> np.ndarray:
    """``uint_to_uniform_float`` for 32-bit words: int32 view, ``~x`` for negatives, times SCALE in fp32."""
    i = np.asarray(x, dtype=np.uint32).view(np.int32)
    i = np.where(i < 0, ~i, i)
    return i.astype(np.float32) * SCALE


def tl_rand32(seeds, positions) -> np.ndarray:
    """vLLM's acceptance uniform ``tl_rand32(seed, pos, includes_zero=False)`` per (seed, pos), fp32."""
    seeds = np.broadcast_to(np.asarray(seeds, dtype=object), np.shape(positions))
    return np.maximum(uniform(randint(seeds, positions)), RAND_MIN)
