"""MurmurHash3_x86_32 over 16-byte messages, for whole rows of token ids at once.

The seeded samplers of vLLM (model runner V2) and SGLang hash the message ``[seed_lo, seed_hi,
pos, token]`` (four little-endian u32 words) with hash seed 0 (REFERENCE.md 1.2, 1.4). The first
three words are shared by a row, so they are mixed once per row (``prefix``); the token word's
own scrambling (``k * c1``, rotate, ``* c2``) depends on the token id alone, so it is computed
once per vocabulary (``token_words``). A pair then costs one xor, a rotate, a multiply-add and
the finalizer.

Two implementations of the same arithmetic: numpy ``uint32`` in cache-sized chunks on the CPU
(wrapping arithmetic is defined there, and it measured 2.5x faster than torch int32 and 10x
faster than unchunked; ``benchmarks/verify_speed.py``), and torch int64 with 16-bit split products
for any other device (torch has no wrapping uint32 arithmetic). Tests hold both to the ``mmh3``
package.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_N1 = 0xE6546B64
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35
CHUNK = 1 << 16  # pairs per numpy chunk: the temporaries stay in cache


# --- scalar-exact pieces shared by both implementations (Python ints) -----------------------------

def _mix_int(h: int, k: int) -> int:
    k = (k * _C1) & MASK32
    k = ((k << 15) | (k >> 17)) & MASK32
    k = (k * _C2) & MASK32
    h ^= k
    h = ((h << 13) | (h >> 19)) & MASK32
    return (h * 5 + _N1) & MASK32


def prefix_ints(seeds, positions, domain: int = 0) -> np.ndarray:
    """Per-row state after ``[seed_lo, seed_hi, pos]`` with hash seed ``domain``, as uint32.

    ``seeds`` are Python ints (any sign, taken mod 2**64); positions are taken mod 2**32.
    """
    out = np.empty(len(seeds), dtype=np.uint32)
    for i, (s, p) in enumerate(zip(seeds, np.asarray(positions).tolist())):
        s = int(s) % 2**64
        out[i] = _mix_int(_mix_int(_mix_int(domain, s & MASK32), s >> 32), int(p) & MASK32)
    return out


# --- numpy (CPU) -----------------------------------------------------------------------------------

@lru_cache(maxsize=8)
def token_words(vocab_size: int) -> np.ndarray:
    """``rotl(j * c1, 15) * c2`` for every token id j < vocab_size (uint32), computed once."""
    with np.errstate(over="ignore"):
        k = np.arange(vocab_size, dtype=np.uint32) * np.uint32(_C1)
        k = (k << np.uint32(15)) | (k >> np.uint32(17))
        words = k * np.uint32(_C2)
    words.flags.writeable = False
    return words


def finish_np(state: np.ndarray | np.uint32, words: np.ndarray) -> np.ndarray:
    """Hash of each pair from its row state (per pair, or one for all) and token word (uint32)."""
    out = np.empty(words.shape[0], dtype=np.uint32)
    one = np.ndim(state) == 0
    with np.errstate(over="ignore"):
        for a in range(0, words.shape[0], CHUNK):
            h = (state if one else state[a:a + CHUNK]) ^ words[a:a + CHUNK]
            h = (h << np.uint32(13)) | (h >> np.uint32(19))
            h *= np.uint32(5)
            h += np.uint32(_N1)
            h ^= np.uint32(16)  # the message length
            h ^= h >> np.uint32(16)
            h *= np.uint32(_F1)
            h ^= h >> np.uint32(13)
            h *= np.uint32(_F2)
            h ^= h >> np.uint32(16)
            out[a:a + CHUNK] = h
    return out


def hash_pairs_np(row_state: np.ndarray, rows: np.ndarray, cols: np.ndarray, vocab_size: int) -> np.ndarray:
    """Hashes of (row, token id) pairs given each row's ``prefix_ints`` state; ids < vocab_size."""
    return finish_np(row_state[rows], token_words(vocab_size)[cols])


# --- torch (any device) -----------------------------------------------------------------------------

def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for x in [0, 2**32) and a 32-bit constant c, without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & MASK32) | (x >> (32 - r))


def hash_pairs_torch(row_state: np.ndarray, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The same hashes as ``hash_pairs_np``, as int64 on the device of ``cols``."""
    h = torch.as_tensor(row_state.astype(np.int64), device=cols.device)[rows]
    k = _mul32(_rotl(_mul32(cols.to(torch.int64) & MASK32, _C1), 15), _C2)
    h = _rotl(h ^ k, 13)
    h = ((h * 5 + _N1) & MASK32) ^ 16
    h = _mul32(h ^ (h >> 16), _F1)
    h = _mul32(h ^ (h >> 13), _F2)
    return h ^ (h >> 16)
