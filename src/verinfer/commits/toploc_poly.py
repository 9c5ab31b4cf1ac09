"""Polynomial arithmetic over GF(65497) for TOPLOC proofs, batched over chunks and compiled (numba).

Every kernel takes [chunks, points] arrays and loops over chunks, so one call serves a whole trace.
Arithmetic is exact integer arithmetic carried in float64: residues are < 2**16, a product plus a
residue < 2**33, and every sum adds at most ``MAX_POINTS`` products (< 2**44) before reduction.
float64 lets the inner loops over points run as SIMD lanes, and ``_mod`` reduces with a multiply by
1/P instead of an integer division, which does not vectorize.

The interpolant through k points with distinct x is unique, so the coefficients equal those of the
reference library's Newton interpolation (``toploc`` 0.1.6, ``compute_newton_coefficients`` in
``toploc/C/csrc/ndd.cpp``, whatever order the points come in); we compute them in the Lagrange form,
in O(k**2) per chunk with one field inversion:

    M(X) = prod_i (X - x_i),  w_i = 1 / M'(x_i),  a_i = y_i * w_i,  c(X) = sum_i a_i * M(X) / (X - x_i)

M by multiplying in one factor at a time, every M'(x_i) by Horner's rule, the k inverses by one
Fermat power and prefix products (Montgomery's batch inversion), and M(X) / (X - x_i) by synthetic
division, its coefficients from the highest down: b_{k-1} = 1, b_{d-1} = m_d + x_i * b_d.
"""

from __future__ import annotations

import numpy as np
from numba import njit

P = 65497
"""The prime field of the reference library (the largest prime below 2**16 - 38)."""

MAX_POINTS = 4096
"""Largest supported k; keeps every sum of products below 2**44."""

_P_FLOAT = float(P)
_INV_P = 1.0 / P
_MODULUS_BLOCK = 64


@njit(cache=True, inline="always")
def _mod(a: float) -> float:
    """``a mod P`` for a non-negative integer-valued float64 a < 2**50.

    (a + 0.5) / P keeps its fractional part at least 0.5/P away from an integer, more than the
    float error of (a + 0.5) * (1/P) below 2**50, so the floor is the exact quotient.
    """
    return a - np.floor((a + 0.5) * _INV_P) * _P_FLOAT


@njit(cache=True, inline="always")
def _inverse(a: float) -> float:
    """1 / a mod P for a residue a != 0, by Fermat: a**(P-2)."""
    result, exponent = 1.0, P - 2
    while exponent:
        if exponent & 1:
            result = _mod(result * a)
        a = _mod(a * a)
        exponent >>= 1
    return result


@njit(cache=True)
def _interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    n_chunks, k = x.shape
    out = np.empty((n_chunks, k), np.int64)
    xs, values = np.empty(k), np.empty(k)
    m, grown = np.empty(k + 1), np.empty(k + 1)
    prefix, quotient = np.empty(k), np.empty(k)
    for chunk in range(n_chunks):
        xs[:] = x[chunk]
        m[0] = 1.0  # M(X), ascending, one factor (X - x_i) at a time
        for i in range(k):
            neg = _P_FLOAT - xs[i]
            grown[0] = _mod(neg * m[0])
            for d in range(1, i + 1):
                grown[d] = _mod(m[d - 1] + neg * m[d])
            grown[i + 1] = 1.0
            m, grown = grown, m
        values[:] = float(k)  # M'(x_i) by Horner; M' leads with k * m_k = k
        for d in range(k - 1, 0, -1):
            coeff = _mod(d * m[d])
            for i in range(k):
                values[i] = _mod(values[i] * xs[i] + coeff)
        running = 1.0  # batch inversion: w_i = prefix_i * (prod_{j<=i} M'(x_j))**-1 * suffix
        for i in range(k):
            prefix[i] = running
            running = _mod(running * values[i])
        inverse = _inverse(running)
        for i in range(k - 1, -1, -1):
            weight = _mod(inverse * prefix[i])
            inverse = _mod(inverse * values[i])
            values[i] = _mod(float(y[chunk, i]) * weight)  # a_i
        quotient[:] = 1.0  # b_{k-1} of every M(X) / (X - x_i)
        for d in range(k - 1, -1, -1):
            total, md = 0.0, m[d]
            for i in range(k):
                total += values[i] * quotient[i]
                quotient[i] = _mod(md + xs[i] * quotient[i])
            out[chunk, d] = np.int64(_mod(total))
    return out


def interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients (ascending, length k, int64) of the degree < k polynomial through (x, y) mod P.

    x: [chunks, k] distinct residues in [0, P); y: [chunks, k] residues in [0, P) (integer arrays).
    """
    return _interpolate(np.asarray(x, dtype=np.int64), np.asarray(y, dtype=np.int64))


@njit(cache=True, inline="always")
def horner(coeffs: np.ndarray, xs: np.ndarray, values: np.ndarray) -> None:
    """values[i] = the polynomial ``coeffs`` (ascending, n >= 1) at residue xs[i], mod P (float64)."""
    values[:] = float(coeffs[-1])
    for d in range(coeffs.size - 2, -1, -1):
        coeff = float(coeffs[d])
        for i in range(xs.size):
            values[i] = _mod(values[i] * xs[i] + coeff)


@njit(cache=True)
def _evaluate(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    out = np.empty(x.shape, np.int64)
    xs, values = np.empty(x.shape[1]), np.empty(x.shape[1])
    for chunk in range(coeffs.shape[0]):
        xs[:] = x[chunk]
        horner(coeffs[chunk], xs, values)
        out[chunk] = values.astype(np.int64)
    return out


def evaluate(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Values (int64) mod P of polynomials coeffs [chunks, n] at points x [chunks, j] (Horner; residues
    in [0, P), integer arrays)."""
    return _evaluate(np.asarray(coeffs, dtype=np.int64), np.asarray(x, dtype=np.int64))


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
