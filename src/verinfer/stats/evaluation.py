"""Detection quality of batch statistics: AUC at a low FPR, intervals, held-out checks, splits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from verinfer.stats.calibration import Calibrator
from verinfer.stats.pooling import as_scores


class Interval(NamedTuple):
    """A point estimate with a two-sided confidence interval."""

    estimate: float
    low: float
    high: float


class Proportion(NamedTuple):
    """``k`` of ``n`` with its Wilson interval, e.g. flagged honest batches."""

    k: int
    n: int
    estimate: float
    low: float
    high: float


def auc_at_fpr(honest_stats: ArrayLike, bad_stats: ArrayLike, max_fpr: float = 0.01) -> float:
    """Standardized partial ROC AUC over FPR in [0, max_fpr], bad batches as the positive class.

    This is scikit-learn's ``roc_auc_score(..., max_fpr=max_fpr)``, McClish-standardized so that
    chance is 0.5 and perfect separation is 1.0 at any ``max_fpr`` (the paper's "AUC at 1% FPR").
    Values below 0.5 mean the bad batches look *less* divergent than honest ones; the paper
    reports such features as 0.5. ``+inf`` statistics are replaced by a value above every finite
    one, which keeps the ranking that the AUC depends on; identical inputs give exactly 0.5.
    """
    honest = as_scores(honest_stats, "honest_stats")
    bad = as_scores(bad_stats, "bad_stats")
    if not 0.0 < max_fpr <= 1.0:
        raise ValueError(f"max_fpr must lie in (0, 1], got {max_fpr}")
    values = np.concatenate([honest, bad])
    finite = values[np.isfinite(values)]
    ceiling = finite.max() + 1.0 if finite.size else 0.0
    labels = np.concatenate([np.zeros(honest.size), np.ones(bad.size)])
    ranked = np.where(np.isinf(values), ceiling, values)
    from sklearn.metrics import roc_auc_score  # here: scikit-learn costs every command's start-up a second

    return float(roc_auc_score(labels, ranked, max_fpr=max_fpr))


def bootstrap_ci(
    fn: Callable[..., float],
    *arrays: ArrayLike,
    n_boot: int = 1000,
    alpha: float = 0.05,
    rng: np.random.Generator | int | None = None,
    method: str = "percentile",
) -> Interval:
    """Bootstrap interval of ``fn(*arrays)``, each array resampled independently (scipy.stats).

    Independent resampling fits two-sample statistics such as :func:`auc_at_fpr`, whose honest and
    bad batches are separate samples. The percentile method is the default because BCa breaks
    down on statistics that saturate (an AUC of 1.0 in every resample).
    """
    if not arrays:
        raise ValueError("bootstrap_ci needs at least one data array")
    data = tuple(as_scores(a, f"arrays[{i}]") for i, a in enumerate(arrays))
    result = stats.bootstrap(
        data,
        fn,
        n_resamples=n_boot,
        confidence_level=1.0 - alpha,
        method=method,
        vectorized=False,
        rng=np.random.default_rng(rng),
    )
    ci = result.confidence_interval
    return Interval(float(fn(*data)), float(ci.low), float(ci.high))


def wilson_interval(k: int, n: int, alpha: float = 0.05) -> Proportion:
    """Wilson score interval for ``k`` successes in ``n`` trials; sane at k = 0 and k = n."""
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    test = stats.binomtest(int(k), int(n))
    ci = test.proportion_ci(confidence_level=1.0 - alpha, method="wilson")
    return Proportion(int(k), int(n), k / n, float(ci.low), float(ci.high))


def tokens_needed(
    batch_sizes: Sequence[int], aucs: Sequence[float], target: float = 0.99
) -> int | None:
    """Smallest batch size whose AUC reaches ``target``; None if none does."""
    sizes = np.asarray(batch_sizes)
    values = np.asarray(aucs, dtype=np.float64)
    if sizes.shape != values.shape or sizes.ndim != 1 or sizes.size == 0:
        raise ValueError(
            f"batch_sizes and aucs must be equal-length, non-empty 1-D sequences, "
            f"got shapes {sizes.shape} and {values.shape}"
        )
    if np.isnan(values).any():
        raise ValueError("aucs contains NaN")
    reached = sizes[values >= target]
    return int(reached.min()) if reached.size else None


def held_out_fpr(
    calibrator: Calibrator,
    honest_test_scores: ArrayLike,
    batch_size: int,
    *,
    metric: str,
    rule: str,
    alpha: float = 0.05,
) -> Proportion:
    """Share of held-out honest batches the calibrator flags, with its Wilson interval.

    The test scores must come from sequences not used in ``fit`` (see
    :func:`train_test_split_by_sequence`); the interval should cover the calibrated ``fpr``.
    """
    flags = calibrator.predict(honest_test_scores, batch_size, metric=metric, rule=rule)
    return wilson_interval(int(flags.sum()), flags.size, alpha)


def train_test_split_by_sequence(
    sequence_ids: ArrayLike,
    test_fraction: float = 0.5,
    rng: np.random.Generator | int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Boolean (train, test) token masks that put every sequence wholly on one side.

    Tokens of one sequence are correlated, so a token-level split would leak: test batches would
    share sequences with the batches the threshold was fitted on and the held-out FPR would look
    better than it is. Masks keep token order, so consecutive batching still follows sequences.
    """
    ids = np.asarray(sequence_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"sequence_ids must be a non-empty 1-D array, got shape {ids.shape}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
    unique = np.unique(ids)
    if unique.size < 2:
        raise ValueError("need at least two distinct sequences to split by sequence")
    n_test = min(max(round(test_fraction * unique.size), 1), unique.size - 1)
    test_ids = np.random.default_rng(rng).permutation(unique)[:n_test]
    test = np.isin(ids, test_ids)
    return ~test, test
