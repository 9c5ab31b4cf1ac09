"""PyTorch's CPU generator (MT19937) and its fp64 ``uniform_`` stream, compiled with numba; and the
C++ standard library's ``std::mt19937`` doubles that llama.cpp's ``dist`` sampler draws
(``mt19937_outputs``, ``canonical_doubles``: ``profiles/llama_cpp.py``).

``torch.Generator(device="cpu").manual_seed(s)`` (``aten/src/ATen/CPUGeneratorImpl.cpp``,
``core/MT19937RNGEngine.h``) seeds a 32-bit Mersenne Twister with ``s mod 2**32`` (Matsumoto and
Nishimura's ``init_genrand``) and twists before its first output. ``random64()`` joins two outputs,
the first as the high word; an fp64 ``uniform_`` on [0, 1) keeps its low 53 bits times ``2**-53``
(``core/DistributionsHelper.h``, serial on the CPU), as ``exponential_`` does before its
``-log1p(-u)`` (``profiles/vllm_v1.py``). Tested bit for bit against ``torch.Tensor.uniform_``.

Why not torch's own: ``uniform_`` makes one serial call per entry, and vLLM V1 draws a whole
vocabulary per step; this twist and tempering are branch-free loops the compiler vectorizes
(``benchmarks/verify_speed.py``, case ``vllm-v1, no filters``; RESULTS section 3).
"""

from __future__ import annotations

import numpy as np
from numba import njit

N, M = 624, 397
_UPPER, _LOWER, _MATRIX_A = np.uint32(0x80000000), np.uint32(0x7FFFFFFF), np.uint32(0x9908B0DF)
_B, _C = np.uint32(0x9D2C5680), np.uint32(0xEFC60000)
_LOW53 = np.int64((1 << 53) - 1)
_1, _7, _11, _15, _18, _32 = (np.uint32(v) for v in (1, 7, 11, 15, 18, 32))


@njit(cache=True)
def _init(seed):
    mt = np.empty(N, dtype=np.uint32)
    mt[0] = np.uint32(seed)
    for i in range(1, N):
        prev = np.uint64(mt[i - 1])
        mt[i] = np.uint32((np.uint64(1812433253) * (prev ^ (prev >> np.uint64(30))) + np.uint64(i))
                          & np.uint64(0xFFFFFFFF))
    return mt


@njit(cache=True, inline="always")
def _mix(a, b, far):
    y = (a & _UPPER) | (b & _LOWER)
    return far ^ (y >> _1) ^ ((y & _1) * _MATRIX_A)


@njit(cache=True)
def _twist(mt):
    """The next 624 words in place, in three loops without carried dependences shorter than 227."""
    for i in range(N - M):
        mt[i] = _mix(mt[i], mt[i + 1], mt[i + M])
    for i in range(N - M, N - 1):
        mt[i] = _mix(mt[i], mt[i + 1], mt[i + M - N])
    mt[N - 1] = _mix(mt[N - 1], mt[0], mt[M - 1])


@njit(cache=True, inline="always")
def _temper(y):
    y ^= y >> _11
    y ^= (y << _7) & _B
    y ^= (y << _15) & _C
    return y ^ (y >> _18)


@njit(cache=True)
def _uniforms(mt, pos, n):
    """``n`` fp64 uniforms from state ``mt`` at output ``pos`` (N: twist first); returns them and the new
    pos. Outputs are taken in pairs (``pos`` stays even), tempered a twist block at a time, and each
    pair's 53 bits go to fp64 through int64 (exact below 2**53, and a vectorized conversion)."""
    out = np.empty(n, dtype=np.float64)
    block = np.empty(N, dtype=np.int64)
    done = 0
    while done < n:
        if pos == N:
            _twist(mt)
            pos = 0
        take = min((N - pos) // 2, n - done)
        for i in range(2 * take):
            block[i] = np.int64(_temper(mt[pos + i]))
        for k in range(take):
            out[done + k] = np.float64(((block[2 * k] << 32) | block[2 * k + 1]) & _LOW53) * 2.0**-53
        pos += 2 * take
        done += take
    return out, pos


class Mt19937:
    """One ``torch.Generator(device="cpu").manual_seed(seed)``, drawing fp64 uniforms as ``uniform_``."""

    def __init__(self, seed: int):
        self._mt = _init(np.uint32(int(seed) % 2**32))
        self._pos = N

    def skip(self, n: int, chunk: int = 1 << 22) -> None:
        """Advance past ``n`` uniforms (drawn in chunks, so memory stays bounded)."""
        while n > 0:
            self.uniforms(min(n, chunk))
            n -= chunk

    def uniforms(self, n: int) -> np.ndarray:
        """The next ``n`` values ``torch.empty(n, dtype=torch.float64).uniform_(generator=gen)`` gives."""
        out, self._pos = _uniforms(self._mt, self._pos, int(n))
        return out


def mt19937_outputs(seed: int, n: int) -> np.ndarray:
    """The first ``n`` 32-bit outputs of ``std::mt19937(seed)`` (``init_genrand``), as uint64."""
    bitgen = np.random.MT19937(0)
    bitgen._legacy_seeding(int(seed) & 0xFFFFFFFF)  # numpy's legacy seeding is init_genrand
    return bitgen.random_raw(n).astype(np.uint64)


def canonical_doubles(outputs: np.ndarray) -> np.ndarray:
    """libstdc++ ``uniform_real_distribution<double>(0, 1)`` over a 32-bit engine: two outputs per
    draw (``generate_canonical<double, 53>``), ``(o0 + o1 * 2**32) / 2**64`` in double, 1.0 mapped
    to the largest double below 1."""
    o = outputs.reshape(-1, 2).astype(np.float64)
    u = (o[:, 0] + o[:, 1] * 2.0**32) / 2.0**64
    return np.where(u >= 1.0, np.nextafter(1.0, 0.0), u)
