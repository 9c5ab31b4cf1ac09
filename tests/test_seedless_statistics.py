"""Seedless audits (issue #29): draws never shared between completions, MMD's applicability and
budget planning, the shared prompt prefill of reference draws, and the centred log-probability
scores behind the surprise and rank tests.

The false-positive checks are simulations with fixed seeds (deterministic): the rejection rate's
95% Wilson interval must cover the test's level, which dependent ranks (repeated prompts sharing
reference draws) push far above it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import norm

import verinfer.auditing.draws as draws_module
from verinfer.auditing.draws import CompletionScores, completion_scores, occurrences, reference_draws
from verinfer.auditing.mmd import completions_per_prompt, hamming_gram, mmd_verdict, swap_form
from verinfer.auditing.rank import rank_looks, rank_p_values, rank_verdict, uniformity_p
from verinfer.auditing.surprise import TILTS, surprise_p, surprise_verdict
from verinfer.sampling.params import SamplingParams
from verinfer.simulate.generate import Request, decode_batch
from verinfer.stats.evaluation import wilson_interval
from verinfer.stats.verdict import sequential

CLAIMED = SamplingParams(profile="torch-exponential", temperature=1.0)
PROBS = np.array([0.5, 0.25, 0.15, 0.1])
LENGTH = 5


class MemoryStore:
    """The part of ``ResponseStore`` that ``reference_draws`` uses, in memory."""

    def __init__(self):
        self.records = {}

    def __contains__(self, key):
        return key in self.records

    def get(self, key):
        return self.records.get(key)

    def append(self, key, path, body, response):
        self.records[key] = {"response": response}


def _fake_sampler(monkeypatch):
    """Reference draws from a fixed categorical distribution, seeded by each draw's seed."""
    def tokens(seed):
        return np.random.default_rng(seed).choice(len(PROBS), size=LENGTH, p=PROBS).tolist()

    def fake_decode(backend, requests, max_tokens, stops, profiles, shared=1):
        return [SimpleNamespace(tokens=tokens(r.params.seed)) for r in requests]

    monkeypatch.setattr(draws_module, "decode_batch", fake_decode)
    return SimpleNamespace(model_id="fake", dtype_name="float32", stop_ids=lambda: set())


def _score(seq) -> float:
    return float(np.log(PROBS[np.asarray(seq)]).sum())


def test_occurrences_count_earlier_copies_of_the_same_prompt():
    assert occurrences([[1, 2], [3], [1, 2], [1, 2], [3]]) == [0, 0, 1, 2, 1]


def test_repeated_prompts_hold_the_rank_tests_false_positive_rate(monkeypatch):
    """An honest provider asked 5 prompts 20 times each under new ids: ranks against draws keyed by
    prompt content alone would be dependent (the issue measured 1.3-3.9% rejected at a 1% target)."""
    backend = _fake_sampler(monkeypatch)
    contents = [[10 + i] * (i + 1) for i in range(5)]
    entries = [(f"id-{r}-{i}", ids) for r in range(20) for i, ids in enumerate(contents)]
    alpha, sims, rejected = 0.05, 200, 0
    provider = np.random.default_rng(123)
    for sim in range(sims):
        ref = reference_draws(backend, entries, CLAIMED, 3, sim, LENGTH, MemoryStore())
        assert len(ref) == len(entries) and all(len(d) == 3 for d in ref)
        observed = np.array([_score(provider.choice(len(PROBS), size=LENGTH, p=PROBS)) for _ in entries])
        u = rank_p_values(observed, [np.array([_score(o) for o in d]) for d in ref], provider)
        rejected += uniformity_p(u) < alpha
    ci = wilson_interval(rejected, sims)
    assert ci.low <= alpha <= ci.high, (rejected, sims, ci)


def test_each_completion_of_a_prompt_gets_draws_of_its_own(monkeypatch):
    backend = _fake_sampler(monkeypatch)
    store = MemoryStore()
    ref = reference_draws(backend, [("a", [1, 2]), ("a", [1, 2]), ("b", [1, 2])], CLAIMED, 4, 0, LENGTH, store)
    assert len(store.records) == 3 and ref[0] != ref[1] != ref[2]
    again = reference_draws(backend, [("x", [1, 2]), ("y", [1, 2]), ("z", [1, 2])], CLAIMED, 4, 0, LENGTH, store)
    assert again == ref  # keyed by content and occurrence, not by id: a rerun draws nothing new


