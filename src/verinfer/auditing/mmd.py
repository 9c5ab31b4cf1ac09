"""Model Equality Testing's two-sample test of sampled completions (Gao et al., ICLR 2025).

The provider returns n sampled completions per prompt and the reference draws n more under the
same sampling parameters. Completions are compared by the Hamming string kernel of the paper:
token sequences padded to ``L`` (the request's ``max_tokens``), ``k(x, y) = #{i < L: x_i = y_i} / L``,
and completions of different prompts have kernel 0 (the prompt is part of what is sampled). The
statistic is the unbiased squared MMD between the provider's and the reference's completions.

With one completion per prompt from each side every within-side kernel term vanishes (completions
of different prompts have kernel 0) and a within-pair swap leaves the statistic unchanged, so the
test would return p = 1 whatever the provider sends: ``mmd_verdict`` refuses it, and
``completions_per_prompt`` plans a query budget into at least 2 prompts of at least 2 completions.

Its p-value is a permutation test (SciPy's ``permutation_test``): the provider's j-th completion
of a prompt is paired with the reference's j-th, and the null distribution swaps the two within
pairs, which is exact when both come from the same distribution. Like every audit verdict it is
looked at on doubling prefixes of prompts at ``alpha / looks`` (``verinfer.stats.verdict``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy.stats import permutation_test

from verinfer.stats.verdict import Verdict, doubling_looks, look_sizes, sequential

PAD = -1


def padded(outputs: Sequence[Sequence[int]], length: int) -> np.ndarray:
    """Token sequences as an [n, length] array, cut at ``length`` and padded with ``PAD``."""
    out = np.full((len(outputs), length), PAD, dtype=np.int64)
    for i, o in enumerate(outputs):
        o = list(o)[:length]
        out[i, : len(o)] = o
    return out


def hamming_gram(provider: np.ndarray, reference: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Kernel matrix over provider items then reference items (``groups``: prompt of each pair)."""
    items = np.concatenate([provider, reference])
    prompt = np.concatenate([groups, groups])
    gram = (items[:, None, :] == items[None, :, :]).mean(axis=-1)
    return gram * (prompt[:, None] == prompt[None, :])


def swap_form(gram: np.ndarray) -> tuple[float, np.ndarray]:
    """The unbiased MMD^2 of n provider items against their n paired reference items (``gram``: provider
    items then reference items) as a function of within-pair swaps ``s`` (+1 kept, -1 swapped):
    ``const + s @ W @ s / 2``. Swapping pair i exchanges, for every other pair j, the within-side kernel
    sum ``A_ij = k(x_i, x_j) + k(y_i, y_j)`` with the cross sum ``D_ij = k(x_i, y_j) + k(y_i, x_j)``, and
    leaves ``k(x_i, y_i)`` alone, so the permutation null costs one matrix product per swap vector."""
    n = gram.shape[0] // 2
    kxx, kyy, kxy = gram[:n, :n], gram[n:, n:], gram[:n, n:]
    off = 1 - np.eye(n)
    a, d = (kxx + kyy) * off, (kxy + kxy.T) * off
    within, cross = 1 / (n * (n - 1)), 1 / n ** 2
    const = (a + d).sum() / 2 * (within - cross) - 2 * cross * np.trace(kxy)
    return float(const), (a - d) * (within + cross)


def mmd_p_value(gram: np.ndarray, n: int, resamples: int, seed: int) -> tuple[float, float]:
    """(MMD^2, permutation p-value) of the first ``n`` provider items against their paired reference items."""
    const, w = swap_form(gram)
    x, y = np.arange(n), n + np.arange(n)

    def statistic(a, b, axis=-1):
        s = np.where(np.moveaxis(a, axis, -1) < n, 1.0, -1.0)
        return const + 0.5 * np.einsum("...i,ij,...j->...", s, w, s)

    res = permutation_test((x, y), statistic, permutation_type="samples", vectorized=True, n_resamples=resamples,
                           alternative="greater", batch=1024, rng=np.random.default_rng(seed))
    return float(res.statistic), float(res.pvalue)


def completions_per_prompt(budget: int, samples: int) -> int:
    """Completions per prompt (``n``) for a budget of ``budget`` completions: ``samples`` when the
    budget holds 2 prompts of it, else the most that does (at least 2 prompts of at least 2)."""
    if budget < 4:
        raise ValueError(f"an MMD audit needs a budget of at least 4 completions (2 prompts x 2), got {budget}")
    return max(2, min(samples, budget // 2))


def mmd_verdict(provider: Sequence[Sequence[Sequence[int]]], reference: Sequence[Sequence[Sequence[int]]],
                length: int, alpha: float = 0.01, seed: int = 0) -> Verdict:
    """Sequential MMD verdict: ``provider[i]`` and ``reference[i]`` hold prompt i's n completions each."""
    if len(provider) < 2:
        raise ValueError(f"an MMD audit needs at least 2 prompts, got {len(provider)}")
    per = [min(len(p), len(r)) for p, r in zip(provider, reference)]
    if min(per) < 2:
        i = per.index(min(per))
        raise ValueError(f"an MMD audit needs at least 2 completions per prompt from each side (prompt {i} has "
                         f"{per[i]}): with one, its within-pair permutation test cannot reject (p = 1)")
    groups = np.repeat(np.arange(len(per)), per)
    xs = padded([s for p, k in zip(provider, per) for s in list(p)[:k]], length)
    ys = padded([s for r, k in zip(reference, per) for s in list(r)[:k]], length)
    gram = hamming_gram(xs, ys, groups)
    ends = np.cumsum(per)
    looks = [k for k in look_sizes(len(per)) if ends[k - 1] >= 2] or [len(per)]
    resamples = max(999, math.ceil(20 * len(looks) / alpha))
    first_stat: dict[int, float] = {}

    def p_at(k: int) -> float:
        items = int(ends[k - 1])
        sub = np.r_[np.arange(items), gram.shape[0] // 2 + np.arange(items)]
        first_stat[k], p = mmd_p_value(gram[np.ix_(sub, sub)], items, resamples, seed + k)
        return p

    p, first = sequential(p_at, looks, alpha)
    tokens = np.array([sum(min(len(s), length) for s in list(prov)[:k]) for prov, k in zip(provider, per)])
    stat = first_stat[len(per)]
    method = (f"sequential permutation test ({doubling_looks(len(looks))} of prompts, Bonferroni, {resamples} "
              f"within-pair swaps each) of the unbiased MMD^2 with a Hamming string kernel over {length} tokens "
              f"between {int(ends[-1])} provider and as many reference completions (Model Equality Testing)")
    return Verdict(p >= alpha, p, alpha, int(tokens.sum()), int(ends[-1]), "sequence", stat, "MMD^2", stat, stat,
                   len(looks), None if first is None else int(tokens[:first].sum()), method,
                   sequences=int(ends[-1]), interval=False)
