"""Calibrator: thresholds hold their FPR, round-trip through JSON, and reject bad use."""

import json

import numpy as np
import pytest

from verinfer.stats.calibration import Calibrator, NotFittedError, conservative_quantile, min_batches, parse_rule
from verinfer.stats.evaluation import held_out_fpr
from verinfer.stats.pooling import finite_percentile

FPR = 0.01


def honest(n_tokens, seed, inf_rate=0.001):
    """Synthetic honest scores: exponential margins with rare filtered-out (+inf) tokens."""
    rng = np.random.default_rng(seed)
    margin = rng.exponential(size=n_tokens)
    margin[rng.random(n_tokens) < inf_rate] = np.inf
    exact_match = (rng.random(n_tokens) > 0.02).astype(float)
    return {"margin": margin, "exact_match": exact_match}


@pytest.fixture(scope="module")
def fitted():
    return Calibrator(batch_sizes=(10, 100), fpr=FPR).fit(honest(200_000, seed=0))


def test_conservative_quantile_is_the_conformal_order_statistic():
    stats = np.random.default_rng(0).permutation(np.arange(1.0, 101.0))
    assert conservative_quantile(stats, 0.01) == 100.0  # k = ceil(0.99 * 101) = 100
    assert conservative_quantile(np.arange(1.0, 20.0), 0.1) == 18.0  # k = ceil(0.9 * 20) = 18
    assert min_batches(0.01) == 99
    assert conservative_quantile(np.arange(99.0), 0.01) == 98.0
    with pytest.raises(ValueError, match="need 99"):
        conservative_quantile(np.arange(98.0), 0.01)


def test_percentiles_are_learned_on_finite_honest_scores(fitted):
    margin = honest(200_000, seed=0)["margin"]
    learned = fitted.percentile_values_["margin"]
    assert list(learned) == [99.0, 99.9, 99.99, 99.999]
    np.testing.assert_allclose(list(learned.values()), finite_percentile(margin, list(learned)))
    assert all(np.isfinite(v) for v in learned.values())


@pytest.mark.parametrize("batch_size", [10, 100])
@pytest.mark.parametrize("rule", ["clip:99.9", "clip:99"])
def test_fpr_holds_on_fresh_honest_data(fitted, batch_size, rule):
    fresh = honest(1_000_000, seed=1)["margin"]
    observed = held_out_fpr(fitted, fresh, batch_size, metric="margin", rule=rule)
    assert observed.n == 1_000_000 // batch_size
    assert observed.low <= FPR  # not significantly above the target
    assert observed.high >= FPR / 2  # and not uselessly conservative


@pytest.mark.parametrize(
    ("metric", "rule"), [("margin", "tail:99.99:99.999"), ("exact_match", "mismatch_rate")]
)
def test_fpr_bounded_for_discrete_statistics(fitted, metric, rule):
    fresh = honest(1_000_000, seed=2)[metric]
    assert held_out_fpr(fitted, fresh, 100, metric=metric, rule=rule).low <= FPR


def test_shifted_scores_are_flagged(fitted):
    bad = np.random.default_rng(3).exponential(scale=1.5, size=100_000)
    assert fitted.predict(bad, 100, metric="margin", rule="clip:99.9").mean() > 0.9


def test_infinite_test_scores_are_clipped_not_propagated(fitted):
    scores = np.full(100, np.inf)
    stats = fitted.score(scores, 10, metric="margin", rule="clip:99.9")
    np.testing.assert_allclose(stats, fitted.percentile_values_["margin"][99.9])
    assert fitted.predict(scores, 10, metric="margin", rule="clip:99.9").all()