def test_mmd_refuses_one_completion_per_prompt():
    rng = np.random.default_rng(0)
    one = [[rng.integers(0, 4, 8).tolist()] for _ in range(6)]
    with pytest.raises(ValueError, match="at least 2 completions per prompt"):
        mmd_verdict(one, one, 8)


def test_mmd_swap_form_is_the_unbiased_mmd_under_within_pair_swaps():
    """The permutation null's quadratic form equals the unbiased MMD^2 computed from its definition
    for random within-pair swaps (``mmd.swap_form``)."""
    rng = np.random.default_rng(3)
    n = 7
    xs, ys = rng.integers(0, 3, (n, 6)), rng.integers(0, 3, (n, 6))
    groups = rng.integers(0, 3, n)

    def direct(x, y):
        k = hamming_gram(x, y, groups)
        within = lambda m: (m.sum() - np.trace(m)) / (n * (n - 1))  # noqa: E731
        return within(k[:n, :n]) + within(k[n:, n:]) - 2 * k[:n, n:].mean()

    const, w = swap_form(hamming_gram(xs, ys, groups))
    for _ in range(20):
        s = rng.choice([-1.0, 1.0], n)
        x, y = np.where(s[:, None] > 0, xs, ys), np.where(s[:, None] > 0, ys, xs)
        assert const + s @ w @ s / 2 == pytest.approx(direct(x, y), abs=1e-12)


@pytest.mark.parametrize("samples", [2, 4, 16])
def test_mmd_budgets_plan_at_least_two_prompts_of_two(samples):
    for budget in range(4, 201):
        n = completions_per_prompt(budget, samples)
        assert 2 <= n <= samples and budget // n >= 2 and (budget // n) * n <= budget
    assert completions_per_prompt(100, 16) == 16
    with pytest.raises(ValueError, match="at least 4"):
        completions_per_prompt(3, samples)


# --------------------------------------------------------------------------------------------------
# The surprise statistic on synthetic position-wise distributions


def _chain(rng, positions: int, vocab: int = 50):
    logits = rng.normal(0, 2.5, size=(positions, vocab))
    return logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)


def _position_terms(rows: np.ndarray, y: np.ndarray, tilts=TILTS):
    """(log p of y, E log p, Var log p, cgf of the centred log p at ``tilts``) per row, as
    ``completion_scores`` computes them (temperature 1, no filter)."""
    p = np.exp(rows)
    m = (p * rows).sum(1)
    d = rows - m[:, None]
    psi = np.log((p[:, None, :] * np.exp(np.asarray(tilts)[None, :, None] * d[:, None, :])).sum(-1))
    return rows[np.arange(len(rows)), y], m, (p * d ** 2).sum(1), psi


def _scores(rng, logp, sample_logq, completions: int, length: int) -> CompletionScores:
    """Completions of ``length`` positions, each position a fresh random distribution ``logp``; tokens
    drawn from ``sample_logq(logp)``; scored as ``completion_scores`` does."""
    lp, mean, var, cgf = [], [], [], []
    for _ in range(completions):
        rows = logp[rng.integers(0, len(logp), size=length)]
        q = np.exp(sample_logq(rows))
        y = np.array([rng.choice(rows.shape[1], p=qi / qi.sum()) for qi in q])
        terms = _position_terms(rows, y)
        for out, t in zip((lp, mean, var, cgf), terms):
            out.append(t.sum(0))
    return CompletionScores(np.array(lp), np.array(mean), np.array(var), np.full(completions, length),
                            np.array(cgf), TILTS)


def test_surprise_sees_a_wrong_temperature_either_way():
    rng = np.random.default_rng(4)
    logp = _chain(rng, 400)
    hotter, colder = (lambda rows: rows / 1.3), (lambda rows: rows / 0.8)  # noqa: E731
    for sample, sign in ((hotter, -1), (colder, 1)):
        v = surprise_verdict(_scores(rng, logp, sample, 25, 16))
        assert not v.consistent and v.p_value < 1e-3 and np.sign(v.statistic) == sign
        assert v.tokens_needed is not None and v.tokens_needed < v.tokens
    honest = surprise_verdict(_scores(rng, logp, lambda rows: rows, 25, 16))
    assert honest.consistent and surprise_p(_scores(rng, logp, lambda rows: rows, 25, 16)) > 0.01


