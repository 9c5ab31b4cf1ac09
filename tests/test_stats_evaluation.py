"""AUC at a low FPR, intervals, tokens needed, and the by-sequence split."""

import numpy as np
import pytest
from scipy.stats import norm
from sklearn.metrics import roc_auc_score

from verinfer.stats.calibration import Calibrator
from verinfer.stats.evaluation import (
    auc_at_fpr,
    bootstrap_ci,
    held_out_fpr,
    tokens_needed,
    train_test_split_by_sequence,
    wilson_interval,
)
from verinfer.stats.pooling import batch_means


@pytest.mark.parametrize("max_fpr", [0.01, 0.1, 1.0])
def test_auc_at_fpr_matches_sklearn(max_fpr):
    rng = np.random.default_rng(0)
    honest, bad = rng.normal(size=3000), rng.normal(0.5, 1.0, size=2000)
    labels = np.r_[np.zeros(3000), np.ones(2000)]
    expected = roc_auc_score(labels, np.r_[honest, bad], max_fpr=max_fpr)
    assert auc_at_fpr(honest, bad, max_fpr) == pytest.approx(expected, abs=1e-12)


def test_shifted_batches_are_detected_and_identical_ones_are_not():
    rng = np.random.default_rng(1)
    honest = batch_means(rng.exponential(size=400_000), 400)
    same = batch_means(rng.exponential(size=400_000), 400)
    shifted = batch_means(rng.exponential(scale=1.3, size=400_000), 400)
    assert auc_at_fpr(honest, shifted) > 0.99
    assert auc_at_fpr(honest, same) == pytest.approx(0.5, abs=0.02)


def test_constant_inputs_give_chance():
    assert auc_at_fpr(np.ones(5), np.ones(7)) == 0.5


def test_inf_ranks_above_everything_finite():
    honest, bad = np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.35, 5.0, np.inf])
    assert auc_at_fpr(honest, bad, 1.0) == auc_at_fpr(honest, [0.35, 5.0, 6.0], 1.0)
    assert auc_at_fpr(np.full(3, np.inf), np.full(3, np.inf)) == 0.5


@pytest.mark.parametrize(
    ("honest", "bad", "max_fpr", "message"),
    [
        ([], [1.0], 0.01, "honest_stats is empty"),
        ([1.0], [np.nan], 0.01, "bad_stats contains 1 NaN"),
        ([1.0], [2.0], 0.0, "max_fpr"),
    ],
)
def test_auc_at_fpr_bad_input(honest, bad, max_fpr, message):
    with pytest.raises(ValueError, match=message):
        auc_at_fpr(honest, bad, max_fpr)


def test_bootstrap_ci_covers_the_mean_and_is_reproducible():
    data = np.random.default_rng(2).normal(10.0, 2.0, size=400)
    ci = bootstrap_ci(np.mean, data, n_boot=2000, rng=3)
    assert ci.estimate == pytest.approx(data.mean())
    assert ci.low < 10.0 < ci.high
    # the percentile interval of a mean is close to the normal one, +-1.96 sd / sqrt(n)
    assert ci.high - ci.low == pytest.approx(2 * 1.96 * 2.0 / 20.0, rel=0.15)
    assert bootstrap_ci(np.mean, data, n_boot=2000, rng=3) == ci


def test_bootstrap_ci_of_a_two_sample_auc():
    rng = np.random.default_rng(4)
    honest, bad = rng.normal(size=500), rng.normal(1.0, 1.0, size=500)
    ci = bootstrap_ci(lambda h, b: auc_at_fpr(h, b, 1.0), honest, bad, n_boot=200, rng=5)
    assert ci.low <= ci.estimate <= ci.high
    assert ci.low < norm.cdf(1 / np.sqrt(2)) < ci.high  # true AUC of N(1,1) vs N(0,1)


def test_bootstrap_ci_needs_data():
    with pytest.raises(ValueError, match="at least one data array"):
        bootstrap_ci(np.mean)


def test_wilson_interval_matches_closed_form():
    k, n, z = 7, 200, norm.ppf(0.975)
    center = (k + z**2 / 2) / (n + z**2)
    half = z / (n + z**2) * np.sqrt(k * (n - k) / n + z**2 / 4)
    result = wilson_interval(k, n)
    assert (result.k, result.n, result.estimate) == (7, 200, 0.035)
    assert (result.low, result.high) == pytest.approx((center - half, center + half), rel=1e-9)
    assert wilson_interval(0, 50).low == 0.0
    assert wilson_interval(50, 50).high == pytest.approx(1.0)


@pytest.mark.parametrize(("k", "n"), [(1, 0), (-1, 10), (11, 10)])
def test_wilson_interval_bad_counts(k, n):
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson_interval(k, n)


def test_tokens_needed():
    assert tokens_needed([1, 10, 100, 1000], [0.5, 0.9, 0.995, 1.0]) == 100
    assert tokens_needed([1000, 10, 100], [1.0, 0.9, 0.99]) == 100  # order does not matter
    assert tokens_needed([1, 10], [0.5, 0.9]) is None
    with pytest.raises(ValueError, match="equal-length"):
        tokens_needed([1, 10], [0.5])
    with pytest.raises(ValueError, match="NaN"):
        tokens_needed([1, 10], [0.5, np.nan])


def test_split_by_sequence_keeps_sequences_whole():
    rng = np.random.default_rng(6)
    ids = np.repeat(np.arange(200), rng.integers(1, 50, size=200))
    train, test = train_test_split_by_sequence(ids, 0.25, rng=7)
    assert (train ^ test).all()
    assert not set(ids[train]) & set(ids[test])
    assert len(set(ids[test])) == 50
    again = train_test_split_by_sequence(ids, 0.25, rng=7)
    np.testing.assert_array_equal(again[1], test)


@pytest.mark.parametrize(
    ("ids", "fraction", "message"),
    [
        ([3, 3, 3], 0.5, "two distinct sequences"),
        ([], 0.5, "non-empty"),
        ([1, 2], 1.0, "test_fraction"),
    ],
)
def test_split_by_sequence_bad_input(ids, fraction, message):
    with pytest.raises(ValueError, match=message):
        train_test_split_by_sequence(ids, fraction)


def test_held_out_fpr_on_a_sequence_split():
    rng = np.random.default_rng(8)
    ids = np.repeat(np.arange(100_000), 20)
    # each sequence has its own offset, so tokens within a sequence are correlated
    scores = rng.exponential(size=ids.size) + rng.normal(0.0, 0.5, size=100_000)[ids].clip(0)
    train, test = train_test_split_by_sequence(ids, 0.5, rng=9)
    cal = Calibrator(batch_sizes=(100,)).fit({"margin": scores[train]})
    observed = held_out_fpr(cal, scores[test], 100, metric="margin", rule="clip:99.9")
    assert observed.n == test.sum() // 100
    assert observed.low <= 0.01  # not significantly above the target
    assert observed.high >= 0.005  # and not uselessly conservative