def test_json_round_trip(fitted):
    text = json.dumps(fitted.to_dict(), allow_nan=False)
    data = json.loads(text)
    assert (data["format"], data["version"], data["fpr"]) == ("verinfer.calibrator", 1, FPR)
    assert data["metrics"]["margin"]["n_tokens"] == 200_000
    assert data["batch_sizes"] == [10, 100]
    assert data["percentiles"] == [99.0, 99.9, 99.99, 99.999]
    restored = Calibrator.from_dict(data)
    assert restored.to_dict() == fitted.to_dict()
    fresh = honest(10_000, seed=4)
    for metric, rule in [("margin", "tail:99.99:99.999"), ("exact_match", "mismatch_rate")]:
        np.testing.assert_array_equal(
            restored.score(fresh[metric], 10, metric=metric, rule=rule),
            fitted.score(fresh[metric], 10, metric=metric, rule=rule),
        )


def test_from_dict_rejects_other_versions(fitted):
    data = fitted.to_dict() | {"version": 99}
    with pytest.raises(ValueError, match="version"):
        Calibrator.from_dict(data)


def test_unfitted_calibrator_is_refused():
    cal = Calibrator()
    with pytest.raises(NotFittedError, match="not fitted"):
        cal.score(np.ones(10), 10, metric="margin", rule="clip:99.9")
    with pytest.raises(ValueError, match="not fitted"):  # NotFittedError is a ValueError
        cal.to_dict()


def test_unfitted_batch_size_metric_or_rule_is_refused(fitted):
    message = r"batch size 50 was not calibrated \(fitted: \[10, 100\]\)"
    with pytest.raises(ValueError, match=message):
        fitted.predict(np.ones(100), 50, metric="margin", rule="clip:99.9")
    with pytest.raises(ValueError, match="metric 'logprob' was not calibrated"):
        fitted.score(np.ones(100), 10, metric="logprob", rule="clip:99.9")
    with pytest.raises(ValueError, match="rule 'clip:99.9' not fitted for 'exact_match'"):
        fitted.score(np.ones(100), 10, metric="exact_match", rule="clip:99.9")


def test_too_few_honest_tokens_names_the_fix():
    with pytest.raises(ValueError, match=r"batch size 1000 needs at least 99000 .*resample"):
        Calibrator(batch_sizes=(10, 1000)).fit({"margin": np.ones(50_000)})


def test_resampled_windows_when_tokens_are_scarce():
    cal = Calibrator(batch_sizes=(1000,), resample=500, random_state=0)
    cal.fit({"margin": np.random.default_rng(5).exponential(size=20_000)})
    data = cal.to_dict()
    assert data["batches"] == "windows_with_replacement"
    assert data["thresholds"][0]["n_batches"] == 500
    assert 1.0 < cal.threshold("margin", "clip:99.9", 1000) < 1.2  # mean 1, sd ~0.03 at n=1000


@pytest.mark.parametrize(
    ("honest_scores", "message"),
    [
        ({}, "honest_scores is empty"),
        ({"margin": []}, r"honest_scores\['margin'\] is empty"),
        ({"margin": [1.0, np.nan] * 10_000}, r"honest_scores\['margin'\] contains 10000 NaN"),
        ({"exact_match": [0.0, 0.5] * 10_000}, "only 0 and 1"),
    ],
)
def test_bad_honest_scores_are_rejected(honest_scores, message):
    with pytest.raises(ValueError, match=message):
        Calibrator(batch_sizes=(10,)).fit(honest_scores)


def test_nan_scores_at_predict_time_are_rejected(fitted):
    with pytest.raises(ValueError, match="NaN"):
        fitted.predict(np.array([1.0, np.nan] * 10), 10, metric="margin", rule="clip:99.9")


@pytest.mark.parametrize(
    "rule", ["mean", "clip", "clip:abc", "clip:100", "tail:99.999:99.9", "mismatch_rate"]
)
def test_bad_rules_are_rejected(rule):
    with pytest.raises(ValueError, match="rule"):
        Calibrator(rules=[rule])


def test_parse_rule():
    assert parse_rule("tail:99.99:99.999") == ("tail", (99.99, 99.999))
    assert parse_rule("clip:99.9") == ("clip", (99.9,))


@pytest.mark.parametrize(
    "kwargs",
    [{"fpr": 0.0}, {"fpr": 1.5}, {"batch_sizes": ()}, {"batch_sizes": (0,)}, {"resample": 10}],
)
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(ValueError):
        Calibrator(**kwargs)
