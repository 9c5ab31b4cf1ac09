"""llama.cpp's sampler chain with the seeded ``dist`` sampler, as llama-cpp-python 0.3.36 builds it.

Facts read in the llama-cpp-python 0.3.36 sdist (``llama_cpp/llama.py``, ``Llama._init_sampler``,
``generate``, ``_create_completion``) and its vendored llama.cpp (``vendor/llama.cpp/src/
llama-sampler.cpp``):

- Chain (temperature > 0, no mirostat): penalties -> top_k -> typical -> top_p -> min_p ->
  **temp** -> dist(seed). Temperature comes after the filters, so top-p / min-p see the untempered
  distribution; temperature 0 is ``greedy``. llama-cpp-python's defaults are top_k 40, top_p 0.95,
  min_p 0.05, temp 0.8: pass explicit values.
- Candidates start in token-id order. ``top_k`` (k > 0) partially sorts descending by logit and
  truncates to exactly k (no ties kept); ``top_p`` (p < 1) softmaxes the current candidates
  (fp32), sorts descending and keeps up to and including the first whose fp32 running sum is
  ``>= p``; ``min_p`` keeps ``logit >= max + logf(p)`` preserving the order; ``temp`` divides logits
  in place. So the candidates are sorted descending when top-k or top-p is on, else in id order.
  The sorts are ``std::sort`` / ``std::partial_sort`` (ties in any order; here ties go by id).
- ``dist`` (``llama_sampler_dist_apply``): ``p_i = expf(logit_i - max)`` in fp32, summed in double in
  candidate order; one ``std::uniform_real_distribution<double>(0, 1)`` draw ``u`` from a
  ``std::mt19937`` seeded with the seed; the token is the first candidate whose running double sum
  is ``>= u * sum`` (inverse CDF). A single candidate still draws ``u``.
- The seed is uint32; ``0xFFFFFFFF`` (``LLAMA_DEFAULT_SEED``) means a random seed. ``generate``
  builds a fresh sampler (fresh mt19937) per call, and ``create_completion(seed=s)`` seeds it with
  s; without a seed it picks ``random.Random(previous seed).randint(0, 2**32)``.
- libstdc++'s ``generate_canonical<double, 53>`` takes two 32-bit outputs per draw:
  ``u = (o0 + o1 * 2**32) / 2**64``. So output token k uses outputs 2k and 2k+1.

Replayed by ``sampling/inverse_cdf.py`` (not Gumbel); scores: ``ipt_distance`` (and ``margin``, set
to it). Limits: T = 1 only with top-p or min-p (llama.cpp tempers after them); typical-p,
penalties, mirostat and grammars are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from verinfer.sampling.params import MIN_TEMPERATURE
from verinfer.sampling.mt19937 import canonical_doubles, mt19937_outputs
from verinfer.sampling.profiles.base import Profile

RANDOM_SEED = 0xFFFFFFFF


@dataclass
class LlamaCppProfile(Profile):
    name = "llama.cpp"
    aliases = ("llama-cpp",)
    description = "llama.cpp dist sampler (llama-cpp-python 0.3.36): inverse CDF, one mt19937 uniform per token"
    inverse_cdf = True
    _draws: dict = field(default_factory=dict)  # seed -> uniforms drawn so far

    def uniforms(self, keys) -> np.ndarray:
        """``u`` for each row: draw ``steps[i]`` of ``std::mt19937(seed)`` (two outputs per draw)."""
        out = np.empty(len(keys.requests))
        for i, (seed, step) in enumerate(zip(keys.seeds, np.asarray(keys.steps).tolist())):
            seed = int(seed)
            have = self._draws.get(seed)
            if have is None or have.size <= step:
                n = max(64, 2 * (step + 1))
                have = canonical_doubles(mt19937_outputs(seed, 2 * n))
                self._draws[seed] = have
            out[i] = have[step]
        return out

    def sorts_candidates(self, params) -> bool:
        """Whether the chain sorts the candidates (top-k or top-p set) or leaves them in id order."""
        return params.top_k > 0 or params.top_p < 1

    def candidate_order(self, x: torch.Tensor, ids: torch.Tensor, params) -> torch.Tensor:
        """Positions of the kept candidates in the order llama.cpp accumulates them."""
        if self.sorts_candidates(params):
            return torch.sort(-x, stable=True).indices  # descending, ties by id (ids ascending)
        return torch.arange(ids.numel(), device=ids.device)

    def gumbel(self, keys, rows, cols, vocab_size):
        raise NotImplementedError("llama.cpp samples by inverse CDF; replay it with sampling.inverse_cdf")

    def problems(self, params):
        out = []
        if params.fp64_gumbel:
            out.append("fp64_gumbel is a vLLM option; profile 'llama.cpp' has no fp64 mode")
        if params.stream:
            out.append(f"stream: profile 'llama.cpp' takes no stream fields, got {sorted(params.stream)}")
        if params.seed is not None and not 0 <= params.seed < RANDOM_SEED:
            out.append(f"seed: llama.cpp seeds are uint32 below 0xFFFFFFFF (that one is random), got {params.seed}")
        if 0 < params.temperature < MIN_TEMPERATURE and not params.is_greedy:
            out.append(f"temperature {params.temperature} < {MIN_TEMPERATURE}: llama.cpp does not clamp it")
        if not params.is_greedy and params.temperature != 1.0 and (params.top_p < 1 or params.min_p > 0):
            out.append("temperature != 1 with top_p/min_p: llama.cpp applies temperature after them")
        return out

    def forget(self, request: str) -> None:
        """Draws are cached by seed and stay valid; nothing per request."""
