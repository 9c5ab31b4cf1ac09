"""The k largest bf16 magnitudes per chunk, selected exactly as ``torch.topk`` on CPU selects them.

TOPLOC proofs commit to the set of indices that the reference library (``toploc`` 0.1.6) takes with
``flat.abs().topk(k)``; when entries tie at the k-th magnitude (most chunks of real and random
hidden states) which tied indices are in the set follows from torch's algorithm, not from a rule
one could restate, so byte-identical proofs need the same algorithm.

torch's CPU kernel (``aten/src/ATen/native/TopKImpl.h``, ``topk_impl_loop``) copies a row into
(value, index) pairs in index order and, when 64k <= n, calls ``std::partial_sort`` with
``comp(x, y) = x.value > y.value``; otherwise ``std::nth_element`` (``sorted`` only orders the set
afterwards). libstdc++'s ``partial_sort`` selects with ``__heap_select``: ``__make_heap`` over the
first k pairs, then for each later pair, in index order, ``if comp(pair, top)`` (strictly larger
than the heap's smallest) ``__pop_heap`` puts it in through ``__adjust_heap``: the hole at the
root descends to a leaf, taking the child for which ``comp(left, right)`` fails to hold in favour
of the right one (``if comp(right, left): left``), and the new pair rises from the leaf while
``comp(parent, pair)``. ``_heap_select`` below is that code for one row of u16 magnitudes (bf16
magnitudes order as their bit patterns do), compiled; it never copies the row. Rows with 64k > n
take torch's own call. The tests check both against ``torch.topk`` on tie-dense rows and against
the reference's recorded proofs.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

HEAP_FACTOR = 64
"""torch uses the heap selection when HEAP_FACTOR * k <= n."""


@njit(cache=True, inline="always")
def _adjust_heap(values: np.ndarray, indices: np.ndarray, hole: int, length: int, value: int, index: int) -> None:
    """libstdc++'s ``__adjust_heap`` then ``__push_heap`` with comp = greater value (a min-heap)."""
    top, child = hole, hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        child -= np.int64(values[child] > values[child - 1])  # comp(right, left): the left child (no branch)
        values[hole], indices[hole] = values[child], indices[child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        values[hole], indices[hole] = values[child - 1], indices[child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and values[parent] > value:  # comp(parent, value)
        values[hole], indices[hole] = values[parent], indices[parent]
        hole = parent
        parent = (hole - 1) // 2
    values[hole], indices[hole] = value, index


@njit(cache=True)
def _heap_select(bits: np.ndarray, k: int) -> np.ndarray:
    """Indices [rows, k] that libstdc++'s ``__heap_select`` keeps in the first k slots of each row
    of bf16 bit patterns, comparing magnitudes (the bits without the sign)."""
    n_rows, n = bits.shape
    out = np.empty((n_rows, k), np.int64)
    values = np.empty(k, np.int32)
    for row in range(n_rows):
        for i in range(k):
            values[i] = bits[row, i] & 0x7FFF
            out[row, i] = i
        indices = out[row]
        if k >= 2:  # __make_heap
            parent = (k - 2) // 2
            while True:
                _adjust_heap(values, indices, parent, k, values[parent], indices[parent])
                if parent == 0:
                    break
                parent -= 1
        smallest = values[0]
        for j in range(k, n):
            magnitude = bits[row, j] & 0x7FFF
            if magnitude > smallest:  # comp(pair, top): then __pop_heap(first, middle, pair)
                _adjust_heap(values, indices, 0, k, magnitude, j)
                smallest = values[0]
    return out


def select_topk(bits: np.ndarray, k: int) -> np.ndarray:
    """Indices [B, k] of the k largest bf16 magnitudes per row of u16 patterns [B, n] (k <= n).

    The set ``torch.topk`` takes on CPU, row by row (rows are independent, so a batch gives each
    chunk the set a call of its own gives); the order within the set is unspecified (nothing
    downstream depends on it).
    """
    if HEAP_FACTOR * k <= bits.shape[-1]:
        return _heap_select(bits, k)
    as_bf16 = torch.from_numpy((bits & 0x7FFF).view(np.int16)).view(torch.bfloat16)
    return torch.topk(as_bf16, k, dim=-1, sorted=False).indices.numpy()
