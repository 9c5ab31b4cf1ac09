"""The deviation's class when no candidate names it (issue #41 item 2): read from the claim's replay."""

from __future__ import annotations

import numpy as np

from verinfer.scoring.diagnosis import CLAIM, Diagnosis, Judged, Ranked
from verinfer.scoring.shape import Shape, classify

FLOOR = float(np.log(1e-4))


def counts(n=1000, mismatches=100, within=90, shallower=50, beyond=0) -> Shape:
    s = Shape()
    exact = np.ones(n, bool)
    exact[:mismatches] = False
    loglik = np.zeros(n)
    loglik[within:mismatches] = FLOOR
    shift = np.zeros(n)
    shift[:shallower], shift[shallower:mismatches] = 0.3, -0.3
    filtered = np.zeros(n, bool)
    filtered[shallower:shallower + beyond] = True
    s.add(exact, loglik, shift, filtered, FLOOR)
    return s


def test_the_counts_are_what_the_replay_shows():
    s = counts(mismatches=100, within=90, shallower=40, beyond=7)
    assert (s.tokens, s.mismatches, s.within_noise, s.shallower, s.deeper, s.beyond) == (1000, 100, 90, 40, 60, 7)


def test_small_margins_are_numerics_and_large_ones_weights():
    assert classify(counts(within=90)).kind == "numerics"
    weights = classify(counts(within=20))
    assert weights.kind == "weights" and "80% of them with margins no precision noise explains" in weights.text
    assert ("or another prompt (on an engine whose noise is keyed by position, one of the claimed length), which "
            "these margins do not tell apart") in weights.text  # what it cannot separate
    assert classify(counts(mismatches=0, within=0, shallower=0)).kind is None


def test_the_verdicts_side_detectors_make_it_sampler_shaped_at_the_verdicts_level():
    sides = {"narrower": {"on_side": 23, "mismatches": 23, "honest_share": 0.45, "p": 1e-4},
             "wider": {"on_side": 0, "mismatches": 23, "honest_share": 0.6, "p": 1.0}}
    off = {"narrower": 0.015, "wider": 0.01}  # honest mismatches per token off each detector's side
    shaped = classify(counts(within=40), sides, detectors=4, honest_off=off, judged=1000)
    assert shaped.kind == "sampler" and "23 of 23 mismatches are shallower" in shaped.text and "p 0.0004" in shaped.text
    assert classify(counts(within=40), sides, detectors=200, honest_off=off, judged=1000).kind == "weights"  # corrected
    assert classify(counts(within=40), sides, detectors=4).kind == "weights"  # no honest side counts to hold it to
    # other weights: mismatches beyond the filters more often than honest noise, and many on the other side too
    w4 = {"beyond": {"on_side": 147, "mismatches": 377, "honest_share": 0.2, "p": 1e-9}}
    assert classify(counts(within=20), w4, detectors=4, honest_off={"beyond": 0.02}, judged=759).kind == "weights"
    assert classify(counts(), context="prompts 7 tokens longer than claimed").kind == "context"


def _line(candidate, loglik, p, unexplained):
    return Ranked(candidate, 1000, 0.9, 0.1, unexplained, loglik, 0.0, 0.0, p)


def test_no_candidate_explains_it_is_never_the_whole_answer():
    d = Diagnosis([_line(CLAIM, -10, 1.0, 0.08)], _line(CLAIM, -10, 1.0, 0.08), shape=counts(within=15))
    assert d.text.startswith("no candidate explains it") and "; the deviation is weights-shaped: 100 mismatches" in d.text
    assert d.to_dict()["deviation_class"]["kind"] == "weights"
    flagged = Judged(False, 1e-5, 1000, "pooled.json", "margin")
    led = Diagnosis([_line(CLAIM, -10, 1.0, 0.0)], _line(CLAIM, -10, 1.0, 0.0), verdict=flagged, shape=counts(within=95))
    assert led.text.startswith("a deviation none of the candidates is") and "numerics-shaped" in led.text
    quiet = Diagnosis([_line(CLAIM, -10, 1.0, 0.0)], _line(CLAIM, -10, 1.0, 0.0), shape=counts())
    assert quiet.text.startswith("the claim explains it") and "shaped" not in quiet.text  # nothing to class
