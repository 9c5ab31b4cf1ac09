"""Gumbel noise sources that real engines use for seeded sampling.

Every source returns the Gumbel value ``G`` for (row, token) pairs, so a sampled token is
``argmax_j x_j + G_j`` over the tokens the filters keep (REFERENCE.md 1.1). Computing G for an
arbitrary subset of token ids is what makes verification cheap: the verifier only evaluates the
noise of tokens that survive top-k / top-p.
"""

from __future__ import annotations

import numpy as np
import torch

_C1 = np.uint32(0xCC9E2D51)
_C2 = np.uint32(0x1B873593)
_M5 = np.uint32(5)
_N1 = np.uint32(0xE6546B64)
_F1 = np.uint32(0x85EBCA6B)
_F2 = np.uint32(0xC2B2AE35)
_MASK32 = 0xFFFFFFFF


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _mix_block(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    k = k * _C1
    k = _rotl(k, 15)
    k = k * _C2
    h = h ^ k
    h = _rotl(h, 13)
    return h * _M5 + _N1


def _finalize(h: np.ndarray, length: int) -> np.ndarray:
    h = h ^ np.uint32(length)
    h = h ^ (h >> np.uint32(16))
    h = h * _F1
    h = h ^ (h >> np.uint32(13))
    h = h * _F2
    return h ^ (h >> np.uint32(16))


def murmur3_prefix(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """MurmurHash3_x86_32 state (hash seed 0) after the three words shared by a whole row.

    The message is ``[seed_lo, seed_hi, pos, token]`` as little-endian u32 words; the first
    three are the same for every token of a row, so they are mixed once per row.
    """
    s = np.array([int(v) % 2**64 for v in np.ravel(seeds)], dtype=np.uint64).reshape(np.shape(seeds))
    lo = (s & np.uint64(_MASK32)).astype(np.uint32)
    hi = (s >> np.uint64(32)).astype(np.uint32)
    pos = (np.asarray(positions, dtype=np.int64) & _MASK32).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = np.zeros_like(lo)
        for word in (lo, hi, pos):
            h = _mix_block(h, word)
    return h


def murmur3_tokens(prefix: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """Finish the hash for each (row prefix, token id) pair; arrays broadcast together."""
    with np.errstate(over="ignore"):
        h = _mix_block(np.asarray(prefix, dtype=np.uint32), np.asarray(token_ids).astype(np.uint32))
        return _finalize(h, 16)


def vllm_uniform(hashes: np.ndarray) -> np.ndarray:
    """vLLM's uniform: ``(h + 0.5) * 2**-32`` correctly rounded to fp32 (exact in fp64 first)."""
    return ((hashes.astype(np.float64) + 0.5) * 2.0**-32).astype(np.float32)


def vllm_gumbel_from_uniform(u: np.ndarray) -> np.ndarray:
    """``G = -log(-log(1 - u))`` evaluated in fp32 as vLLM does, returned as fp64.

    fp32 is kept on purpose: for ``u < 2**-25`` the fp32 ``1 - u`` rounds to 1 and G is +inf,
    so that token wins if it is kept. Replaying vLLM exactly means replaying that too.
    """
    u32 = np.asarray(u, dtype=np.float32)
    with np.errstate(divide="ignore"):
        g = -np.log(-np.log(np.float32(1.0) - u32))
    return g.astype(np.float64)


def vllm_gumbel(seeds: np.ndarray, positions: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """Gumbel noise of vLLM's stateless seeded sampler, ``G(seed, pos, token)``, for any pairs.

    ``seeds`` and ``positions`` are per row (shape [R]); ``token_ids`` is [R, C] (or broadcastable).
    """
    prefix = murmur3_prefix(seeds, positions)
    tok = np.asarray(token_ids)
    if tok.ndim == 2:
        prefix = prefix[:, None]
    return vllm_gumbel_from_uniform(vllm_uniform(murmur3_tokens(prefix, tok)))


def vllm_gumbel_pairs(seeds: np.ndarray, positions: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Noise for a flat list of (row, token) pairs: one prefix per row, one finish per pair."""
    prefix = murmur3_prefix(seeds, positions)
    return vllm_gumbel_from_uniform(vllm_uniform(murmur3_tokens(prefix[rows], cols)))


def torch_exponential_draws(seed: int, n_steps: int, vocab_size: int, skip_steps: int = 0) -> torch.Tensor:
    """The first draws of a per-request ``torch.Generator`` racing exponentials (vLLM V1 style).

    Step k of a request uses the k-th full-vocabulary fp32 ``exponential_`` draw of a generator
    seeded with the request seed. On CPU this is the CPU generator's stream, which differs from
    CUDA's Philox stream: traces from a GPU vLLM V1 cannot be replayed with it.
    Drawing [n, V] at once equals n sequential [V] draws (checked in the tests).
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    if skip_steps:
        torch.empty(skip_steps, vocab_size).exponential_(generator=gen)
    return torch.empty(n_steps, vocab_size).exponential_(generator=gen)


def gumbel_from_exponential(q: torch.Tensor) -> torch.Tensor:
    """``argmax p/q == argmax x + G`` with ``G = -log q`` (REFERENCE.md 1.1), in fp64."""
    return -torch.log(q.double())
