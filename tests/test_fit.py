"""Fitting a sampler family's parameter (``verinfer.scoring.fit``, issue #41 item 1): the search, the
fitted value and its profile-likelihood interval, on log-likelihood curves whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest

from verinfer.sampling.params import SamplingParams
from verinfer.scoring.diagnosis import Candidate, candidate_grid
from verinfer.scoring.fit import (
    DROP, FAMILIES, POINTS, bracket, family_of, fit_family, interval, model_coarse, model_refined, near_set,
)
from verinfer.simulate.variants import get_variant

CLAIM = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=1)
FAMILY = {f.axis: f for f in FAMILIES}


def test_interval_is_the_run_within_the_drop_around_the_middle_of_the_tied_best():
    values = [1, 2, 3, 4, 5, 6, 7, 8]
    ll = [-9.0, -2.0, -1.5, 0.0, 0.0, 0.0, -1.0, -5.0]
    best, first, last = interval(values, ll)
    assert (values[best], values[first], values[last]) == (5, 3, 7)  # 2 is 2 below: outside a 1.92 drop
    assert DROP == pytest.approx(1.920729, abs=1e-6)
    # a value within the drop but cut off by a worse one is not in the interval
    assert interval([1, 2, 3, 4], [-1.0, -5.0, 0.0, -1.0])[1:] == (2, 3)
    # among values tied in likelihood (mismatches at zero margin), the most exact tokens decide
    assert interval(values, ll, [0, 0, 0, 9, 7, 7, 0, 0])[0] == 3


@pytest.mark.parametrize("axis, truth, curvature", [("temperature", 0.873, 400.0), ("top_k", 37, 0.05),
                                                    ("repetition", 1.17, 300.0), ("min_p", 0.07, 2000.0)])
def test_search_finds_a_value_between_the_grid_points_and_its_interval(axis, truth, curvature):
    """A smooth log-likelihood peaked at ``truth``: the fit lands on the resolution's nearest value, and the
    interval is where the curve is within the drop, to the grid's step, from a search that read far fewer
    values than the range holds."""
    family = FAMILY[axis]
    calls = []

    def loglik(values, final):
        calls.append((len(values), final))
        assert len(values) <= POINTS + 1 and all(family.low <= v <= family.high for v in values)
        return [(-curvature * (v - truth) ** 2, 0) for v in values]

    grid = [family.value_of(c) for c in candidate_grid(CLAIM) if family.value_of(c) is not None]
    start = min(grid, key=lambda v: curvature * (v - truth) ** 2)
    fit = fit_family(family, start, bracket(family, CLAIM, grid, start), loglik)
    assert abs(fit.value - truth) <= family.step / 2 + 1e-9
    half = np.sqrt(DROP / curvature)
    assert fit.interval[0] == pytest.approx(truth - half, abs=family.step)
    assert fit.interval[1] == pytest.approx(truth + half, abs=family.step)
    assert calls[-1][1] and fit.screened == sum(n for n, _ in calls) < (family.high - family.low) / family.step


def test_an_interval_at_the_last_levels_edge_is_followed_past_it():
    """A flat run wider than the last level: the interval is extended until it closes."""
    family = FAMILY["top_k"]
    fit = fit_family(family, 40, (30, 50), lambda values, final: [(0.0 if 20 <= v <= 60 else -10.0, 0) for v in values])
    assert fit.interval == (20, 60) and fit.value == 40


def test_brackets_and_families():
    t = FAMILY["temperature"]
    assert bracket(t, CLAIM, [0.8, 0.9, 1.1], 0.9) == (0.8, 1.0)  # the claim's own value is a neighbour
    assert bracket(t, CLAIM, [0.8, 0.9, 1.1], 1.1) == (1.0, t.high)  # past the grid's end: the family's range
    assert bracket(FAMILY["top_k"], CLAIM, [-1, 5, 10], 5) == (1, 10)  # "off" is no neighbour
    grid = candidate_grid(CLAIM)
    fitted = {family_of(c).axis for c in grid if family_of(c) is not None}
    assert fitted == {"temperature", "top_k", "top_p", "min_p", "repetition", "presence", "frequency"}
    c = FAMILY["presence"].candidate(0.35, (0.3, 0.4))
    assert c.penalty == ("presence", 0.35) and c.named == "presence penalty 0.35 (fitted; 95% interval 0.3-0.4)"
    assert FAMILY["top_k"].candidate(37.0).changes == (("top_k", 37),)


def test_the_model_search_holds_every_weight_scheme_then_refines_depth():
    coarse = model_coarse(30)
    weights = [m for m in coarse if m.startswith("w")]
    assert len(weights) == 48 and {"w4-g64-asym", "w3-channel", "w8-g128"} <= set(weights)
    assert [m for m in coarse if m.startswith("layers-")] == ["layers-15", "layers-22", "layers-26", "layers-28",
                                                             "layers-29"]
    assert [m for m in coarse if m.startswith("skip-layer-")] == [f"skip-layer-{i}" for i in range(30)]
    assert [m for m in coarse if m.startswith("fp8-kv")] == ["fp8-kv", "fp8-kv-tensor", "fp8-kv-head", "fp8-kv-fresh"]
    for name in coarse:
        get_variant(name)  # every member is a catalogue family's name
    assert model_refined("layers-26", coarse, 30) == [f"layers-{n}" for n in range(22, 29)]
    assert model_refined("layers-15", coarse, 30) == [f"layers-{n}" for n in range(1, 23)]
    assert model_refined("w4-g64", coarse, 30) == []
    best, near = near_set(["a", "b", "c"], [-3.0, -1.0, -2.5], [5, 9, 7])
    assert best == "b" and near == ("b", "c")
    assert near_set(["a", "b"], [0.0, 0.0], [5, 9])[0] == "b"  # tied likelihood: the most exact tokens
    c = Candidate("model w4-g64", "model", band="w4-g64", near=("w4-g64", "w4-g32"))
    assert c.named == "model w4-g64 (searched; 95% set also holds w4-g32)"


def test_a_continuous_interval_covers_the_values_between_the_last_in_and_the_first_out():
    """Values 0.85-0.88 within the drop, 0.84 and 0.89 not: the true ends lie between, so the interval
    stated is 0.84-0.89 (an integer's is exact: no value lies between)."""
    t = FAMILY["temperature"]
    fit = fit_family(t, 0.9, (0.8, 0.95), lambda values, final: [(0.0 if 0.845 < v < 0.885 else -5.0, 0) for v in values])
    assert fit.value in (0.86, 0.87) and fit.interval == (0.84, 0.89)
    k = fit_family(FAMILY["top_k"], 40, (30, 50), lambda values, final: [(0.0 if 35 <= v <= 38 else -5.0, 0) for v in values])
    assert k.interval == (35, 38)
