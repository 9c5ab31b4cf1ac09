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
from scipy.stats import fisher_exact

from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import RowKeys, get_profile
from verinfer.sampling.sampler import replay
from verinfer.sampling.depth import DEPTH_CAP, depth
from verinfer.stats.summary import fit_calibrator
from verinfer.stats.sides import detectors, fisher_greater, oriented, side_counts, side_p_value
from verinfer.stats.verdict import calibrated_verdict, can_reject, default_batch_size, flag_verdict, minimum_evidence

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
            "depth_shift": out.depth_shift.numpy()}


@pytest.fixture(scope="module")
def calibrations():
    """Pooled honest null: an exact provider and a noisy ("bf16") one, 3,000 tokens each."""
    honest = [columns(3000, 1), columns(3000, 2, noise=NOISE)]
    pooled = {k: np.concatenate([c[k] for c in honest]) for k in honest[0]}
    groups = {"exact": honest[0], "noisy": honest[1]}
    return fit_calibrator(pooled, (10, 50), groups=groups), fit_calibrator(pooled, (10, 50), shape=False)


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


def _depth_by_the_definition(row: torch.Tensor, token: int, p: SamplingParams) -> float:
    """The module docstring's definition on one whole row, sorted plainly (the test's own oracle)."""
    x, vocab = row.double(), row.numel()
    tau = float("-inf")
    if p.min_p > 0:
        tau = float(x.max()) + float(np.log(p.min_p))
    if 0 < p.top_k < vocab:
        tau = max(tau, float(torch.sort(x, descending=True).values[p.top_k - 1]))
    kept = x >= tau
    probs = torch.softmax(x.masked_fill(~kept, float("-inf")), 0)
    xt = x[token]
    d = float(probs[(x > xt) & kept].sum()) / p.top_p
    if 0 < p.top_k < vocab:
        d = max(d, float((x > xt).sum()) / p.top_k)
    if p.min_p > 0:
        d = max(d, p.min_p * float(torch.exp(x.max() - xt)))
    return min(max(d, 0.0), DEPTH_CAP)


