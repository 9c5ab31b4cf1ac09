"""Polynomial arithmetic over GF(65497) for TOPLOC proofs, batched over chunks.

Every function takes arrays whose leading axes are a batch of chunks, so one call serves a whole
trace. Arithmetic is exact integer arithmetic carried in float64: residues are < 2**16, products
< 2**32, and every sum adds at most ``MAX_POINTS`` products (< 2**44) before reduction.
float64 lets the k x k sums run as BLAS matrix products (integers below 2**53 add exactly in any
order), and ``_mod`` reduces with a multiply by 1/P instead of int64 division, which is ~4x slower.

The interpolant through k points with distinct x is unique, so the coefficients equal those of the
reference library's Newton interpolation (``toploc`` 0.1.6, ``compute_newton_coefficients`` in
``toploc/C/csrc/ndd.cpp``, whatever order the points come in); we compute them in the Lagrange form
instead because it needs no Python loop over the k**2 divided differences:

    M(x) = prod_i (x - x_i),  w_i = 1 / M'(x_i),  a_i = y_i * w_i,  S_t = sum_i a_i * x_i**t
    c_d  = sum_{t=0}^{k-1-d} m_{d+1+t} * S_t          (m_e: monomial coefficients of M)

which follows from M(x) / (x - x_i) = sum_d (sum_{e>d} m_e x_i**(e-d-1)) x**d.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

P = 65497
"""The prime field of the reference library (the largest prime below 2**16 - 38)."""

MAX_POINTS = 4096
"""Largest supported k; bounds memory (k x k work per chunk) and keeps every sum below 2**44."""

_INV_P = 1.0 / P
_MODULUS_BLOCK = 64


def _mod(a: np.ndarray) -> np.ndarray:
    """``a mod P`` for non-negative integer-valued float64 a < 2**50.

    (a + 0.5) / P keeps its fractional part at least 0.5/P away from an integer, more than the
    float error of (a + 0.5) * (1/P) below 2**50, so the floor is the exact quotient.
    """
    return a - np.floor((a + 0.5) * _INV_P) * P


@lru_cache(maxsize=1)
def _inverse_table() -> np.ndarray:
    """Multiplicative inverses of 0..P-1 (0 maps to 0), by Fermat: a**(P-2)."""
    base = np.arange(P, dtype=np.float64)
    result = np.ones(P)
    exponent = P - 2
    while exponent:
        if exponent & 1:
            result = _mod(result * base)
        base = _mod(base * base)
        exponent >>= 1
    return result


def powers(x: np.ndarray, n: int) -> np.ndarray:
    """``x[..., i] ** t mod P`` for t in 0..n-1 as ``[..., len, n]`` float64, by doubling."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty(x.shape + (n,))
    out[..., 0] = 1.0
    width = 1
    while width < n:
        step = _mod(out[..., width - 1] * x)  # x ** width
        span = min(width, n - width)
        out[..., width : width + span] = _mod(out[..., :span] * step[..., None])
        width += span
    return out


def _polymul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Product of equal-length ascending coefficient vectors, batched: [..., n] x [..., n] -> [..., 2n-1].

    The outer product's anti-diagonals are summed by the skew-reshape trick: padding each row with n
    zeros and re-reading the buffer with row width 2n-1 shifts row i right by i.
    """
    n = a.shape[-1]
    lead = a.shape[:-1]
    outer = a[..., :, None] * b[..., None, :]
    padded = np.concatenate([outer, np.zeros(outer.shape)], axis=-1)
    flat = padded.reshape(lead + (2 * n * n,))[..., : n * (2 * n - 1)]
    return _mod(flat.reshape(lead + (n, 2 * n - 1)).sum(axis=-2))


def vanishing_poly(x: np.ndarray) -> np.ndarray:
    """Ascending coefficients of prod_i (X - x_i) for x of shape [..., k] -> [..., k+1] (tree product)."""
    k = x.shape[-1]
    width = 1 << max(k - 1, 0).bit_length()
    factors = np.zeros(x.shape[:-1] + (width, 2))
    factors[..., 0] = 1.0  # padding factors are the constant 1
    factors[..., :k, 0] = _mod(P - np.asarray(x, dtype=np.float64))
    factors[..., :k, 1] = 1.0
    while factors.shape[-2] > 1:
        factors = _polymul(factors[..., 0::2, :], factors[..., 1::2, :])
    return factors[..., 0, : k + 1]


def interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients (ascending, length k, int64) of the degree < k polynomial through (x, y) mod P.

    x: [..., k] distinct residues in [0, P); y: [..., k] residues in [0, P).
    """
    k = x.shape[-1]
    m = vanishing_poly(x)
    xp = powers(x, k)
    derivative = _mod(np.arange(1, k + 1) * m[..., 1:])
    weights = _inverse_table()[_mod(xp @ derivative[..., None])[..., 0].astype(np.int64)]
    sums = _mod((_mod(y * weights)[..., None, :] @ xp)[..., 0, :])
    shifted = np.concatenate([m[..., 1:], np.zeros(m[..., 1:].shape)], axis=-1)
    hankel = shifted[..., np.add.outer(np.arange(k), np.arange(k))]
    return _mod(hankel @ sums[..., None])[..., 0].astype(np.int64)


def evaluate(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Values (int64) mod P of polynomials coeffs [..., n] at points x [..., j] -> [..., j]."""
    values = powers(x, coeffs.shape[-1]) @ np.asarray(coeffs, dtype=np.float64)[..., None]
    return _mod(values)[..., 0].astype(np.int64)


def _injective_in(indices: np.ndarray, moduli: np.ndarray) -> np.ndarray:
    """Which moduli map the (distinct) indices to distinct residues."""
    residues = np.sort(indices[None, :] % moduli[:, None], axis=-1)
    return (np.diff(residues, axis=-1) != 0).all(axis=-1)


def injective_modulus(indices: np.ndarray) -> int | None:
    """Largest m <= P with all ``indices mod m`` distinct, or None if no m >= len(indices) works.

    The reference's search (``ProofPoly.from_points`` in ``toploc/C/csrc/poly.cpp``) counts down from
    P and takes the first injective m: the same m, since none below k can be injective on k indices.
    """
    k = indices.shape[-1]
    if _injective_in(indices, np.array([P], dtype=np.int64))[0]:  # about 95% of 32x4096 chunks
        return P
    for top in range(P - 1, k - 1, -_MODULUS_BLOCK):
        moduli = np.arange(top, max(top - _MODULUS_BLOCK, k - 1), -1, dtype=np.int64)
        ok = _injective_in(indices, moduli)
        if ok.any():
            return int(moduli[np.argmax(ok)])
    return None
