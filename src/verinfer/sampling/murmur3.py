"""MurmurHash3_x86_32 over 16-byte messages, vectorized in torch so it runs on the model's device.

The seeded samplers of vLLM (model runner V2) and SGLang hash the message ``[seed_lo, seed_hi,
pos, token]`` (four little-endian u32 words) with hash seed 0 (REFERENCE.md 1.2, 1.4). The first
three words are shared by a whole row, so they are mixed once per row (``prefix``) and each token
costs one block mix and the finalizer.

torch has no wrapping uint32 arithmetic, so words live in int64 in ``[0, 2**32)`` and a 32-bit
product is formed from two 16-bit halves of the constant, so that no intermediate value overflows
int64 (signed overflow is undefined in the C++ kernels underneath).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for x in [0, 2**32) and a 32-bit constant c, without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & MASK32) | (x >> (32 - r))


def mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One MurmurHash3_x86_32 body step: mix the 32-bit word ``k`` into the state ``h``."""
    k = _mul32(_rotl(_mul32(k, _C1), 15), _C2)
    h = _rotl(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & MASK32


def finalize(h: torch.Tensor, length: int) -> torch.Tensor:
    """The finalizer (``fmix32``) after xoring in the message length in bytes."""
    h = h ^ length
    h = _mul32(h ^ (h >> 16), _F1)
    h = _mul32(h ^ (h >> 13), _F2)
    return h ^ (h >> 16)


def prefix(seeds, positions: torch.Tensor, domain: int = 0) -> torch.Tensor:
    """State after the row's three shared words ``[seed_lo, seed_hi, pos]``, hash seed ``domain``.

    ``seeds`` are Python ints (any sign, taken mod 2**64); ``positions`` int64 (taken mod 2**32).
    """
    s = [int(v) % 2**64 for v in seeds]
    device = positions.device
    lo = torch.tensor([v & MASK32 for v in s], dtype=torch.int64, device=device)
    hi = torch.tensor([v >> 32 for v in s], dtype=torch.int64, device=device)
    h = torch.full_like(lo, domain)
    for word in (lo, hi, positions.to(torch.int64) & MASK32):
        h = mix(h, word)
    return h


def hash_tokens(row_prefix: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Finish the 16-byte hash for (row prefix, token id) pairs that broadcast together."""
    return finalize(mix(row_prefix, token_ids.to(torch.int64) & MASK32), 16)