def _stopping_model(seed: int, vocab: int, rows: int = 64) -> np.ndarray:
    """Log-probability tables of a small autoregressive model whose next-token distribution depends on
    the previous token and the step, with heavy-tailed logits and a stop token (0)."""
    x = np.random.default_rng(seed).standard_t(3, size=(rows, vocab)) * 2.0
    x[:, 0] -= 1.0
    return x - np.logaddexp.reduce(x, axis=1, keepdims=True)


def _complete(table, prompts, rng, length: int, tilts=()) -> CompletionScores:
    """One completion per prompt (its first 'previous token'), the stop token included and ending it,
    scored as ``completion_scores`` does (with ``tilts``: the surprise test's cgf too)."""
    n, prev, alive = len(prompts), np.asarray(prompts), np.ones(len(prompts), bool)
    lp, mean, var, tokens = (np.zeros(n) for _ in range(4))
    cgf = np.zeros((n, len(tilts)))
    for t in range(length):
        rows = table[(prev * 7 + t) % len(table)]
        y = np.argmax(rows - np.log(rng.exponential(size=rows.shape)), axis=1)  # exponential race: exact
        for total, term in zip((lp, mean, var, cgf), _position_terms(rows, y, tilts)):
            total += np.where(alive if term.ndim == 1 else alive[:, None], term, 0)
        tokens += alive
        alive &= y != 0
        prev = y
    return CompletionScores(lp, mean, var, tokens.astype(int), cgf if tilts else None, tuple(tilts))


@pytest.fixture(scope="module")
def short_honest():
    """4,000 honest audits of 4 completions of at most 4 tokens from a model with a stop token and
    heavy-tailed logits (3.7 tokens per completion): where a normal approximation fails."""
    table, rng, B, sims = _stopping_model(0, 6), np.random.default_rng(1), 4, 4000
    return _complete(table, rng.integers(0, 1000, size=sims * B), rng, 4, TILTS), B, sims


def test_surprise_holds_its_level_on_short_completions_that_stop(short_honest):
    """The surprise verdict at 1% on honest audits of short, stopping completions: the rejection rate's
    95% Wilson interval must cover 1% or lie below it, at every size (issue #29). The normal z-test it
    replaced (two-sided, doubling looks, Bonferroni), on the same audits, rejects about 2%: the
    simulation sees an asymptotic level that does not hold."""
    s, B, sims = short_honest
    audits = [s[i * B:(i + 1) * B] for i in range(sims)]
    rejected = sum(not surprise_verdict(a, 0.01).consistent for a in audits)
    ci = wilson_interval(rejected, sims)
    assert ci.low <= 0.01, (rejected, sims, ci)

    def normal_p(a):
        return 2 * norm.sf(abs(a.centred.sum()) / np.sqrt(a.variance.sum())) if a.variance.sum() > 0 else 1.0

    z_rejected = sum(sequential(lambda k, a=a: normal_p(a[:k]), rank_looks(B), 0.01)[0] < 0.01 for a in audits)
    assert wilson_interval(z_rejected, sims).low > 0.01, z_rejected


def test_surprise_martingale_has_mean_one_under_the_null(short_honest):
    """The cumulant generating function summed over each audit's stopping completions makes
    exp(lambda S - C) a martingale of mean 1 at every tilt (checked where its variance is moderate,
    |lambda| <= 0.2, to 5 standard errors; a tilt sign or a term per position gone wrong moves it)."""
    s, B, sims = short_honest
    lam = np.asarray(TILTS)
    S = s.centred.reshape(sims, B).sum(1)
    C = s.cgf.reshape(sims, B, -1).sum(1)
    martingale = np.exp(S[:, None] * lam - C)[:, np.abs(lam) <= 0.2]
    mean, se = martingale.mean(0), martingale.std(0, ddof=1) / np.sqrt(sims)
    assert (np.abs(mean - 1) < 5 * se).all(), (mean, se)


