"""Sampler profiles against independent computations: mmh3 golden vectors, hand-checked filters,
and a straightforward full-vocabulary reference sampler written here from the specification."""

import struct

import mmh3
import numpy as np
import pytest
import torch

from verinfer.sampling.filters import kept_set
from verinfer.sampling.noise import torch_exponential_draws, vllm_gumbel
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import RowKeys, get_profile
from verinfer.sampling.sampler import replay


def mmh3_gumbel(seed: int, pos: int, token: int) -> float:
    """vLLM's noise computed independently: mmh3 package, fp32 uniform, fp32 double log."""
    h = mmh3.hash(struct.pack("<QII", seed % 2**64, pos % 2**32, token), seed=0, signed=False)
    u = np.float32((h + 0.5) * 2.0**-32)
    with np.errstate(divide="ignore"):
        return float(-np.log(-np.log(np.float32(1) - u)))


@pytest.mark.parametrize("seed", [0, 1, 42, -7, 2**63 + 5, 2**64 - 1])
def test_vllm_noise_matches_mmh3(seed):
    rng = np.random.default_rng(abs(seed) % 1000)
    positions = rng.integers(0, 2**33, size=5)
    tokens = rng.integers(0, 262144, size=(5, 7))
    got = vllm_gumbel(np.array([seed] * 5, dtype=object), positions, tokens)
    want = np.array([[mmh3_gumbel(seed, int(p), int(t)) for t in row] for p, row in zip(positions, tokens)])
    np.testing.assert_array_equal(got, want)


def test_vllm_noise_is_gumbel_distributed():
    g = vllm_gumbel(np.array([3]), np.array([11]), np.arange(200_000)[None, :])[0]
    assert abs(g.mean() - np.euler_gamma) < 0.01
    assert abs(g.var() - np.pi**2 / 6) < 0.03


def test_exponential_bulk_draw_equals_sequential_steps():
    bulk = torch_exponential_draws(9, 4, 1000)
    gen = torch.Generator().manual_seed(9)
    seq = torch.stack([torch.empty(1000).exponential_(generator=gen) for _ in range(4)])
    assert torch.equal(bulk, seq)
    assert torch.equal(torch_exponential_draws(9, 2, 1000, skip_steps=2), seq[2:])


def _kept(x, k=-1, p=1.0, m=0.0):
    ks = kept_set(torch.tensor([x], dtype=torch.float32), torch.tensor([k]), torch.tensor([p]), torch.tensor([m]), width=2)
    return sorted(ks.cols.tolist())


def test_top_k_keeps_ties_at_kth_value():
    assert _kept([5.0, 3.0, 3.0, 3.0, 1.0], k=2) == [0, 1, 2, 3]
    assert _kept([5.0, 4.0, 3.0, 2.0], k=2) == [0, 1]
    assert _kept([5.0, 4.0, 3.0], k=0) == [0, 1, 2]


def test_top_p_always_keeps_the_top_token():
    assert _kept([10.0, 0.0, 0.0], p=0.01) == [0]


def test_top_p_boundary():
    # probs ~ [0.5, 0.25, 0.125, 0.125]: mass before token 1 is 0.5, before token 2 is 0.75
    x = list(np.log([0.5, 0.25, 0.125, 0.125]))
    assert _kept(x, p=0.5) == [0]
    assert _kept(x, p=0.51) == [0, 1]
    assert _kept(x, p=0.76) == [0, 1, 2, 3]  # the two tied 0.125 entries are kept together


def test_top_p_applies_after_top_k():
    x = list(np.log([0.4, 0.3, 0.2, 0.1]))
    # over top-2 renormalised: [4/7, 3/7]; p = 0.5 keeps only the first
    assert _kept(x, k=2, p=0.5) == [0]
    assert _kept(x, k=3, p=0.75) == [0, 1]


def test_min_p():
    x = list(np.log([0.5, 0.2, 0.05, 0.25]))
    assert _kept(x, m=0.4) == [0, 1, 3]
    assert _kept(x, m=0.5) == [0, 3]


