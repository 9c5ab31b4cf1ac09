"""Triton's counter-based Philox4x32-10 (``triton.language.random``, Triton 3.x), in numpy.

vLLM 0.32's speculative rejection test draws its acceptance uniform as ``tl_rand32(seed, pos)``
(``vllm/v1/worker/gpu/sample/gumbel.py``): Triton's ``tl.rand(seed, pos)`` clamped below at
4.6566127342e-10. ``tl.rand`` runs ten Philox rounds on the counter ``(pos_lo, pos_hi, 0, 0)`` with
the key ``(seed_lo, seed_hi)`` (the int64 seed's two 32-bit words), keeps the first output word,
reads it as int32, folds negatives with ``~x`` and multiplies by 4.6566127342e-10 in fp32.
Checked bit for bit against the kernel run in Triton's interpreter (``tests/test_vllm_spec_kernel.py``).
"""

from __future__ import annotations

import numpy as np

ROUND_A = np.uint64(0xD2511F53)
ROUND_B = np.uint64(0xCD9E8D57)
KEY_A = np.uint32(0x9E3779B9)
KEY_B = np.uint32(0xBB67AE85)
SCALE = np.float32(4.6566127342e-10)  # largest s with (2**31 - 1) * s < 1 in fp32
RAND_MIN = np.float32(4.6566127342e-10)  # vLLM's _TL_RAND_MIN: the uniform never reaches 0
_MASK32 = np.uint64(0xFFFFFFFF)


def _words(values) -> tuple[np.ndarray, np.ndarray]:
    """Low and high 32-bit words of int64 values taken as two's complement (Triton's ``.to(uint64)``)."""
    v = np.asarray([int(x) & 0xFFFFFFFFFFFFFFFF for x in np.ravel(values)], dtype=np.uint64)
    return (v & _MASK32).astype(np.uint32), (v >> np.uint64(32)).astype(np.uint32)


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = 10):
    """Ten Philox4x32 rounds on uint32 arrays, as ``philox_impl`` (returns the four counter words)."""
    c0, c1, c2, c3, k0, k1 = (np.asarray(a, dtype=np.uint32) for a in (c0, c1, c2, c3, k0, k1))
    with np.errstate(over="ignore"):  # the key bumps wrap around in uint32 (0-d arrays warn otherwise)
        for _ in range(rounds):
            p0 = c0.astype(np.uint64) * ROUND_A  # exact: both factors < 2**32
            p2 = c2.astype(np.uint64) * ROUND_B
            c0, c1, c2, c3 = ((p2 >> np.uint64(32)).astype(np.uint32) ^ c1 ^ k0, (p2 & _MASK32).astype(np.uint32),
                              (p0 >> np.uint64(32)).astype(np.uint32) ^ c3 ^ k1, (p0 & _MASK32).astype(np.uint32))
            k0 = k0 + KEY_A
            k1 = k1 + KEY_B
    return c0, c1, c2, c3


def randint(seeds, offsets) -> np.ndarray:
    """``tl.randint(seed, offset)`` for an int64 offset: the first Philox word, as uint32."""
    k0, k1 = _words(seeds)
    lo, hi = _words(offsets)
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
