"""One story (issue #41 item 3): ``diagnose`` given the traces and calibration ``verify`` judges says what
the verdict says, and explains it: the calibrated verdict decides whether the traces deviate, the
likelihood what explains them, "the calibration lacks bf16's noise" included."""

from __future__ import annotations

import json

import pytest

from tests.cli_app import invoke
from tests.test_calibration_coverage import score_file
from verinfer import api
from verinfer.scoring.diagnosis import CLAIM, Candidate, Diagnosis, Judged, Ranked


def line(candidate: Candidate, loglik: float, p: float, unexplained: float = 0.0, exact: float = 0.98) -> Ranked:
    return Ranked(candidate, 1000, exact, 0.01, unexplained, loglik, 0.0, 0.0, p)


CLAIMED, BF16, TOPK = CLAIM, Candidate("model bf16", "model", band="bf16"), Candidate("top-k 40", "top_k", (("top_k", 40),))


def diagnosis(ranked: list[Ranked], verdict: Judged | None) -> Diagnosis:
    return Diagnosis(ranked, next(r for r in ranked if r.candidate == CLAIM), verdict=verdict)


def test_an_inconsistent_verdict_whose_claim_fits_best_names_the_precision_the_calibration_lacks():
    flagged = Judged(False, 1e-6, 1000, "fp32.json", "margin", ("bf16",))
    d = diagnosis([line(CLAIMED, -10, 1.0), line(BF16, -10.5, 1.0), line(TOPK, -30, 1.0)], flagged)
    assert d.deviates and not d.claim_rejected
    assert d.text.startswith("the calibration lacks this precision's noise (bf16): the claim with bf16 explains it")
    assert "verify: INCONSISTENT, p 1e-06" in d.text
    unrecorded = Judged(False, 1e-6, 1000, "old.json", "margin", ("bf16",), recorded=False)
    assert "does not record that it holds this precision's noise (bf16)" in diagnosis(d.ranked, unrecorded).text


def test_an_inconsistent_verdict_no_candidate_beats_says_so_and_never_that_the_claim_explains_it():
    covered = Judged(False, 0.003, 1000, "pooled.json", "narrower")
    d = diagnosis([line(CLAIMED, -10, 1.0), line(TOPK, -10.2, 0.4)], covered)
    assert d.deviates and d.text.startswith("a deviation none of the candidates is: verify: INCONSISTENT")
    assert "by narrower" in d.text and "the claim explains it" not in d.text
    # the sampler deviation: the right candidate first, not significant alone, the verdict flags it
    led = diagnosis([line(TOPK, -9, 0.25), line(CLAIMED, -10, 1.0)], covered)
    assert led.deviates and led.text.startswith("flagged: verify: INCONSISTENT") and "likeliest cause is top-k 40" in led.text


def test_a_consistent_verdict_keeps_a_likelier_candidate_as_a_lead_not_a_verdict():
    quiet = Judged(True, 0.4, 1000, "pooled.json")
    d = diagnosis([line(TOPK, -5, 0.001), line(CLAIMED, -10, 1.0)], quiet)
    assert d.claim_rejected and not d.deviates
    assert d.text.startswith("not flagged: verify: CONSISTENT") and "top-k 40 fits the tokens better" in d.text
    agreeing = diagnosis([line(CLAIMED, -10, 1.0), line(TOPK, -12, 1.0)], quiet)
    assert not agreeing.deviates and agreeing.text.startswith("the claim explains it") and "verify: CONSISTENT" in agreeing.text
    assert diagnosis(d.ranked, None).deviates  # without a verdict, the likelihood decides as before


@pytest.fixture(scope="module")
def bf16_traces(tmp_path_factory):
    """Honest bf16 traces at settings with a shipped calibration that holds bf16 noise (vLLM sampler,
    T 1, top-k 50, top-p 0.95), and a calibration fitted on fp32 alone (an exact fp32 provider)."""
    d = tmp_path_factory.mktemp("story")
    traces = d / "bf16.jsonl"
    api.generate("chitchat", n=16, dtype="bfloat16", max_tokens=48, seed=300, out=traces)
    fp32_only = d / "fp32-only.json"
    api.calibrate(score_file(d / "fp32.scores.parquet", 4000, 1, 0.0), batch_sizes=(10,), precisions=["fp32"],
                  out=fp32_only)
    return traces, fp32_only


def test_diagnose_and_verify_agree_on_honest_bf16_traffic_under_either_calibration(bf16_traces, tmp_path):
    traces, fp32_only = bf16_traces
    backend = api.load_model()
    said = {}
    for calibration in (fp32_only, None):  # None: the shipped pooled fp32 + bf16 calibration, as verify picks it
        verdict = api.verify(traces, backend=backend, calibration=calibration, scores=tmp_path / "s.parquet",
                             commit_scores_out=tmp_path / "c.parquet").summary
        said[calibration] = d = api.diagnose(traces, backend=backend, variants="bf16", calibration=calibration,
                                             out=tmp_path / "d.json" if calibration else None)
        assert d.verdict is not None and d.verdict.consistent == verdict.consistent, d.text
        assert d.deviates == (not verdict.consistent), d.text
    # the fp32-only null flags honest bf16 traffic; diagnose says why instead of "the claim explains it"
    d = said[fp32_only]
    assert d.deviates and d.verdict.uncovered == ("bf16",), d.text
    assert d.text.startswith(("the calibration lacks this precision's noise (bf16)", "best explained by model bf16")), d.text
    assert said[None].verdict.uncovered == () and "(shipped default)" in said[None].verdict.calibration
    saved = json.loads((tmp_path / "d.json").read_text())
    assert saved["deviates"] and saved["verdict"]["calibration"] == str(fp32_only) and saved["conclusion"] == d.text


def test_the_cli_prints_the_verdict_beside_the_diagnosis_and_exits_on_the_verdict(bf16_traces):
    traces, fp32_only = bf16_traces
    flagged = invoke("diagnose", traces, "--variants", "bf16", "--calibration", fp32_only)
    assert flagged.returncode == 1 and "verify: INCONSISTENT" in flagged.stdout, flagged.stdout + flagged.stderr
    assert "bf16" in flagged.stdout.split("verify: INCONSISTENT")[0], flagged.stdout  # the explanation comes first
