"""vLLM's V1 model runner sampler: an exponential race on a per-request ``torch.Generator``.

Follows ``vllm/v1/sample/sampler.py`` and ``ops/topk_topp_sampler.py`` (``random_sample``) of the
V1 engine (vLLM 0.8 to 0.2x; REFERENCE.md 1.3): one generator per seeded request, seeded when the
request is added; step k draws a full-vocabulary fp32 ``q.exponential_()`` and samples
``argmax(p / q)``, which is ``argmax(x + G)`` with ``G = -log q`` (REFERENCE.md 1.1).

This profile replays the generator's **CPU** stream (MT19937), as vLLM V1 on a CPU device would
draw it. A GPU's generator is CUDA Philox, a different stream: V1 traces from a GPU do not replay
here. Formerly named ``torch-exponential`` (kept as an alias).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from verinfer.sampling.profiles.base import Profile


def exponential_draws(seed: int, n_steps: int, vocab_size: int, skip_steps: int = 0) -> torch.Tensor:
    """Draws ``skip_steps`` .. ``skip_steps + n_steps`` of a CPU generator seeded with ``seed``.

    Drawing [n, V] at once equals n sequential [V] draws (checked in the tests).
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed) % 2**64)
    if skip_steps:
        torch.empty(skip_steps, vocab_size).exponential_(generator=gen)
    return torch.empty(n_steps, vocab_size).exponential_(generator=gen)


@dataclass
class VllmV1Profile(Profile):
    """Each request keeps its generator, the next step it will draw and its last block of draws, so
    consecutive steps (in generation, or in chunked verification) continue the stream; asking for a
    step before the last block restarts the stream from the seed. Callers ``forget`` finished requests.
    """

    name = "vllm-v1"
    aliases = ("torch-exponential",)
    description = "vLLM V1 exponential race with a per-request torch.Generator (CPU stream)"
    _streams: dict = field(default_factory=dict)

    def _draws(self, request: str, seed: int, steps: np.ndarray, vocab_size: int) -> torch.Tensor:
        next_step, gen, first, drawn = self._streams.get(request, (0, None, 0, None))
        lo, hi = int(steps.min()), int(steps.max()) + 1
        if drawn is not None and first <= lo and hi <= next_step:  # the block drawn last (one replay asks twice)
            return drawn[torch.as_tensor(steps - first)]
        if gen is None or lo < next_step:
            gen = torch.Generator(device="cpu").manual_seed(int(seed) % 2**64)
            next_step = 0
        if lo > next_step:  # skip draws nobody asked for
            torch.empty(lo - next_step, vocab_size).exponential_(generator=gen)
        drawn = torch.empty(hi - lo, vocab_size).exponential_(generator=gen)
        self._streams[request] = (hi, gen, lo, drawn)
        return drawn[torch.as_tensor(steps - lo)]

    def gumbel(self, keys, rows, cols, vocab_size):
        out = torch.empty(rows.shape[0], dtype=torch.float64)
        rows_np = rows.cpu().numpy()
        cols = cols.cpu()
        for request in dict.fromkeys(keys.requests):
            members = np.flatnonzero(np.asarray(keys.requests) == request)
            q = self._draws(request, keys.seeds[members[0]], keys.steps[members], vocab_size)
            local = np.full(len(keys.requests), -1)
            local[members] = np.arange(members.size)
            sel = np.flatnonzero(np.isin(rows_np, members))
            out[sel] = -torch.log(q[local[rows_np[sel]], cols[sel]].double())
        return out

    def forget(self, request: str) -> None:
        self._streams.pop(request, None)
