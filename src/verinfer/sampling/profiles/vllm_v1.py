"""vLLM's V1 model runner sampler: an exponential race on a per-request ``torch.Generator``.

Follows ``vllm/v1/sample/sampler.py`` and ``ops/topk_topp_sampler.py`` (``random_sample``) of the
V1 engine (vLLM 0.8 to 0.2x; REFERENCE.md 1.3): one generator per seeded request, seeded when the
request is added; step k draws a full-vocabulary fp32 ``q.exponential_()`` (``q[i]``, one row of
V = logits width entries) and samples ``argmax(p / q)``, which is ``argmax(x + G)`` with
``G = -log q`` (REFERENCE.md 1.1). Formerly named ``torch-exponential`` (kept as an alias).

Two profiles, one per generator device:

- ``vllm-v1``: the generator's CPU stream (MT19937), as vLLM V1 on a CPU device draws it. PyTorch's
  CPU ``exponential_`` (``aten/src/ATen/native/cpu/DistributionTemplates.h`` ``exponential_kernel``,
  serial; ``core/DistributionsHelper.h`` ``exponential_distribution``; ``core/TransformationHelper.h``
  ``exponential``) takes one ``random64()`` per entry, ``u = (w & (2**53 - 1)) * 2**-53`` in fp64
  and ``q = float(-log1p(-u))``. An fp64 ``uniform_()`` takes the same ``random64()`` per entry and
  keeps the same 53 bits, so the profile draws those uniforms (no logarithm per entry; the generator
  is ``sampling/mt19937.py``, tested equal to torch's)
  and computes ``q`` only where needed: since ``q >= u``, ``G = -log q <= -log u``, and a token can
  reach the best score found so far (``floor``) only if ``u <= exp(x - floor)`` (tested equal to
  ``exponential_`` bit for bit, and to noising every token).
- ``vllm-v1-cuda``: the stream of a ``torch.Generator(device="cuda")``, computed here on the CPU, so V1
  traces from GPUs replay on any machine. From PyTorch's source (``aten/src/ATen/native/cuda/
  DistributionTemplates.h``: ``calc_execution_policy``, ``distribution_elementwise_grid_stride_kernel``,
  ``uniform_and_transform`` with ``curand_uniform4``; ``aten/src/ATen/core/TransformationHelper.h``
  ``exponential``; ``CUDAGeneratorImpl::philox_cuda_state``) and cuRAND's Philox4x32-10 state
  (``curand_init(seed, subsequence, offset)``, ``skipahead``, ``curand4``, ``_curand_uniform4``):
  with T threads (256 per block, ``ceil(V / 256)`` blocks capped at the GPU's
  ``multiProcessorCount * maxThreadsPerMultiProcessor / 256``), each draw advances the generator's
  Philox offset by ``c = 4 * ceil(V / (4 T))``, so step k starts at offset ``k c``; entry j comes
  from thread ``t = j mod T``, lane ``(j // T) mod 4`` of its ``(j // 4T)``-th ``curand4`` call, i.e.
  lane of ``Philox4x32-10(counter = (k c / 4 + j // 4T as 64 bits, t as 64 bits), key = seed as two
  32-bit words)``; ``u = float(x) * 2**-32 + 2**-33`` in fp32 (in (0, 1]), ``log u`` in fp32, replaced
  by ``-2**-24`` when ``u >= 1 - 2**-24``, and ``q = -log u``. On large GPUs (V below the thread cap:
  an H100 holds 270,336 threads, an A100 221,184) every entry is lane 0 of its own thread;
  ``sampling.stream.cuda_threads`` (``multi_processor_count * max_threads_per_multi_processor`` of
  ``torch.cuda.get_device_properties``) says when the cap binds.
  **Not verified against a GPU**: no GPU was available to record golden draws. The Philox core is
  the one checked bit for bit against Triton's kernel and against Random123's published
  known-answer vectors (``tests/test_sampling.py``); the counter layout and fp32 conversions follow
  the sources above; CUDA's ``logf`` may differ from numpy's fp32 ``log`` in the last bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit

from verinfer.sampling.mt19937 import Mt19937
from verinfer.sampling.philox import MASK32, SHIFT32, int64_words, philox4
from verinfer.sampling.profiles.base import Profile, RowKeys, dense_on_cpu, reaching

STREAM_KEYS = ("cuda_threads",)
BLOCK = 256  # block_size_bound in DistributionTemplates.h
INV_2_32 = np.float32(2.0 ** -32)  # CURAND_2POW32_INV
NEAR_ONE = np.float32(1.0) - np.float32(2.0 ** -24)  # 1 - eps/2 for fp32
_0, _4 = np.uint64(0), np.uint64(4)
_CHUNK_UNIFORMS = 1 << 22  # fp64 uniforms drawn per call at most (32 MiB)
MAX_GUMBEL = 16.7  # -log(2**-24) = 16.636...: the largest G the CUDA stream can give


def cuda_threads_used(vocab_size: int, cuda_threads: int | None = None) -> int:
    """Threads T of one ``exponential_`` launch over ``vocab_size`` entries (``calc_execution_policy``):
    ``ceil(V / 256)`` blocks of 256, capped at the GPU's resident blocks (None: not capped)."""
    blocks = -(-vocab_size // BLOCK)
    if cuda_threads is not None:
        blocks = min(blocks, int(cuda_threads) // BLOCK)
    return blocks * BLOCK


@njit(cache=True, inline="always")
def _cuda_uniform(k0, k1, step, col, threads, per_draw):
    """fp32 ``u`` of entry ``col`` of draw ``step`` (module docstring; uint64 arguments)."""
    counter = step * per_draw + col // (_4 * threads)
    w = philox4(counter & MASK32, counter >> SHIFT32, col % threads, _0, k0, k1)[(col // threads) % _4]
    return np.float32(w) * INV_2_32 + INV_2_32 / np.float32(2)


@njit(cache=True)
def _cuda_uniforms(k0, k1, steps, cols, threads, per_draw):
    out = np.empty(cols.size, dtype=np.float32)
    for i in range(cols.size):
        out[i] = _cuda_uniform(k0, k1, steps[i], cols[i], threads, per_draw)
    return out


@njit(cache=True)
def _cuda_row(k0, k1, step, threads, per_draw, vocab_size):
    """``u`` of every entry of draw ``step``, walked in the stream's own order (curand4 call j, lane, thread)
    so each inner loop is branch-free with a fixed counter and lane, which the compiler vectorizes."""
    out = np.empty(vocab_size, dtype=np.float32)
    for j in range(per_draw):
        counter = step * np.uint64(per_draw) + np.uint64(j)
        lo, hi = counter & MASK32, counter >> SHIFT32
        for lane in range(4):
            base = (4 * j + lane) * threads
            for t in range(min(threads, max(vocab_size - base, 0))):
                w = philox4(lo, hi, np.uint64(t), _0, k0, k1)[lane]
                out[base + t] = np.float32(w) * INV_2_32 + INV_2_32 / np.float32(2)
    return out


def _stream(seed: int, vocab_size: int, cuda_threads: int | None):
    """The key words, thread count and ``c / 4`` (curand4 calls per thread and draw) of a generator."""
    threads = cuda_threads_used(vocab_size, cuda_threads)
    k0, k1 = int64_words([seed])
    return np.uint64(k0[0]), np.uint64(k1[0]), np.uint64(threads), np.uint64(-(-vocab_size // (4 * threads)))


def exponential_of(u: np.ndarray) -> np.ndarray:
    """fp32 ``q = -log u`` as the CUDA ``exponential`` transform takes it (``-2**-24`` for ``log u`` near 1)."""
    log = np.where(u >= NEAR_ONE, np.float32(-(2.0 ** -24)), np.log(u, dtype=np.float32))
    return (-log).astype(np.float32)


def gumbel_of(q: np.ndarray) -> torch.Tensor:
    """fp64 ``G = -log q`` of fp32 exponentials."""
    return -torch.log(torch.from_numpy(q).double())


def cuda_exponential(seed: int, steps: np.ndarray, cols: np.ndarray, vocab_size: int,
                     cuda_threads: int | None = None) -> np.ndarray:
    """fp32 ``q`` of entries ``cols`` in the ``steps``-th draws of a CUDA generator seeded with ``seed``
    (module docstring): counter-based, so only the asked entries are computed."""
    steps, cols = np.broadcast_arrays(np.asarray(steps, dtype=np.uint64), np.asarray(cols, dtype=np.uint64))
    k0, k1, threads, per_draw = _stream(seed, vocab_size, cuda_threads)
    u = _cuda_uniforms(k0, k1, steps.ravel(), cols.ravel(), threads, per_draw)
    return exponential_of(u).reshape(cols.shape)


def uniform_draws(gen: Mt19937, n_steps: int, vocab_size: int, batch: int = 1,
                  wants: Sequence[tuple[int, int, int]] = ((0, -1, 0),)) -> tuple[list[np.ndarray], np.ndarray | None]:
    """The next ``n_steps`` draws of ``gen``, each ``[batch, vocab_size]`` fp64 uniforms as ``exponential_``
    would transform them, drawn once in bounded chunks and handed out: for each ``(first, end, row)`` of
    ``wants`` (steps relative to the first draw; ``end`` -1: all), that row of draws ``first..end-1``
    ([end - first, vocab_size] each; rows of steps before the first draw are left for the caller to
    fill). Also the last draw whole ([batch, vocab_size]; None when nothing was drawn)."""
    wants = [(a, n_steps if b < 0 else b, r) for a, b, r in wants]
    per = max(1, _CHUNK_UNIFORMS // (batch * vocab_size))
    if 0 < n_steps <= per:  # one chunk: views of it, no copies (the usual case)
        chunk = gen.uniforms(n_steps * batch * vocab_size).reshape(n_steps, batch, vocab_size)
        return [chunk[a:b, r] if a >= 0 else np.concatenate([np.empty((-a, vocab_size)), chunk[:b, r]])
                for a, b, r in wants], chunk[-1]
    out = [np.empty((b - a, vocab_size)) for a, b, _ in wants]
    chunk = None
    for at in range(0, n_steps, per):
        m = min(per, n_steps - at)
        chunk = gen.uniforms(m * batch * vocab_size).reshape(m, batch, vocab_size)
        for (a, b, row), block in zip(wants, out):
            lo, hi = max(a, at), min(b, at + m)
            if lo < hi:
                block[lo - a:hi - a] = chunk[lo - at:hi - at, row]
    return out, None if chunk is None else chunk[-1]


def gumbel_from_uniforms(u: torch.Tensor) -> torch.Tensor:
    """fp64 ``G = -log q`` with ``q = float(-log1p(-u))``, ``exponential_``'s value (module docstring);
    numpy's ``log1p`` is the C library's, as ATen's scalar kernel uses."""
    q = (-np.log1p(-u.numpy())).astype(np.float32)
    return -torch.log(torch.from_numpy(q).double())


@dataclass
class _Place:
    """A generator's place in one stream (seed, batch, V): shared by the requests drawn from it together."""

    stream: tuple
    gen: Mt19937
    next_step: int = 0
    last: np.ndarray | None = None  # the last draw whole, [batch, V]


def _clusters(wants: dict) -> list[dict]:
    """``wants`` (request: (first, end, row)) split where their step ranges neither overlap nor touch:
    requests of one stream at distant steps (a server's requests joined at different times) are drawn
    from places of their own, so neither restarts the other's."""
    out: list[dict] = []
    end = None
    for request, (a, b, row) in sorted(wants.items(), key=lambda kv: kv[1][0]):
        if end is None or a > end:
            out.append({})
        out[-1][request] = (a, b, row)
        end = b if end is None or a > end else max(end, b)
    return out


@dataclass
class VllmV1Profile(Profile):
    """Requests drawn together share a place in their stream (generator and next step), and each keeps
    its last block of uniforms, so consecutive steps (in generation, or in chunked verification)
    continue the stream; asking for a step before a place's last draw restarts it from the seed.
    Callers ``forget`` finished requests.
    """

    name = "vllm-v1"
    aliases = ("torch-exponential",)
    description = "vLLM V1 exponential race with a per-request torch.Generator (CPU stream)"
    _drawn: dict = field(default_factory=dict)  # request -> (first step, end step, [end - first, V] uniforms)
    _places: dict = field(default_factory=dict)  # request -> its _Place (its stream among them)

    def _layout(self, params, vocab_size: int) -> tuple[int, int]:
        """(batch, row): each step draws ``[batch, V]`` and the request reads row ``row`` (vLLM V1 draws
        each request's own ``[V]``)."""
        return 1, 0

    def _stream(self, params, seed, vocab_size: int) -> tuple[tuple, int]:
        """The stream a request reads, (seed, batch, V), and its row in each draw."""
        batch, row = self._layout(params, vocab_size)
        return (seed, batch, vocab_size), row

    def _draw(self, stream: tuple, wants: dict) -> None:
        """Draw the uniforms of every ``request: (first, end, row)`` in ``wants`` from the one stream they
        share: the draws are a function of (seed, batch, V) alone, so the requests of one seeded batch
        (and requests given the same seed) at the same steps are drawn once, not once each. A place
        continues from its last draw, which it keeps whole for the rows of that step still to come (a
        chunk of the sampler's rows may end inside a step, ``replay_order``); an earlier step starts a
        place from the seed."""
        for group in _clusters(wants):
            lo, hi = min(a for a, _, _ in group.values()), max(b for _, b, _ in group.values())
            places = [p for r in group if (p := self._places.get(r)) is not None and p.stream == stream]
            usable = [p for p in places if p.next_step <= lo or (p.next_step == lo + 1 and p.last is not None)]
            place = max(usable, key=lambda p: p.next_step) if usable else _Place(stream, Mt19937(stream[0]))
            start = max(lo, place.next_step)
            _, batch, vocab_size = stream
            if start > place.next_step:  # skip draws nobody asked for
                place.gen.skip((start - place.next_step) * batch * vocab_size)
            blocks, drawn = uniform_draws(place.gen, hi - start, vocab_size, batch,
                                          [(a - start, b - start, r) for a, b, r in group.values()])
            for (request, (a, b, row)), block in zip(group.items(), blocks):
                if a < start:  # step lo: the place's last draw
                    block[0] = place.last[row]
                self._drawn[request] = (a, b, torch.from_numpy(block))
                self._places[request] = place
            place.next_step, place.last = hi, place.last if drawn is None else drawn

    def replay_order(self, params, keys, idx, vocab_size):
        """Rows of one stream step by step (all its requests at step k, then k + 1), streams in order of
        first appearance: the sampler's chunks then draw each step of a shared stream once and continue
        it, where request after request would restart it from the seed for each (verification's rows
        come trace by trace)."""
        if idx.numel() < 2:
            return idx
        rows = idx.cpu().numpy()
        streams: dict = {}
        group, place = np.empty(rows.size, dtype=np.int64), np.empty(rows.size, dtype=np.int64)
        for j, r in enumerate(rows.tolist()):
            stream, place[j] = self._stream(params[r], keys.seeds[r], vocab_size)
            group[j] = streams.setdefault(stream, len(streams))
        if len(streams) == len({keys.requests[r] for r in rows.tolist()}):  # no stream shared: keep the order
            return idx
        order = np.lexsort((place, keys.steps[rows], group))
        return idx[torch.from_numpy(order).to(idx.device)]

    def _by_request(self, keys: RowKeys, rows_np: np.ndarray, vocab_size: int):
        """For each request among ``rows_np`` (rows of ``keys``): the positions in ``rows_np`` of its
        rows, its block of uniforms and each position's row in that block. The uniforms of all the rows
        in ``keys`` of every stream asked for are drawn at once, whichever subset is asked, so the calls
        of one replay share them."""
        requests = np.asarray(keys.requests, dtype=object)
        asked = dict.fromkeys(requests[rows_np].tolist())
        lookup = np.empty(len(requests), dtype=np.int64)
        rows_of: dict = {}
        wants: dict = {}  # stream -> {request: (first, end, row)}
        for request in dict.fromkeys(requests.tolist()):
            members = np.flatnonzero(requests == request)
            steps = keys.steps[members]
            lo, hi = int(steps.min()), int(steps.max()) + 1
            stream, row = self._stream(keys.params[members[0]] if keys.params else None, keys.seeds[members[0]],
                                       vocab_size)
            rows_of[request] = (members, steps)
            drawn = self._drawn.get(request)
            if drawn is None or self._places[request].stream != stream or not (drawn[0] <= lo and hi <= drawn[1]):
                wants.setdefault(stream, {})[request] = (lo, hi, row)
        for stream, group in wants.items():
            if any(r in asked for r in group):
                self._draw(stream, group)
        for request in asked:
            members, steps = rows_of[request]
            first, _, block = self._drawn[request]
            lookup[members] = steps - first
            at = np.flatnonzero(requests[rows_np] == request)
            yield torch.from_numpy(at), block, torch.from_numpy(lookup[rows_np[at]])

    def gumbel(self, keys, rows, cols, vocab_size):
        out = torch.empty(rows.shape[0], dtype=torch.float64, device="cpu")
        cols = cols.cpu()
        for at, block, local in self._by_request(keys, rows.cpu().numpy(), vocab_size):
            out[at] = gumbel_from_uniforms(block[local, cols[at]])
        return out

    @dense_on_cpu
    def noised_dense_above(self, keys, rows, x, threshold, floor, kept=None):
        """Dense rows: draw each row's uniforms, keep kept tokens whose ``u <= exp(x - floor)`` (the
        only ones that can reach the floor, module docstring) and compute ``q`` for those alone."""
        found_r, found_c, found_s = [], [], []
        for at, block, local in self._by_request(keys, rows.cpu().numpy(), x.shape[1]):
            for i, row in zip(at.tolist(), local.tolist()):
                xr, u = x[i].numpy(), block[row].numpy()
                cols = reaching(xr, u, threshold[i].item(), floor[i].item(), False)
                found_r.append(torch.full((cols.size,), i, device="cpu"))
                found_c.append(torch.from_numpy(cols))
                found_s.append(torch.from_numpy(xr[cols].astype(np.float64)) + gumbel_from_uniforms(
                    torch.from_numpy(u[cols])))
        return torch.cat(found_r), torch.cat(found_c), torch.cat(found_s)

    def forget(self, request: str) -> None:
        """Drop the request's uniforms and its place (freed with the last request that holds it)."""
        self._drawn.pop(request, None)
        self._places.pop(request, None)


@dataclass
class VllmV1CudaProfile(VllmV1Profile):
    """vLLM V1 on a GPU: the CUDA generator's Philox stream, counter-based, so each asked entry is
    computed alone (no per-request state). Unverified against a GPU (module docstring)."""

    name = "vllm-v1-cuda"
    aliases = ()
    description = "vLLM V1 exponential race with a per-request CUDA torch.Generator (Philox; unverified on a GPU)"

    @staticmethod
    def _threads(keys: RowKeys) -> list:
        return [(p.stream or {}).get("cuda_threads") for p in keys.params] if keys.params else [None] * len(
            keys.requests)

    def gumbel(self, keys, rows, cols, vocab_size):
        rows_np, cols_np = rows.cpu().numpy(), cols.cpu().numpy()
        threads = self._threads(keys)
        groups: dict = {}  # rows of one request share seed and thread count
        group = np.array([groups.setdefault((keys.seeds[r], threads[r]), len(groups))
                          for r in range(len(keys.requests))], dtype=np.int64)[rows_np]
        out = np.empty(rows_np.shape[0], dtype=np.float32)
        for (seed, t), g in groups.items():
            idx = np.flatnonzero(group == g)
            out[idx] = cuda_exponential(seed, keys.steps[rows_np[idx]], cols_np[idx], vocab_size, t)
        return gumbel_of(out)

    @dense_on_cpu
    def noised_dense_above(self, keys, rows, x, threshold, floor, kept=None):
        """Whole rows on the CPU: every entry's ``u`` in one vectorized pass (cheaper than testing which
        to hash), logarithms only where ``1 - u <= exp(x - floor)`` may hold (``base.reaching``). A token
        reaches the floor only if ``q <= exp(x - floor)``, and ``q >= 1 - u`` (``-log u >= 1 - u``; the fp32
        rounding of ``log`` is within the slack; ``u`` rounded to 1 gives ``q = 2**-24 >= 1 - u``)."""
        threads = self._threads(keys)
        out_r, out_c, out_s = [], [], []
        for i, r in enumerate(rows.tolist()):
            xr, f = x[i].numpy(), float(floor[i])
            k0, k1, t, per_draw = _stream(keys.seeds[r], x.shape[1], threads[r])
            u = _cuda_row(k0, k1, np.uint64(keys.steps[r]), int(t), int(per_draw), x.shape[1])
            cols = reaching(xr, u, threshold[i].item(), f, True)
            u = u[cols]
            out_r.append(torch.full((cols.size,), i, device="cpu"))
            out_c.append(torch.from_numpy(cols))
            out_s.append(torch.from_numpy(xr[cols].astype(np.float64)) + gumbel_of(exponential_of(u)))
        return torch.cat(out_r), torch.cat(out_c), torch.cat(out_s)

    def noise_bound(self, keys):
        """``G = -log q`` is largest at the smallest ``q``, ``2**-24`` (``u`` rounded to 1), so G <= 16.64:
        tokens that cannot reach the winner are never hashed (a counter-based stream draws per entry)."""
        return torch.full((len(keys.requests),), MAX_GUMBEL, dtype=torch.float64, device="cpu")

    def problems(self, params):
        out = super().problems(params.with_(stream=None))
        stream = params.stream or {}
        unknown = sorted(set(stream) - set(STREAM_KEYS))
        if unknown:
            out.append(f"stream: profile 'vllm-v1-cuda' takes only {', '.join(STREAM_KEYS)}, got {unknown}")
        threads = stream.get("cuda_threads")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < BLOCK):
            out.append(f"stream.cuda_threads must be an integer >= {BLOCK} (multi_processor_count x "
                       f"max_threads_per_multi_processor), got {threads!r}")
        return out
