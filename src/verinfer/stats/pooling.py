"""Per-token score transforms and the pooled batch statistics built from them.

Scores are oriented so that higher means more divergent from the reference. ``+inf`` is a valid
score (Token-DiFR sets it when the claimed token was filtered out by top-k / top-p); NaN and
``-inf`` are not, because no divergence metric produces them and silently pooling them would
corrupt a verdict.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


MARGIN_CLIP = 20.0  # raw-logit units: the paper's bounded margin min(margin, 20), the one clip constant


def as_scores(scores: ArrayLike, name: str = "scores") -> np.ndarray:
    """Return ``scores`` as a non-empty 1-D float64 array, rejecting NaN and ``-inf``.

    Every public function in ``verinfer.stats`` funnels its input through here so that bad input
    fails loudly with the argument's name instead of yielding a NaN threshold or verdict.
    """
    arr = np.asarray(scores, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of per-token scores, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty; at least one score is needed")
    if np.isnan(arr).any():
        raise ValueError(f"{name} contains {int(np.isnan(arr).sum())} NaN value(s); fix the scorer")
    if np.isneginf(arr).any():
        raise ValueError(f"{name} contains -inf; only +inf (a filtered-out token) is allowed")
    return arr


def clip_scores(scores: ArrayLike, upper: float) -> np.ndarray:
    """Winsorize from above: values over ``upper`` (including ``+inf``) become ``upper``.

    The paper (sec. 5.2) clips filtered-out tokens' infinite scores to the same percentile
    threshold as the finite ones, so one rare outlier cannot dominate a batch mean.
    """
    if not np.isfinite(upper):
        raise ValueError(f"clip upper bound must be finite, got {upper}")
    return np.minimum(as_scores(scores), upper)


def tail_scores(scores: ArrayLike, clip_hi: float, zero_below: float) -> np.ndarray:
    """Clip at ``clip_hi`` then set values strictly below ``zero_below`` to zero (paper app. E).

    Zeroing the bulk suppresses benign noise so the batch mean concentrates on rare, large
    deviations such as a 1%-of-tokens sampling bug.
    """
    if zero_below > clip_hi:
        raise ValueError(f"zero_below ({zero_below}) must not exceed clip_hi ({clip_hi})")
    clipped = clip_scores(scores, clip_hi)
    return np.where(clipped < zero_below, 0.0, clipped)


def finite_percentile(scores: ArrayLike, q: float | ArrayLike) -> np.ndarray | float:
    """Percentile(s) ``q`` (0-100) of the finite scores only.

    Infinite scores mark filtered-out tokens, not large margins; including them would push the
    high percentiles to ``inf`` and make the clip threshold useless (paper sec. 5.2).
    """
    arr = as_scores(scores)
    finite = arr[np.isfinite(arr)]
    if finite.size == 0:
        raise ValueError("all scores are infinite; a percentile needs at least one finite score")
    result = np.percentile(finite, q)
    return float(result) if np.ndim(result) == 0 else result


def pool_mean(scores: ArrayLike) -> float:
    """Plain mean; ``inf`` if any token is ``inf`` (use a clipped pool for such metrics)."""
    return float(as_scores(scores).mean())


def pool_clipped_mean(scores: ArrayLike, clip: float) -> float:
    """Mean of scores winsorized at ``clip``: the paper's default Token-DiFR batch statistic."""
    return float(clip_scores(scores, clip).mean())


def pool_tail(scores: ArrayLike, clip_hi: float, zero_below: float) -> float:
    """Mean of :func:`tail_scores`: the tail-focused pooling for rare bugs (paper app. E)."""
    return float(tail_scores(scores, clip_hi, zero_below).mean())


def as_exact_match(exact_match: ArrayLike, name: str = "exact_match") -> np.ndarray:
    """Return 0/1 exact-match flags as float64, rejecting anything that is not 0 or 1."""
    arr = as_scores(exact_match, name)
    if not np.isin(arr, (0.0, 1.0)).all():
        raise ValueError(f"{name} must contain only 0 and 1 (1 = claimed token reproduced)")
    return arr


def pool_exact_mismatch_rate(exact_match: ArrayLike) -> float:
    """Fraction of tokens the verifier did not reproduce, ``1 - mean(exact_match)``."""
    return float(1.0 - as_exact_match(exact_match).mean())


def _check_batch_size(n: int, available: int) -> None:
    if int(n) != n or n < 1:
        raise ValueError(f"batch size must be a positive integer, got {n!r}")
    if available < n:
        raise ValueError(f"batch size {n} exceeds the {available} tokens available")


def batch_means(scores: ArrayLike, n: int) -> np.ndarray:
    """Means of consecutive, non-overlapping batches of ``n`` tokens; the remainder is dropped.

    ``scores`` is the per-token array of many sequences concatenated in order, so a batch holds
    whole runs of neighbouring tokens and keeps their within-sequence correlation, which the
    threshold has to account for. Deterministic: same input, same batches.
    """
    arr = as_scores(scores)
    _check_batch_size(n, arr.size)
    n = int(n)
    return arr[: (arr.size // n) * n].reshape(-1, n).mean(axis=1)


def sampled_batch_means(
    scores: ArrayLike, n: int, n_batches: int, rng: np.random.Generator | int | None = None
) -> np.ndarray:
    """Means of ``n_batches`` windows of ``n`` consecutive tokens drawn WITH replacement.

    For bootstrapping when there are too few tokens for enough disjoint batches. Windows start at
    uniformly random offsets and may overlap, so the batch means are dependent: more of them
    smooths a quantile estimate but adds no information beyond the tokens themselves.
    """
    arr = as_scores(scores)
    _check_batch_size(n, arr.size)
    if n_batches < 1:
        raise ValueError(f"n_batches must be >= 1, got {n_batches}")
    n = int(n)
    starts = np.random.default_rng(rng).integers(0, arr.size - n + 1, size=int(n_batches))
    infinite = np.isinf(arr)  # summed separately: a cumulative sum would give inf - inf = NaN
    csum = np.concatenate(([0.0], np.cumsum(np.where(infinite, 0.0, arr))))
    n_inf = np.concatenate(([0], np.cumsum(infinite)))
    means = (csum[starts + n] - csum[starts]) / n
    return np.where(n_inf[starts + n] > n_inf[starts], np.inf, means)


def sequence_stats(columns: dict[str, np.ndarray], clip: float = MARGIN_CLIP) -> np.ndarray:
    """Per-sequence rows ``[tokens, sum of clipped margins, exact matches]`` in order of appearance
    (the unit the pooled verdict resamples: tokens of one sequence are correlated)."""
    ids = np.asarray(columns["trace_id"], dtype=object)
    clipped = clip_scores(np.asarray(columns["margin"], dtype=np.float64), clip)
    em = np.asarray(columns["exact_match"], dtype=bool)
    order, inverse = np.unique(ids, return_index=True, return_inverse=True)[1:]
    first = np.argsort(order)  # keep the order sequences appeared in
    n = np.bincount(inverse, minlength=order.size)
    s = np.bincount(inverse, weights=clipped, minlength=order.size)
    e = np.bincount(inverse, weights=em, minlength=order.size)
    return np.stack([n, s, e], axis=1)[first].astype(np.float64)