def test_rank_test_holds_its_level_on_an_honest_model_with_stops_and_ties():
    """The rank verdict at 1% on honest completions of a model whose completions stop early and tie
    often (6 tokens of a 6-token vocabulary: about 15% of draws tie the provider's score): the
    rejection rate's 95% interval must reach down to 1% (issue #29). With ties not broken (the
    provider counted below every draw it ties), the same simulation rejects about 10% of honest audits."""
    table, rng, m, B, sims = _stopping_model(0, 6), np.random.default_rng(2), 6, 50, 600
    prompts = rng.integers(0, 1000, size=sims * B)
    provider, draws = _complete(table, prompts, rng, 6), _complete(table, np.repeat(prompts, m), rng, 6)
    ref = draws.centred.reshape(-1, m)
    assert np.mean(ref == provider.centred[:, None]) > 0.1  # ties are common
    u = rank_p_values(provider.centred, ref, rng)
    rejected = sum(not rank_verdict(u[i * B:(i + 1) * B], provider.tokens[i * B:(i + 1) * B], m).consistent
                   for i in range(sims))
    ci = wilson_interval(rejected, sims)
    assert ci.low <= 0.01, (rejected, sims, ci)
    below = ((ref < provider.centred[:, None]).sum(1) + 0.5) / (m + 1)  # ties not broken: counted above
    control = sims // 3  # a ~10% rate needs fewer audits to show its interval above 1%
    rejected_below = sum(not rank_verdict(below[i * B:(i + 1) * B], provider.tokens[i * B:(i + 1) * B], m).consistent
                         for i in range(control))
    assert wilson_interval(rejected_below, control).low > 0.01  # the simulation sees a miscalibrated rank


# --------------------------------------------------------------------------------------------------
# On the bundled model


@pytest.fixture(scope="module")
def prompts(backend):
    from verinfer.prompts import load_prompts, render

    return [render(backend.tokenizer, p) for p in load_prompts("chitchat", 2, seed=5)]


def test_shared_prompt_prefill_draws_the_same_tokens(backend, prompts):
    requests = [Request(f"r{i}-{j}", tuple(p), CLAIMED.with_(seed=100 * i + j)) for i, p in enumerate(prompts)
                for j in range(3)]
    stops = backend.stop_ids()
    alone = decode_batch(backend, requests, 6, stops, {})
    shared = decode_batch(backend, requests, 6, stops, {}, shared=3)
    assert [d.tokens for d in shared] == [d.tokens for d in alone]
    with pytest.raises(ValueError, match="groups of 2"):
        decode_batch(backend, requests, 6, stops, {}, shared=2)


def test_completion_scores_centre_on_the_sampling_distributions_entropy(backend, prompts):
    outputs = [[28, 253, 1165], [355, 30]]
    s = completion_scores(backend, prompts, outputs, CLAIMED.with_(temperature=0.8), tilts=TILTS)
    logits = backend.logits(backend.hidden(torch.as_tensor([prompts[0] + outputs[0]]), None)[0][0]).double()
    logp = torch.log_softmax(logits[len(prompts[0]) - 1: -1] / 0.8, dim=-1)
    mean = (logp.exp() * logp).sum(-1)
    taken = logp[torch.arange(3), torch.as_tensor(outputs[0])].sum()
    assert s.expected[0] == pytest.approx(float(mean.sum()), rel=1e-4)
    assert s.logprob[0] == pytest.approx(float(taken), rel=1e-4)
    assert list(s.tokens) == [3, 2] and (s.variance > 0).all()
    # the surprise test's cumulant generating function: at T 0.8, tilt lambda is the log-normalizer of
    # sampling at temperature 0.8 / (1 + lambda) relative to 0.8, minus lambda times the mean
    lam = torch.as_tensor(TILTS, dtype=torch.float64)
    psi = (torch.logsumexp((1 + lam[:, None, None]) * logp[None], dim=-1) - lam[:, None] * mean[None]).sum(-1)
    assert s.cgf.shape == (2, len(TILTS)) and s.tilts == TILTS
    # float32 scoring against float64 here: 4.2e-5 apart at the largest tilts on one CPU (its vector width
    # orders the float32 sums), 1e-5 on another; a psi off by d moves the martingale's p by a factor e^d
    np.testing.assert_allclose(s.cgf[0], psi.numpy(), rtol=1e-4, atol=1e-4)
    top = completion_scores(backend, prompts, outputs, CLAIMED.with_(temperature=0.8, top_k=5))
    assert (top.expected > s.expected).all()  # sampling among the top 5 expects likelier tokens
