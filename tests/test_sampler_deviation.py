"""Sampler-shape statistics (issue #28 item 1) and the verdict fixes (item 4).

Synthetic rows of logits with a language-model-like spread stand in for a model, so every case runs
in seconds: the provider samples with vLLM's seeded sampler (``replay``) under its *served*
parameters, from logits with Gaussian noise (the bf16 stand-in) or without; the verifier replays
the *claimed* parameters on the clean logits with the same seeds, as ``score_block`` does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import RowKeys, get_profile
from verinfer.sampling.sampler import replay
from verinfer.scoring.sampler_shape import DEPTH_CAP, depth, depth_shift
from verinfer.stats.summary import fit_calibrator
from verinfer.stats.verdict import calibrated_verdict, flag_verdict, minimum_evidence

V = 2000
CLAIM = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=1)
NOISE = 0.05  # logit noise of the honest "bf16" provider: about 3% mismatches, as honest vLLM bf16 (REFERENCE.md)


def logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = -1.1 * torch.log(torch.arange(1, V + 1, dtype=torch.float32))
    x = base[None, :] * (0.8 + torch.rand(n, 1, generator=g)) + 0.5 * torch.randn(n, V, generator=g)
    return x.gather(1, torch.argsort(torch.rand(n, V, generator=g), dim=1))


def columns(n: int, seed: int, served: SamplingParams = CLAIM, noise: float = 0.0,
            claim: SamplingParams = CLAIM) -> dict[str, np.ndarray]:
    """Score columns of ``n`` tokens sampled with ``served`` parameters, verified under ``claim``."""
    x = logits(n, seed)
    keys = RowKeys(requests=tuple(f"r{seed}-{i // 50}" for i in range(n)),
                   seeds=np.array([seed * 1000 + i // 50 for i in range(n)], dtype=object),
                   positions=np.arange(n, dtype=np.int64) % 50 + 10, steps=np.arange(n, dtype=np.int64) % 50)
    noisy = x + noise * torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1))
    claimed = replay(noisy, [served] * n, get_profile(served.profile), keys).token
    out = replay(x, [claim] * n, get_profile(claim.profile), keys, claimed=claimed)
    verifier, claimed = out.token.numpy(), claimed.numpy()
    return {"margin": out.margin.numpy(), "cross_entropy": -out.logprob.numpy(), "exact_match": verifier == claimed,
            "depth_shift": depth_shift(x, claimed, verifier, [claim] * n)}


@pytest.fixture(scope="module")
def calibrations():
    """Pooled honest null: an exact provider and a noisy ("bf16") one, 3,000 tokens each."""
    honest = [columns(3000, 1), columns(3000, 2, noise=NOISE)]
    pooled = {k: np.concatenate([c[k] for c in honest]) for k in honest[0]}
    return fit_calibrator(pooled, (10, 50)), fit_calibrator(pooled, (10, 50), shape=False)


def test_depth_places_tokens_in_the_claimed_kept_set():
    x = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    params = [SamplingParams(profile="vllm", top_k=4, top_p=1.0)]
    d = [float(depth(x, torch.tensor([t]), params)) for t in range(6)]
    assert d[0] == 0.0 and all(a < b for a, b in zip(d, d[1:4]))  # deeper with every rank
    assert d[3] < 1.0 <= d[4] <= DEPTH_CAP  # the 4th token is kept by top-k 4, the 5th is not
    p = torch.softmax(x[0], 0)
    top_p = [SamplingParams(profile="vllm", top_p=0.9)]
    assert float(depth(x, torch.tensor([1]), top_p)) == pytest.approx(float(p[0]) / 0.9, rel=1e-5)
    min_p = [SamplingParams(profile="vllm", min_p=0.07)]
    kept = [float(depth(x, torch.tensor([t]), min_p)) for t in range(6)]  # min-p 0.07 keeps x >= 5 + log 0.07
    assert max(kept[:3]) < 1.0 <= kept[3] == pytest.approx(0.07 * float(torch.exp(torch.tensor(3.0))), rel=1e-6)
    assert kept[5] == DEPTH_CAP


@pytest.mark.parametrize("served, sign", [
    (CLAIM.with_(top_k=25), 1), (CLAIM.with_(top_p=0.76), 1), (CLAIM.with_(temperature=0.9), 1),
    (CLAIM.with_(top_k=60), -1), (CLAIM.with_(temperature=1.1), -1),
    (CLAIM.with_(top_p=1.0, min_p=0.06), 1), (CLAIM.with_(top_p=1.0, min_p=0.04), -1),
])
def test_a_wrong_filter_or_temperature_moves_every_mismatch_one_way(served, sign):
    claim = CLAIM.with_(top_p=1.0, min_p=0.05) if served.min_p else CLAIM
    cols = columns(600, 5, served=served, claim=claim)
    moved = cols["depth_shift"][~cols["exact_match"]]
    assert moved.size >= 5  # the deviation changes tokens at all
    assert (np.sign(moved) == sign).all(), moved


def test_honest_noise_puts_mismatches_on_both_sides():
    cols = columns(6000, 11, noise=NOISE)
    shift = cols["depth_shift"][~cols["exact_match"]]
    assert 0.01 < 1 - cols["exact_match"].mean() < 0.08 and (shift > 0).any() and (shift < 0).any()
    assert abs(shift.mean()) < 3 * shift.std() / np.sqrt(shift.size)


@pytest.mark.parametrize("served, noise, direction", [
    (CLAIM, 0.0, None), (CLAIM, NOISE, None),
    (CLAIM.with_(top_k=25), 0.0, "narrower"), (CLAIM.with_(top_k=25), NOISE, "narrower"),
    (CLAIM.with_(top_p=0.76), NOISE, "narrower"), (CLAIM.with_(temperature=0.9), NOISE, "narrower"),
    (CLAIM.with_(temperature=1.1), NOISE, "wider"),
])
def test_the_one_verdict_rule_with_shape_detectors(calibrations, served, noise, direction):
    shape, _ = calibrations
    v = calibrated_verdict(columns(2000, 21, served=served, noise=noise), shape, 50)
    assert v.consistent is (direction is None), v.text
    assert set(v.detectors) == {"margin", "narrower", "wider"}
    if direction is not None:
        other = {"narrower": "wider", "wider": "narrower"}[direction]
        assert v.detectors[direction]["p"] < v.alpha and v.detectors[other]["flagged"] == 0, v.detectors
        assert v.tokens_needed is not None and v.tokens_needed <= 2000


def test_a_margin_only_calibration_has_no_shape_detectors(calibrations):
    shape, margin_only = calibrations
    cols = columns(200, 4)
    assert set(calibrated_verdict(cols, margin_only, 10).detectors) == {"margin"}
    assert set(calibrated_verdict(cols["margin"], shape, 10).detectors) == {"margin"}  # one metric: one detector


def test_several_detectors_keep_the_false_positive_rate():
    rng = np.random.default_rng(0)
    trials, fpr = 3000, 0.01
    rejected = sum(not flag_verdict(rng.random((3, 40)) < fpr, fpr, 10, names=["a", "b", "c"]).consistent
                   for _ in range(trials))
    assert rejected / trials <= fpr + 3 * np.sqrt(fpr * (1 - fpr) / trials)


def test_verdict_states_minimum_evidence_and_unjudged_tokens(calibrations):
    one = flag_verdict(np.array([True]), 0.01, 10)
    assert one.consistent and "no count of flagged batches among 1 can reject" in one.text
    assert minimum_evidence(20, 0.01, 0.01) == "rejecting needs at least 2 flagged batch(es) of one detector among the first 2"
    shape, _ = calibrations
    v = calibrated_verdict(columns(127, 3), shape, 10)
    assert v.unjudged_tokens == 7 and "the last 7 tokens (less than a batch) were not judged" in v.text
    assert v.tokens == 120
