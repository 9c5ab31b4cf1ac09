"""Rank-uniformity test of sampled outputs (RUT: Zhu et al., ICLR 2026).

For each completion y the provider returns (every one of the ``n`` of each prompt), the reference
draws m completions of its own under the same sampling parameters, and every m + 1 of them is
scored by a fixed function of the completion: ``rank_score``, the reference's log-probability
minus its expectation position by position (``CompletionScores.centred``, issue #29; RUT ranks
by the raw log-probability, which mixes the signal with the entropy each path happens to cross). If the provider samples from the reference's
distribution, y and the m draws are exchangeable, so y's rank among them is uniform on 0..m; with
ties broken at random, ``u = (#{below} + U * (#{tied} + 1)) / (m + 1)`` with U uniform on (0, 1) is
exactly uniform on (0, 1), whatever the model, prompt or length. A provider that samples from
another distribution (4-bit weights, another temperature, a hidden system prompt) shifts the ranks,
and SciPy's Cramér-von Mises test of uniformity over prompts detects it in either direction.

The verdict follows the one verdict rule (``verinfer.stats.verdict``): the test is looked at on
doubling prefixes of prompts (from 2 on: a single rank says nothing about uniformity), each look
at ``alpha / looks``; providers of one audit are Holm-adjusted together. No calibration is needed
for the exact null "same sampling distribution as the reference"; an honest provider whose
numerics differ (bf16) is a different distribution too, which enough prompts will show
(``experiments/seedless_audit.py`` measures how often).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy.stats import cramervonmises

from verinfer.stats.verdict import Verdict, doubling_looks, look_sizes, sequential


def rank_score(scores) -> np.ndarray:
    """The score completions are ranked by: centred log-probability (``verinfer.auditing.draws``).
    Chosen by measured power over the raw log-probability (RESULTS.md section 21)."""
    return scores.centred


def split(values: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """``values`` cut into consecutive pieces of ``sizes`` (each completion's reference draws)."""
    return np.split(np.asarray(values), np.cumsum(sizes)[:-1])


def rank_p_values(observed: np.ndarray, reference: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """Randomized rank quantile of each ``observed[i]`` among ``reference[i]`` (uniform under the null)."""
    out = np.empty(len(observed))
    for i, (y, ref) in enumerate(zip(observed, reference)):
        ref = np.asarray(ref, dtype=np.float64)
        below, tied = np.count_nonzero(ref < y), np.count_nonzero(ref == y)
        out[i] = (below + rng.uniform() * (tied + 1)) / (ref.size + 1)
    return out


def rank_looks(n: int) -> list[int]:
    """Doubling prefixes of completions from 2 on (the Cramér-von Mises test needs two values)."""
    return [k for k in look_sizes(n) if k >= 2] or [n]


def uniformity_p(u: np.ndarray) -> float:
    """SciPy's Cramér-von Mises test of ``u`` against the uniform distribution on (0, 1)."""
    return float(cramervonmises(np.asarray(u, dtype=np.float64), "uniform").pvalue)


def rank_verdict(u: np.ndarray, tokens: np.ndarray, m: int, alpha: float = 0.01) -> Verdict:
    """Sequential Cramér-von Mises verdict on per-prompt rank quantiles ``u`` (``tokens``: the
    provider's output tokens per prompt, for *tokens needed*)."""
    u, tokens = np.asarray(u, dtype=np.float64), np.asarray(tokens)
    if u.size < 2:
        raise ValueError(f"a rank audit needs at least 2 prompts, got {u.size}")
    looks = rank_looks(u.size)
    p, first = sequential(lambda k: uniformity_p(u[:k]), looks, alpha)
    mean, half = float(u.mean()), 1.96 * float(u.std(ddof=1)) / np.sqrt(u.size)
    method = (f"sequential Cramér-von Mises test of uniformity ({doubling_looks(len(looks))} of prompts, "
              f"Bonferroni) of each provider completion's randomized rank among {m} reference samples of its own by the "
              "reference's centred log-probability (RUT)")
    return Verdict(p >= alpha, p, alpha, int(tokens.sum()), int(u.size), "sequence", mean, "mean rank quantile",
                   mean - half, mean + half, len(looks), None if first is None else int(tokens[:first].sum()),
                   method, sequences=int(u.size))
