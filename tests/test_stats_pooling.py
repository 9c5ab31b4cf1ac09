"""Pooling math on small hand-computed arrays."""

import numpy as np
import pytest

from verinfer.stats.pooling import (
    as_scores,
    batch_means,
    clip_scores,
    finite_percentile,
    pool_clipped_mean,
    pool_exact_mismatch_rate,
    pool_mean,
    pool_tail,
    sampled_batch_means,
    tail_scores,
)

INF = np.inf


def test_clip_scores_replaces_inf_and_clips_above():
    np.testing.assert_array_equal(clip_scores([1.0, 5.0, INF, 3.0], 3.0), [1.0, 3.0, 3.0, 3.0])


def test_clip_scores_rejects_infinite_bound():
    with pytest.raises(ValueError, match="finite"):
        clip_scores([1.0], INF)


def test_finite_percentile_ignores_inf():
    assert finite_percentile([1.0, 2.0, 3.0, INF, INF], 50) == 2.0
    np.testing.assert_allclose(finite_percentile([0.0, 10.0, INF], [0, 50, 100]), [0.0, 5.0, 10.0])


def test_finite_percentile_all_inf_is_an_error():
    with pytest.raises(ValueError, match="all scores are infinite"):
        finite_percentile([INF, INF], 99)


def test_pool_mean_and_clipped_mean():
    assert pool_mean([1.0, 2.0, 3.0]) == 2.0
    assert pool_mean([1.0, INF]) == INF
    assert pool_clipped_mean([1.0, 2.0, INF, 10.0], 4.0) == pytest.approx((1 + 2 + 4 + 4) / 4)


def test_tail_pooling_zeros_below_and_clips_above():
    scores = [0.5, 2.0, 3.0, 7.0, INF]
    np.testing.assert_array_equal(tail_scores(scores, clip_hi=5.0, zero_below=2.5), [0, 0, 3, 5, 5])
    assert pool_tail(scores, clip_hi=5.0, zero_below=2.5) == pytest.approx(13 / 5)
    # a value equal to zero_below is kept: only values strictly below are zeroed
    assert pool_tail(scores, clip_hi=5.0, zero_below=3.0) == pytest.approx(13 / 5)


def test_tail_pooling_rejects_inverted_bounds():
    with pytest.raises(ValueError, match="zero_below"):
        pool_tail([1.0], clip_hi=1.0, zero_below=2.0)


def test_exact_mismatch_rate():
    assert pool_exact_mismatch_rate([1, 1, 0, 1]) == 0.25
    assert pool_exact_mismatch_rate(np.array([True, True])) == 0.0
    with pytest.raises(ValueError, match="only 0 and 1"):
        pool_exact_mismatch_rate([1, 2])


def test_batch_means_consecutive_and_drops_remainder():
    np.testing.assert_allclose(batch_means(np.arange(10.0), 3), [1.0, 4.0, 7.0])
    np.testing.assert_allclose(batch_means(np.arange(4.0), 4), [1.5])


def test_batch_means_inf_stays_in_its_batch():
    np.testing.assert_array_equal(batch_means([1.0, 3.0, INF, 0.0], 2), [2.0, INF])


@pytest.mark.parametrize("n", [0, -1, 2.5, 11])
def test_batch_means_bad_batch_size(n):
    with pytest.raises(ValueError, match="batch size"):
        batch_means(np.arange(10.0), n)


def test_sampled_batch_means_match_brute_force_windows():
    scores = np.array([1.0, 4.0, INF, 2.0, 0.0, 5.0, 3.0])
    n, n_batches = 3, 50
    starts = np.random.default_rng(7).integers(0, scores.size - n + 1, size=n_batches)
    expected = [scores[s : s + n].mean() for s in starts]
    np.testing.assert_allclose(sampled_batch_means(scores, n, n_batches, rng=7), expected)


def test_sampled_batch_means_is_with_replacement():
    # only 2 distinct windows exist, yet 40 batches are drawn
    out = sampled_batch_means([1.0, 2.0, 3.0, 4.0], 3, 40, rng=0)
    assert out.size == 40
    assert set(out) == {2.0, 3.0}


@pytest.mark.parametrize(
    ("bad", "message"),
    [([], "empty"), ([1.0, np.nan], "NaN"), ([1.0, -INF], "-inf"), ([[1.0], [2.0]], "1-D")],
)
def test_bad_scores_are_rejected_with_clear_message(bad, message):
    with pytest.raises(ValueError, match=message):
        as_scores(bad)
    with pytest.raises(ValueError, match=message):
        pool_mean(bad)
