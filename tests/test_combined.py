"""Activation commits end to end, and why they must be combined with Token-DiFR (issue #5)."""

import dataclasses

import numpy as np
import pytest
import torch

from verinfer.simulate.generate import generate
from verinfer.simulate.generate import build_requests
from verinfer.scoring.traces import score_traces
from verinfer.sampling.params import SamplingParams
from verinfer.commits.activation_difr import FingerprintSpec
from verinfer.commits.trace_commits import CommitSpec, build_commits, commit_rows

SAMPLED = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=300)
SPEC = CommitSpec(fingerprint=FingerprintSpec(dim=8, hidden_size=576), toploc_k=128)


@pytest.fixture(scope="module")
def requests_(backend, chat_prompts):
    return build_requests(backend, chat_prompts[:6], SAMPLED)


def verify(backend, traces):
    scored = score_traces(backend, traces)
    return scored.columns, scored.commit_checks


def test_commits_built_during_generation_pass_validation(backend, requests_):
    traces = generate(backend, requests_, 32, batch_size=6, commits=SPEC)
    assert all(set(t.fingerprints) == {"activation-difr", "toploc"} for t in traces)
    cols, checks = verify(backend, traces)
    assert len(checks) == len(traces) and not any(c.error for c in checks)
    assert all(c.toploc_passed.all() for c in checks)  # decode vs prefill noise passes TOPLOC
    l2 = np.concatenate([c.fingerprint_l2 for c in checks])
    assert l2.size == cols["margin"].size and l2.max() < 1e-2
    assert cols["exact_match"].mean() >= 0.98


def test_cheap_sampler_with_honest_fingerprints_is_caught_only_by_the_combination(backend, requests_):
    """A provider samples from a 4-bit model, then prefills the honest model over those tokens to
    compute fingerprints and proofs. The commits pass; Token-DiFR on the same prefill does not."""
    from verinfer.simulate.variants import get_variant

    cheap = get_variant("w4-g128").build(backend)
    sampled = generate(cheap, requests_, 32, batch_size=6)
    forged = []
    for t in sampled:
        h, _ = backend.hidden(torch.tensor([t.prompt_token_ids + t.output_token_ids]), None)
        rows = commit_rows(h[0].float(), len(t.prompt_token_ids), len(t.output_token_ids))
        forged.append(dataclasses.replace(t, model=backend.model_id,
                                          fingerprints=build_commits(rows, len(t.prompt_token_ids), SPEC,
                                                                     backend.model_id)))
    honest = generate(backend, requests_, 32, batch_size=6, commits=SPEC)
    cols_h, _ = verify(backend, honest)
    cols_f, checks = verify(backend, forged)
    # the commits alone accept the forgery
    assert all(c.toploc_passed.all() for c in checks)
    assert max(c.fingerprint_l2.max() for c in checks) < 1e-2
    # Token-DiFR on the same prefill rejects it
    assert cols_f["exact_match"].mean() <= cols_h["exact_match"].mean() - 0.05
    assert np.minimum(cols_f["margin"], 20).mean() > 10 * max(np.minimum(cols_h["margin"], 20).mean(), 1e-3)


def test_calibrated_fingerprint_verdicts(backend, chat_prompts):
    """Fingerprint distances calibrated on honest traces judge new honest traces consistent and a
    4-bit provider divergent (batches of 4 fingerprints, 1% target FPR)."""
    from verinfer.simulate.variants import get_variant
    from verinfer.scoring.scores import commit_scores
    from verinfer.stats.summary import fit_calibrator
    from verinfer.stats.verdict import COMMIT_RULE, calibrated_verdict

    spec = CommitSpec(fingerprint=FingerprintSpec(dim=8, hidden_size=576))
    cal_requests = build_requests(backend, chat_prompts, SAMPLED.with_(seed=900))
    cal = generate(backend, cal_requests, 48, batch_size=12, commits=spec)
    cols, checks = verify(backend, cal)
    calibrator = fit_calibrator(cols, (4,), 0.01, {"fingerprint_l2": commit_scores(checks)["fingerprint_l2"]})
    test_requests = build_requests(backend, chat_prompts[:6], SAMPLED.with_(seed=1900))
    honest = generate(backend, test_requests, 32, batch_size=6, commits=spec)
    _, honest_checks = verify(backend, honest)
    w4 = get_variant("w4-g128").generate(backend, test_requests, 32, 6, commits=spec)
    _, bad_checks = verify(backend, w4)
    def judge(checks):
        return calibrated_verdict(commit_scores(checks)["fingerprint_l2"], calibrator, 4, "fingerprint_l2", COMMIT_RULE)

    assert judge(honest_checks).consistent
    assert not judge(bad_checks).consistent