def reference_vllm_sample(logits, params, pos):
    """Straightforward vLLM-order sampler over the full vocabulary (sorts every row)."""
    x = logits.double() / max(params.temperature, 0.01)
    if params.min_p > 0:
        x = x.masked_fill(x < x.max() + np.log(params.min_p), -np.inf)
    if 0 < params.top_k < x.numel():
        kth = x.sort(descending=True).values[params.top_k - 1]
        x = x.masked_fill(x < kth, -np.inf)
    if params.top_p < 1:
        vals, idx = x.sort(descending=True)
        p = torch.softmax(vals, 0)
        before = torch.cumsum(p, 0) - p
        keep = before < params.top_p
        keep[0] = True
        cutoff = vals[keep].min()
        x = x.masked_fill(x < cutoff, -np.inf)
    g = torch.tensor(vllm_gumbel(np.array([params.seed]), np.array([pos]), np.arange(x.numel())[None])[0])
    s = x + g
    return int(torch.argmax(s)), s, x


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.95, seed=2),
        SamplingParams(temperature=1.3, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, top_p=0.999, seed=4),
        SamplingParams(temperature=2.0, top_p=0.7, seed=8),  # kept sets past 64 and 1024 tokens: widening
        SamplingParams(temperature=0.5, min_p=0.05, seed=5),
        SamplingParams(temperature=1.0, top_k=3, seed=6),
        SamplingParams(temperature=0.001, top_k=20, seed=7),
    ],
)
def test_replay_matches_reference_sampler(params):
    torch.manual_seed(0)
    n, vocab = 40, 3000
    logits = torch.randn(n, vocab) * 4
    pos = np.arange(n) + 17
    keys = RowKeys(tuple(["r"] * n), np.array([params.seed] * n, dtype=object), pos, np.arange(n))
    prof = get_profile("vllm")
    ref = [reference_vllm_sample(logits[i], params, int(pos[i])) for i in range(n)]
    want = torch.tensor([r[0] for r in ref])
    got = replay(logits, [params] * n, prof, keys)
    assert torch.equal(got.token, want)
    # score claims: the sampled token (margin 0) and a random other token
    other = torch.randint(0, vocab, (n,))
    scored = replay(logits, [params] * n, prof, keys, claimed=other)
    for i, (_, s, x) in enumerate(ref):
        t = float(params.temperature if params.temperature >= 0.01 else 0.01)
        c = int(other[i])
        assert scored.logit_rank[i] == int((logits[i] > logits[i, c]).sum())
        if torch.isinf(x[c]):
            assert scored.margin[i] == float("inf")
            assert scored.filter_distance[i] > 0
        else:
            assert scored.margin[i] == pytest.approx(float(s.max() - s[c]) * t, abs=1e-5)
            assert scored.filter_distance[i] == 0
            assert scored.gumbel_rank[i] == int((s > s[c]).sum())
    assert torch.equal(replay(logits, [params] * n, prof, keys, claimed=want).margin, torch.zeros(n, dtype=torch.float64))


def test_greedy_margin_and_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 5.0]])
    params = [SamplingParams(profile="greedy")] * 2
    keys = RowKeys(("a", "b"), np.array([None, None], dtype=object), np.array([0, 0]), np.array([0, 0]))
    r = replay(logits, params, get_profile("greedy"), keys, claimed=torch.tensor([0, 2]))
    assert r.token.tolist() == [1, 2]
    assert r.margin.tolist() == [2.0, 0.0]
    assert r.logit_rank.tolist() == [2, 0]


def test_torch_exponential_stream_continues_across_blocks():
    torch.manual_seed(1)
    logits = torch.randn(6, 500)
    p = SamplingParams(profile="torch-exponential", seed=123, top_k=40)
    keys = RowKeys(tuple(["t"] * 6), np.array([123] * 6, dtype=object), np.arange(6), np.arange(6))
    whole = replay(logits, [p] * 6, get_profile("torch-exponential"), keys).token
    prof = get_profile("torch-exponential")
    parts = [
        replay(logits[a:b], [p] * (b - a), prof, RowKeys(tuple(["t"] * (b - a)), keys.seeds[a:b], keys.positions[a:b], keys.steps[a:b])).token
        for a, b in [(0, 2), (2, 5), (5, 6)]
    ]
    assert torch.equal(whole, torch.cat(parts))
    q = torch_exponential_draws(123, 6, 500)
    x = logits.masked_fill(logits < logits.topk(40).values[:, -1:], -np.inf)
    assert torch.equal(whole, torch.argmax(torch.softmax(x, -1) / q, -1))


def test_unknown_profile():
    with pytest.raises(ValueError, match="unknown sampler profile 'nope'"):
        get_profile("nope")


def test_params_problems():
    assert SamplingParams(seed=1).problems() == []
    assert "seeded but no seed" in SamplingParams(profile="vllm", seed=None).problems()[0]
    assert SamplingParams(profile="vllm", temperature=0.0).problems() == []
    assert SamplingParams(top_p=0.0, seed=1).problems()