@pytest.mark.parametrize("seed", range(6))
def test_depth_from_the_samplers_view_equals_the_definition_on_the_whole_row(seed):
    """Issue #40: depth is read from the replay's top view (and the row only where the view cannot tell);
    mixed filters in one block (top-k off as -1 or >= the vocabulary, which used to index past the
    view), tied logits, tokens deep below the view and filtered ones."""
    from verinfer.sampling.filters import kept_set

    g = torch.Generator().manual_seed(seed)
    n, vocab = 24, 3000
    x = torch.randn(n, vocab, generator=g) * (1 + 3 * torch.rand(n, 1, generator=g))
    x[::3] = x[::3].round()  # ties, at the k-th value too
    params = [SamplingParams("vllm", 1.0, [-1, 5, 50, 200, vocab, vocab + 3][i % 6], [1.0, 0.9, 0.5][i % 3],
                             min_p=[0.0, 0.0, 0.05][(i // 3) % 3]) for i in range(n)]
    tokens = torch.stack([x.argmax(-1), torch.randint(0, vocab, (n,), generator=g)], 1)
    tokens[1::2, 0] = x[1::2].topk(70, dim=-1).indices[:, 66]  # just below a 64-wide view
    want = torch.tensor([[_depth_by_the_definition(x[i], int(tokens[i, j]), params[i]) for j in range(2)]
                         for i in range(n)], dtype=torch.float64)
    assert torch.allclose(depth(x, tokens, params), want, atol=1e-6)
    kept = kept_set(x, torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]),
                    torch.tensor([p.min_p for p in params]))
    rows = torch.arange(1, n, 2)
    got = depth(x, tokens[rows], [params[i] for i in rows.tolist()], kept.view[rows], rows)
    assert torch.allclose(got, want[rows], atol=1e-6)
    # the sampler's own normalizer over what min-p and top-k keep (no pass over the row here), as replay passes it
    got = depth(x, tokens[rows], [params[i] for i in rows.tolist()], kept.view[rows], rows, kept.base_norm[rows])
    assert torch.allclose(got, want[rows], atol=1e-6)
    assert not torch.allclose(kept.base_norm, kept.log_norm)  # top-p's renormalization is not what depth reads
    assert (want[:, 1] >= 1.0).any() and (want[:, 1] < 1.0).any()  # filtered and kept claims both tested


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


OPPOSITE = {"narrower": "wider", "wider": "narrower", "beyond": "narrower"}


@pytest.mark.parametrize("served, noise, direction", [
    (CLAIM, 0.0, None), (CLAIM, NOISE, None),
    (CLAIM.with_(top_k=25), 0.0, "narrower"), (CLAIM.with_(top_k=25), NOISE, "narrower"),
    (CLAIM.with_(top_k=40), 0.0, "narrower"), (CLAIM.with_(top_k=60), 0.0, "beyond"),
    (CLAIM.with_(top_p=0.76), NOISE, "narrower"), (CLAIM.with_(temperature=0.9), NOISE, "narrower"),
    (CLAIM.with_(temperature=1.1), NOISE, "wider"),
])
def test_the_one_verdict_rule_with_shape_detectors(calibrations, served, noise, direction):
    """A fifth off in top-k (by an exact provider: with bf16-like noise on top the side counts of 2,000
    tokens reach p ~ 0.003-0.008 per look here, short of the rule's Bonferroni level) / top-p, or 10% off
    in temperature (with noise on top), is caught within 2,000 tokens by the detector of its kind;
    honest providers are not."""
    shape, _ = calibrations
    v = calibrated_verdict(columns(2000, 21, served=served, noise=noise), shape, 50)
    assert v.consistent is (direction is None), v.text
    assert set(v.detectors) == {"margin", "narrower", "wider", "beyond"}
    if direction is not None:
        assert v.detectors[direction]["p"] < v.alpha <= v.detectors[OPPOSITE[direction]]["p"], v.detectors
        assert v.tokens_needed is not None and v.tokens_needed <= 2000


def test_a_wider_top_k_is_caught_beyond_the_claimed_boundary(calibrations):
    """A served top-k 60 for a claimed 50 (an exact provider) makes mismatches only beyond the claimed
    boundary; the honest noisy group crosses it in a minority of its mismatches (boundary reorderings
    among near-tied tokens), so ``beyond`` rejects within 500 tokens with a p-value far below
    ``wider``'s, which counts only the side; an honest noisy provider's boundary crossings pass."""
    shape, _ = calibrations
    noisy = next(g for g in shape.sides if g["group"] == "noisy")
    assert 0 < noisy["beyond"] < 0.5 * (noisy["positive"] + noisy["negative"]), noisy
    cols = columns(500, 31, served=CLAIM.with_(top_k=60))
    counts = side_counts(cols["depth_shift"], cols["margin"])
    assert counts["positive"] == 0 and counts["beyond"] == counts["negative"] >= 3, counts
    v = calibrated_verdict(cols, shape, 50)
    assert not v.consistent and v.decided_by == "beyond", v.text
    assert v.detectors["beyond"]["p"] < v.detectors["wider"]["p"] / 100, v.detectors
    assert "beyond the claimed sampler's filters" in v.text
    honest = columns(2000, 32, noise=NOISE)
    assert side_counts(honest["depth_shift"], honest["margin"])["beyond"] > 0  # it crosses the boundary too
    h = calibrated_verdict(honest, shape, 50)
    assert h.consistent and h.detectors["beyond"]["p"] >= h.alpha, h.text


MIN_P_CLAIM = CLAIM.with_(top_k=-1, top_p=1.0, min_p=0.05)


@pytest.fixture(scope="module")
def min_p_calibration():
    """Pooled honest null of the min-p claim: an exact provider and a noisy one, 3,000 tokens each."""
    honest = [columns(3000, 1, claim=MIN_P_CLAIM, served=MIN_P_CLAIM),
              columns(3000, 2, noise=NOISE, claim=MIN_P_CLAIM, served=MIN_P_CLAIM)]
    pooled = {k: np.concatenate([c[k] for c in honest]) for k in honest[0]}
    return fit_calibrator(pooled, (50,), groups={"exact": honest[0], "noisy": honest[1]})


@pytest.mark.parametrize("served, direction", [(0.06, "narrower"), (0.04, "wider"), (0.05, None)])
def test_a_min_p_a_fifth_off_is_caught(min_p_calibration, served, direction):
    """min-p 0.06 / 0.04 served (by an exact provider) for a claimed 0.05, against a pooled exact + noisy
    min-p calibration; an honest noisy provider of the claim passes."""
    claim, cal = MIN_P_CLAIM, min_p_calibration
    noise = NOISE if direction is None else 0.0
    v = calibrated_verdict(columns(2000, 23, served=claim.with_(min_p=served), noise=noise, claim=claim), cal, 50)
    assert v.consistent is (direction is None), v.text
    if direction is not None:
        assert v.detectors[direction]["p"] < v.alpha <= v.detectors[OPPOSITE[direction]]["p"], v.text
        assert v.tokens_needed <= 2000, v.text


def honest_counts(rng: np.random.Generator, mean: float, size: int) -> dict[str, np.ndarray]:
    """Side counts of ``size`` honest sets with Poisson(``mean``) mismatches, lopsided as logit noise is
    (40% shallower, and 30% of the deeper ones beyond the claimed boundary: about bf16's shares)."""
    n = rng.poisson(mean, size)
    positive = rng.binomial(n, 0.4)
    return {"positive": positive, "negative": n - positive, "beyond": rng.binomial(n - positive, 0.3)}


def test_side_p_values_of_honest_noise_are_valid_at_every_level():
    """Honest noise with lopsided shares: the test's counts and the calibration group's are drawn alike,
    and every detector's p-value (Fisher's exact test, as ``side_p_value`` takes it) is below a level
    at most that often (binomial bound over 4,000 draws)."""
    rng = np.random.default_rng(3)
    trials = 4000
    test, cal = honest_counts(rng, 40, trials), honest_counts(rng, 90, trials)
    for detector in ("narrower", "wider", "beyond"):
        p = fisher_greater(*oriented(test, detector), *oriented(cal, detector))
        for level in (0.01, 0.05, 0.2, 0.5):
            assert np.mean(p <= level) <= level + 3 * np.sqrt(level * (1 - level) / trials), (detector, level)
        assert np.mean(p <= 0.5) > 0.3  # not a test that never rejects
    one = {k: int(v[0]) for k, v in cal.items()}
    for j in range(20):  # side_p_value is that test, per look
        counts = {k: int(v[j]) for k, v in test.items()}
        for detector in ("narrower", "wider", "beyond"):
            on, off = oriented(counts, detector)
            expected = fisher_exact([[on, off], list(oriented(one, detector))], alternative="greater").pvalue
            assert side_p_value(counts, [{"group": "g", **one}], detector) == pytest.approx(expected, rel=1e-9, abs=1e-300)
    # against the symmetric 1/2 these same honest counts would be called "wider" far too often
    biased = fisher_greater(test["negative"], test["positive"], 500, 500)
    assert np.mean(biased <= 0.05) > 0.1


def test_the_least_favourable_honest_group_sets_the_p_value():
    groups = [{"group": "a", "positive": 40, "negative": 60, "beyond": 10},
              {"group": "b", "positive": 60, "negative": 40, "beyond": 30},
              {"group": "exact", "positive": 0, "negative": 0, "beyond": 0}]
    counts = {"positive": 30, "negative": 10, "beyond": 8}
    both = side_p_value(counts, groups, "narrower")
    assert both == side_p_value(counts, groups[1:2], "narrower") > side_p_value(counts, groups[:1], "narrower")
    assert side_p_value(counts, groups, "beyond") == side_p_value(counts, groups[1:2], "beyond")
    assert side_p_value(counts, groups[2:], "narrower") == 1.0  # a group without mismatches judges no side
    assert side_p_value({"positive": 0, "negative": 0, "beyond": 0}, groups, "wider") == 1.0
    looks = {k: np.array([0, v // 2, v]) for k, v in counts.items()}  # one array call judges every look
    assert side_p_value(looks, groups, "beyond").tolist() == [
        1.0, side_p_value({k: v // 2 for k, v in counts.items()}, groups, "beyond"), side_p_value(counts, groups, "beyond")]
    assert detectors(groups) == ("narrower", "wider", "beyond")
    assert detectors([{k: v for k, v in g.items() if k != "beyond"} for g in groups]) == ("narrower", "wider")
    assert detectors(groups[2:]) == ()


def test_the_whole_rule_keeps_its_false_positive_rate_with_side_detectors():
    """Batches flagged at the calibrated rate and honest mismatches drawn like the calibration group's
    (side and boundary crossing): the sequential verdict over margin + three shape detectors rejects at
    most alpha of honest sets (binomial bound: 3 standard errors over 1,000 sets)."""
    rng = np.random.default_rng(5)
    trials, fpr, size, n = 1000, 0.01, 20, 40
    null = [{"group": "bf16", "tokens": 20000, "positive": 230, "negative": 330, "beyond": 100}]
    rejected = 0
    for _ in range(trials):
        miss = rng.random(n * size) < 0.028
        deep = rng.random(n * size) >= 0.41
        shift = np.where(miss, np.where(deep, -1.0, 1.0) * rng.random(n * size), 0.0)
        margin = np.where(miss & deep & (rng.random(n * size) < 100 / 330), np.inf, np.where(miss, 1.0, 0.0))
        v = flag_verdict(rng.random(n) < fpr, fpr, size, names=["margin"],
                         sides=({"depth_shift": shift, "margin": margin}, null))
        assert "beyond" in v.detectors
        rejected += not v.consistent
    assert rejected / trials <= fpr + 3 * np.sqrt(fpr * (1 - fpr) / trials)


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


def test_the_default_batch_size_is_the_largest_that_can_reject(calibrations):
    """Without a batch size, the largest calibrated one whose whole batches could reject: 150 tokens
    are one batch of 100 (which no count of flags can reject) but three of 50."""
    shape, _ = calibrations  # batches of 10 and 50, four detectors
    assert not can_reject(1, 0.01, 0.01, 4) and can_reject(2, 0.01, 0.01, 4)
    assert default_batch_size(shape, 150) == 50 and default_batch_size(shape, 99) == 10
    assert default_batch_size(shape, 5) == 10  # nothing fits: the smallest (verify then says too few tokens)
    cold = columns(99, 5, served=CLAIM.with_(temperature=0.5))
    assert not calibrated_verdict(cold, shape).consistent  # one batch of 50 never could; nine of 10 do
