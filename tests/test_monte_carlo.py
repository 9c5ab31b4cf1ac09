"""Monte Carlo verification (DiFR appendix B.1, ``verinfer.scoring.monte_carlo``).

Statistical assertions use bounds of about five standard errors (or p-values of 1e-6), not
thresholds tuned to one seeded run: each can fail if the property is false, and passes by chance
with probability far below one in a million per check when it is true.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from verinfer.scoring import monte_carlo as mc

Z = 5.0  # standard errors allowed for a mean or a count


def _rows(n: int, v: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


def _draw(sampler, rows, seed: int) -> torch.Tensor:
    """One draw per row from ``sampler`` (the claims an honest provider of that sampler makes)."""
    return mc.simulate(sampler, rows, [None] * len(rows), None, 1, torch.Generator().manual_seed(seed))[:, 0]


def test_estimate_converges_to_softmax_for_temperature_sampling():
    T, n = 0.7, 20_000
    x = _rows(8, 40, 2.0, 1)
    claimed = torch.arange(8) * 3  # a spread of likely and unlikely tokens
    est = mc.estimate(mc.temperature_sampler(T), (x,), claimed, [None], n, torch.Generator().manual_seed(2))
    p = torch.softmax(x / T, dim=-1)[torch.arange(8), claimed].double().numpy()
    sd = np.sqrt(n * p * (1 - p))
    assert np.all(np.abs(est.count - n * p) <= Z * sd + 1), (est.count, n * p)
    assert np.allclose(est.nll, -np.log((est.count + 1) / (n + 1)))


def test_estimate_error_shrinks_like_one_over_sqrt_n():
    T = 1.0
    x = _rows(64, 30, 1.5, 3)
    claimed = torch.zeros(64, dtype=torch.long)
    p = torch.softmax(x / T, dim=-1)[:, 0].double().numpy()
    err = {}
    for n in (100, 6400):
        est = mc.estimate(mc.temperature_sampler(T), (x,), claimed, [None], n, torch.Generator().manual_seed(n))
        err[n] = np.sqrt(np.mean((est.count / n - p) ** 2))
        expected = np.sqrt(np.mean(p * (1 - p) / n))
        # RMS error over 64 rows: its square is a mean of 64 terms with mean expected^2
        assert err[n] <= 2.0 * expected, (n, err[n], expected)
    assert err[6400] < err[100]


def test_candidate_reduction_keeps_probabilities_exact():
    """Top-k of each model + the claim + one tail bucket: the claim's probability under the
    reduced rows equals its probability under the full vocabulary, for a claim in the tail too."""
    T = 0.8
    target, draft = _rows(5, 500, 2.0, 4), _rows(5, 500, 2.0, 5)
    claimed = torch.tensor([target[0].argmax(), 7, 8, draft[3].argmax(), target[4].argmin()])
    cand = mc.candidate_rows([target, draft], claimed, 16, T)
    assert cand.rows[0].shape == cand.rows[1].shape == (5, 16 * 2 + 1 + 1)
    for full, red in zip((target, draft), cand.rows):
        p_full = torch.softmax(full.double() / T, -1)[torch.arange(5), claimed]
        p_red = torch.softmax(red.double() / T, -1)[torch.arange(5), cand.claimed_slot]
        assert torch.allclose(p_full, p_red, rtol=1e-5)
        assert torch.allclose(torch.softmax(red.double() / T, -1).sum(-1), torch.ones(5, dtype=torch.float64))
    assert torch.equal(cand.tokens.gather(1, cand.claimed_slot[:, None]).squeeze(1), claimed)
    assert not cand.perturb[:, -1].any()  # the tail bucket gets no noise


def test_speculative_sampler_emits_the_target_distribution():
    """The rejection step emits p whatever the draft: chi-square against softmax(target / T)."""
    T, n = 1.0, 40_000
    target = _rows(1, 12, 1.5, 6)
    draft = _rows(1, 12, 1.5, 7)  # unrelated to the target: many rejections
    slots = mc.simulate(mc.speculative_sampler(T), (target, draft), [None, None], None, n,
                        torch.Generator().manual_seed(8))[0]
    counts = np.bincount(slots.numpy(), minlength=12)
    p = torch.softmax(target[0].double() / T, -1).numpy()
    assert stats.chisquare(counts, n * p).pvalue > 1e-6
    q = torch.softmax(draft[0].double() / T, -1).numpy()
    assert stats.chisquare(counts, n * q).pvalue < 1e-6  # and not the draft's


def _scores(rows, claims, T, seed, n_draws=255, top=128):
    return mc.score_rows(mc.speculative_sampler(T), rows, claims, [mc.NoiseModel("gaussian", 0.1)] * 2, T,
                         n_draws=n_draws, top=top, seed=seed)


def _mean_diff_z(a: np.ndarray, b: np.ndarray) -> float:
    return float((a.mean() - b.mean()) / math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size))


@pytest.fixture(scope="module")
def spec_case():
    T, R = 1.0, 240
    target = _rows(R, 200, 3.0, 9)  # the top 128 of 200 tokens leave a tail of probabilities << 1 / 255
    draft = 0.5 * target + _rows(R, 200, 2.0, 10)  # a related but worse draft, as a small model is
    rows = (target, draft)
    honest_spec = _draw(mc.speculative_sampler(T), rows, 11)
    honest_plain = _draw(mc.temperature_sampler(T), (target,), 12)
    cheat = _draw(mc.temperature_sampler(T), (draft,), 13)  # draft-only: tokens from q, unchecked
    return T, rows, honest_spec, honest_plain, cheat


def test_honest_speculative_scores_are_distributed_like_honest_plain_sampling(spec_case):
    T, rows, honest_spec, honest_plain, _ = spec_case
    a, b = _scores(rows, honest_spec, T, 14), _scores(rows, honest_plain, T, 15)
    assert abs(_mean_diff_z(a["mc_nll"], b["mc_nll"])) < Z
    assert stats.ks_2samp(a["mc_nll"], b["mc_nll"]).pvalue > 1e-6
    # the excess score is centred at 0 for honest tokens
    for s in (a, b):
        x = s["mc_excess"]
        assert abs(x.mean()) < Z * x.std(ddof=1) / math.sqrt(x.size)


def test_cheat_scores_higher_on_average(spec_case):
    T, rows, honest_spec, _, cheat = spec_case
    honest, bad = _scores(rows, honest_spec, T, 16), _scores(rows, cheat, T, 17)
    assert _mean_diff_z(bad["mc_nll"], honest["mc_nll"]) > Z
    assert _mean_diff_z(bad["mc_excess"], honest["mc_excess"]) > Z


def test_scores_are_reproducible_and_floored():
    T = 1.0
    rows = (_rows(4, 50, 3.0, 18), _rows(4, 50, 3.0, 19))
    never = rows[0].argmin(dim=1)  # practically never sampled at logit scale 3
    a = _scores(rows, never, T, 20, n_draws=63)
    b = _scores(rows, never, T, 20, n_draws=63)
    assert np.array_equal(a["mc_nll"], b["mc_nll"])
    assert np.all(a["mc_nll"] <= math.log(64) + 1e-12)  # add-one floor: P_hat >= 1 / (N + 1)
    assert np.all(np.isfinite(a["mc_nll"]))


def test_fit_noise_picks_the_generating_family():
    rng = np.random.default_rng(21)
    fit = mc.fit_noise(rng.laplace(0, 0.05, 50_000))
    assert fit.model.family == "laplace"
    assert abs(fit.model.scale - 0.05) < Z * 0.05 / math.sqrt(50_000)  # MLE of b: sd b / sqrt(n)
    g = mc.fit_noise(rng.normal(0, 0.2, 50_000))
    assert g.model.family in ("gaussian", "student-t")
    assert abs(g.model.std - 0.2) < 0.01
    assert mc.NoiseModel.from_dict(fit.model.to_dict()) == fit.model


def test_noise_samples_have_the_model_std():
    for m in (mc.NoiseModel("gaussian", 0.3), mc.NoiseModel("laplace", 0.2), mc.NoiseModel("student-t", 0.1, 8.0)):
        x = m.sample((200_000,), torch.Generator().manual_seed(22)).double().numpy()
        assert abs(x.std() - m.std) < 0.02 * m.std, (m, x.std())


def test_logit_differences_are_centred_per_row():
    ref = _rows(3, 100, 2.0, 23)
    other = ref + 5.0 + _rows(3, 100, 0.01, 24)  # a common shift is not noise
    d = mc.logit_differences(ref, other, 10)
    assert d.shape == (30,)
    assert np.abs(d).max() < 0.1
    with pytest.raises(ValueError):
        mc.logit_differences(ref, other[:2], 10)


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="family"):
        mc.NoiseModel("cauchy", 1.0)
    with pytest.raises(ValueError, match="temperature"):
        mc.speculative_sampler(0.0)
    with pytest.raises(ValueError, match="noise model per"):
        mc.simulate(mc.temperature_sampler(1.0), (_rows(2, 5, 1.0, 0),), [], None, 4, torch.Generator())
