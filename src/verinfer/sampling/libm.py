"""The C library's fp64 ``log``, element by element, for engines whose kernels call it.

numpy's own fp64 ``log`` is a SIMD implementation chosen by the CPU: on AVX-512 machines it differs
from the C library's in the last bit on a fraction of a percent of inputs (9 of the 2,048 recorded
vLLM kernel values, ``tests/test_engine_fixtures.py``), and on AVX2-only machines numpy calls the
C library. Engines
whose fp64 noise is ``log`` of the C library (vLLM's CPU ``fused_gumbel_argmax`` calls ``std::log``;
vLLM V2's kernels under Triton's interpreter were recorded on a machine where numpy did) are
replayed with this, so a replay gives the same bits on every machine. It is a Python loop: the
pruned replays call it only on the few tokens that can win.
"""

from __future__ import annotations

import math

import numpy as np


def log_c(a) -> np.ndarray:
    """fp64 ``log`` of the C library (``math.log``) for every element of ``a``."""
    a = np.asarray(a, dtype=np.float64)
    return np.fromiter(map(math.log, a.ravel().tolist()), dtype=np.float64, count=a.size).reshape(a.shape)
