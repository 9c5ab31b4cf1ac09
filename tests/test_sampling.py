"""Sampler profiles against independent computations: mmh3 golden vectors, hand-checked filters,
and a straightforward full-vocabulary reference sampler written here from the specification."""

import math
import struct

import mmh3
import numpy as np
import pytest
import torch

from verinfer.sampling.filters import kept_set
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import RowKeys, get_profile
from verinfer.sampling.sampler import replay

F32 = np.float32


def mmh3_gumbel(seed: int, pos: int, token: int, fp64: bool = False) -> float:
    """vLLM V2's noise written independently from REFERENCE.md 1.2: the mmh3 package's hash, the
    fp32 uniform, the degree-8 series below 0.25 (fp32 Horner), or the fp64 mode's 53-bit uniform."""
    msg = struct.pack("<QII", seed % 2**64, pos % 2**32, token)
    lo = mmh3.hash(msg, seed=0, signed=False)
    if fp64:
        hi = mmh3.hash(msg, seed=0x9E3779B9, signed=False)
        u = (float(((hi << 32) | lo) >> 11) + 0.5) * 2.0**-53
        u = u - 2.0**-53 if u == 1.0 else u
        return -math.log(-math.log(u))  # the C library's log, as the recorded kernel values (not numpy's AVX-512 log)
    u = F32(lo >> 16) * F32(2.0**-16) + (F32(lo & 0xFFFF) + F32(0.5)) * F32(2.0**-32)
    assert u == F32((lo + 0.5) * 2.0**-32)  # the split sum is the correctly rounded uniform
    if u < 0.25:
        poly = F32(1 / 8)
        for c in (1 / 7, 1 / 6, 1 / 5, 1 / 4, 1 / 3, 1 / 2, 1.0):
            poly = F32(c) + u * poly
        log1mu = -u * poly
    else:
        log1mu = np.log(max(F32(1) - u, F32(5.960464477539063e-08)))
    return float(-np.log(-log1mu))


def vllm_gumbel(seeds, positions, tokens, fp64: bool = False) -> np.ndarray:
    """The profile's noise for tokens [R, C] of rows (seed, pos)."""
    tokens = np.asarray(tokens)
    r, c = tokens.shape
    keys = RowKeys(tuple(["r"] * r), np.asarray(seeds, dtype=object), np.asarray(positions), np.zeros(r, np.int64),
                   params=tuple([SamplingParams(seed=1, fp64_gumbel=fp64)] * r))
    rows = torch.arange(r).repeat_interleave(c)
    return get_profile("vllm").gumbel(keys, rows, torch.as_tensor(tokens).reshape(-1), 0).numpy().reshape(r, c)


@pytest.mark.parametrize("fp64", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 42, -7, 2**63 + 5, 2**64 - 1])
def test_vllm_noise_matches_mmh3(seed, fp64):
    rng = np.random.default_rng(abs(seed) % 1000)
    positions = rng.integers(0, 2**33, size=5)
    tokens = rng.integers(0, 262144, size=(5, 40))
    got = vllm_gumbel([seed] * 5, positions, tokens, fp64)
    want = np.array([[mmh3_gumbel(seed, int(p), int(t), fp64) for t in row] for p, row in zip(positions, tokens)])
    np.testing.assert_array_equal(got, want)


def test_vllm_noise_is_finite_and_bounded_in_the_tail():
    # u < 0.25 takes the series: the tail that wins argmaxes stays finite (no +inf at u < 2**-25)
    g = vllm_gumbel([3], [11], np.arange(400_000)[None, :])[0]
    assert np.isfinite(g).all() and g.max() <= 22.875
    g64 = vllm_gumbel([3], [11], np.arange(400_000)[None, :], fp64=True)[0]
    assert np.isfinite(g64).all() and g64.max() <= 36.75


@pytest.mark.parametrize("fp64", [False, True])
def test_vllm_noise_is_gumbel_distributed(fp64):
    g = vllm_gumbel([3], [11], np.arange(200_000)[None, :], fp64)[0]
    assert abs(g.mean() - np.euler_gamma) < 0.01
    assert abs(g.var() - np.pi**2 / 6) < 0.03


def test_vllm_draft_noise_is_the_salted_position():
    keys = RowKeys(("r",), np.array([5], dtype=object), np.array([9]), np.array([0]))
    rows, cols = torch.zeros(50, dtype=torch.long), torch.arange(50)
    draft = get_profile("vllm").__class__(draft=True).gumbel(keys, rows, cols, 0).numpy()
    want = [mmh3_gumbel(5, 9 + 2**30, t) for t in range(50)]
    np.testing.assert_array_equal(draft, want)


def exponential_draws(seed: int, n_steps: int, vocab_size: int, skip_steps: int = 0) -> torch.Tensor:
    """What vLLM V1 on a CPU draws: steps ``skip_steps`` .. of a generator seeded with ``seed``, as
    ``exponential_`` gives them (the reference the profile's uniforms are checked against)."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed) % 2**64)
    if skip_steps:
        torch.empty(skip_steps, vocab_size).exponential_(generator=gen)
    return torch.empty(n_steps, vocab_size).exponential_(generator=gen)


def test_exponential_bulk_draw_equals_sequential_steps():
    bulk = exponential_draws(9, 4, 1000)
    gen = torch.Generator().manual_seed(9)
    seq = torch.stack([torch.empty(1000).exponential_(generator=gen) for _ in range(4)])
    assert torch.equal(bulk, seq)
    assert torch.equal(exponential_draws(9, 2, 1000, skip_steps=2), seq[2:])


@pytest.mark.parametrize("seed", [0, 9, 2**63 + 5])
def test_cpu_stream_uniforms_give_exponential_bit_for_bit(seed):
    """vllm-v1 draws the generator's fp64 uniforms (``uniform_``) instead of ``exponential_``: the same
    stream position per entry and, through ``-log1p(-u)``, the same fp32 ``q`` on every entry."""
    from verinfer.sampling.mt19937 import Mt19937
    from verinfer.sampling.profiles.vllm_v1 import gumbel_from_uniforms, uniform_draws

    gen = Mt19937(seed)
    u = torch.from_numpy(np.concatenate([uniform_draws(gen, 1, 20000)[0][0], uniform_draws(gen, 2, 20000)[0][0]]))
    q = exponential_draws(seed, 3, 20000)
    assert torch.equal(gumbel_from_uniforms(u), -torch.log(q.double()))


def test_requests_of_one_seeded_batch_draw_their_shared_stream_once(monkeypatch):
    """The traces of one transformers ``generate`` call (one seed, batch B) read rows of the same
    ``[B, V]`` draws: the profile draws each step once for the batch, not once per trace (B times the
    generator's work), and every row still equals torch's own ``exponential_`` (steps split across two
    calls, as across two row blocks, continue the stream; a trace asking again is not redrawn)."""
    from verinfer.sampling.mt19937 import Mt19937

    drawn = []
    uniforms = Mt19937.uniforms
    monkeypatch.setattr(Mt19937, "uniforms", lambda self, n: drawn.append(n) or uniforms(self, n))
    batch, vocab, steps, seed = 4, 3000, 6, 77
    torch.manual_seed(seed)
    q = torch.empty(steps, batch, vocab).exponential_()
    profile = get_profile("transformers")
    rng = np.random.default_rng(0)
    for lo, hi in ((0, 4), (4, 6)):
        rows = [(r, k) for r in range(batch) for k in range(lo, hi)]
        params = tuple(SamplingParams(profile="transformers", seed=seed, stream={"batch_size": batch, "row": r,
                                                                                  "vocab": vocab}) for r, _ in rows)
        keys = RowKeys(tuple(f"t{r}" for r, _ in rows), np.array([seed] * len(rows), dtype=object),
                       np.array([k + 3 for _, k in rows]), np.array([k for _, k in rows]), params=params)
        cols = torch.from_numpy(rng.integers(0, vocab, len(rows)))
        for _ in range(2):
            g = profile.gumbel(keys, torch.arange(len(rows)), cols, vocab)
            want = torch.stack([-torch.log(q[k, r, c].double()) for (r, k), c in zip(rows, cols.tolist())])
            assert torch.equal(g, want)
    assert sum(drawn) == steps * batch * vocab  # each step's [B, V] once
    for r in range(batch):
        profile.forget(f"t{r}")
    assert not profile._places and not profile._drawn
    # Through the sampler, rows trace by trace as verification gives them (its chunks of ROW_CHUNK rows
    # end inside a step): still one draw per step, and the engine's tokens.
    from verinfer.sampling.sampler import ROW_CHUNK

    batch, steps = 5, 7
    assert (batch * steps) % ROW_CHUNK and batch * steps > ROW_CHUNK
    torch.manual_seed(seed)
    q = torch.empty(steps, batch, vocab).exponential_()
    logits = torch.randn(batch, steps, vocab, generator=torch.Generator().manual_seed(1)) * 2
    engine = (logits.double() - torch.log(q.double()).transpose(0, 1)).argmax(-1)  # argmax(x + G), [B, steps]
    rows = [(r, k) for r in range(batch) for k in range(steps)]
    params = [SamplingParams(profile="transformers", seed=seed, temperature=1.0, top_k=-1, top_p=1.0,
                             stream={"batch_size": batch, "row": r, "vocab": vocab}) for r, _ in rows]
    keys = RowKeys(tuple(f"t{r}" for r, _ in rows), np.array([seed] * len(rows), dtype=object),
                   np.array([k + 3 for _, k in rows]), np.array([k for _, k in rows]), params=tuple(params))
    drawn.clear()
    out = replay(logits.reshape(-1, vocab), params, get_profile("transformers"), keys, claimed=engine.reshape(-1))
    assert torch.equal(out.token, engine.reshape(-1)) and bool((out.margin == 0).all())
    assert sum(drawn) == steps * batch * vocab
    # A request asked again under another seed (diagnose's seed candidates) leaves its old stream behind.
    v1 = get_profile("vllm-v1")
    for s in (1, 2, 3):
        one = RowKeys(("x",), np.array([s], dtype=object), np.array([3]), np.array([0]))
        v1.gumbel(one, torch.tensor([0]), torch.tensor([5]), vocab)
    assert v1._places["x"].stream == (3, 1, vocab) and len(v1._places) == 1
    # Requests of one seed at distant steps (a server's, joined at different times) each continue a place
    # of their own, step after step, instead of restarting the stream for the other: n steps, n draws each.
    drawn.clear()
    for k in range(6):
        both = RowKeys(("early", "late"), np.array([9, 9], dtype=object), np.array([20 + k, 3 + k]),
                       np.array([20 + k, 3 + k]))
        g = v1.gumbel(both, torch.tensor([0, 1]), torch.tensor([7, 8]), vocab)
        gen = torch.Generator().manual_seed(9)
        q = torch.empty(26, vocab).exponential_(generator=gen)
        assert torch.equal(g, -torch.log(q[[20 + k, 3 + k], [7, 8]].double()))
    assert sum(drawn) == (20 + 6 + 3 + 6) * vocab  # each place once from the seed to its last step


@pytest.mark.parametrize("seed", [0, 1234, 2**32 + 5, 2**63 + 5, 2**64 - 1])
def test_mt19937_is_torch_cpu_generator_bit_for_bit(seed):
    """The compiled generator against ``uniform_`` on a torch CPU generator, over blocks that start and
    end inside and across the 624-word twists."""
    from verinfer.sampling.mt19937 import Mt19937

    ours, torchs = Mt19937(seed), torch.Generator().manual_seed(seed % 2**64)
    for n in (1, 7, 311, 312, 313, 624, 20000, 49152):
        np.testing.assert_array_equal(ours.uniforms(n), torch.empty(n, dtype=torch.float64).uniform_(generator=torchs))


def _kept(x, k=-1, p=1.0, m=0.0):
    xt = torch.tensor([x], dtype=torch.float32)
    ks = kept_set(xt, torch.tensor([k]), torch.tensor([p]), torch.tensor([m]), width=2)
    return (xt[0] >= ks.threshold[0]).nonzero().squeeze(1).tolist()


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


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.99, 0.999])
def test_top_p_views_sized_by_mass_give_the_full_sort_threshold(top_p):
    """Wide top-p rows are retried on a view sized by a probability histogram instead of a wider
    top-k; the threshold must be the one a full sort of every row gives (log-normalizers to rounding)."""
    torch.manual_seed(int(top_p * 1000))
    scale = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]).repeat_interleave(6)[:, None]
    x = torch.randn(48, 5000) * scale
    x[::7, :40] = x[::7, :40].max()  # rows with ties at the top
    n = x.shape[0]
    k, p, m = torch.full((n,), -1), torch.full((n,), top_p), torch.zeros(n)
    m[::5] = 0.001  # min-p on some rows (the histogram ignores it: those may fall back to a wider view)
    fast, full = kept_set(x, k, p, m), kept_set(x, k, p, m, width=x.shape[1])
    assert torch.equal(fast.threshold, full.threshold)
    torch.testing.assert_close(fast.log_norm, full.log_norm, rtol=0, atol=1e-12)


def reference_vllm_sample(logits, params, pos):
    """Straightforward vLLM-order sampler over the full vocabulary (sorts every row); the noise is
    added to the fp32 scaled logits in fp32, as vLLM V2 does."""
    x = logits.float() / max(params.temperature, 0.01)
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
    g = torch.tensor(vllm_gumbel([params.seed], [pos], np.arange(x.numel())[None])[0])
    s = (x + g.float()).double()
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
    q = exponential_draws(123, 6, 500)
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


@pytest.mark.parametrize("fp64", [False, True])
@pytest.mark.parametrize("temperature,top_p", [(0.5, 1.0), (1.0, 1.0), (2.0, 1.0), (1.0, 0.95), (2.0, 0.9)])
def test_pruned_vllm_replay_equals_noising_every_token(fp64, temperature, top_p):
    """The replay noises only tokens that can reach the best score; winner, margin and rank must
    equal those of noising the whole vocabulary (in the engine's own fp32 or fp64 arithmetic), the
    tokens top-p leaves out scoring -inf (a claim among them: margin inf, ranked below every kept one)."""
    torch.manual_seed(0)
    n, vocab = 40, 5000
    logits = torch.randn(n, vocab) * 4
    p = SamplingParams(temperature=temperature, seed=7, fp64_gumbel=fp64, top_p=top_p)
    keys = RowKeys(tuple(["r"] * n), np.array([7] * n, dtype=object), np.arange(n) + 3, np.arange(n), params=(p,) * n)
    prof = get_profile("vllm")
    g = prof.gumbel(keys, torch.arange(n).repeat_interleave(vocab), torch.arange(vocab).repeat(n), vocab).reshape(n, vocab)
    x = logits / temperature if temperature != 1 else logits
    s = x.double() + g if fp64 else (x + g.float()).double()
    s[x < kept_set(x, torch.full((n,), -1), torch.full((n,), top_p), torch.zeros(n)).threshold[:, None]] = -torch.inf
    other = torch.randint(0, vocab, (n,))
    r = replay(logits, [p] * n, prof, keys, claimed=other)
    assert torch.equal(r.token, s.argmax(-1))
    sc = s.gather(1, other[:, None]).squeeze(1)
    assert torch.equal(r.margin, (s.max(-1).values - sc) * temperature)
    assert torch.equal(r.gumbel_rank, (s > sc[:, None]).sum(-1))


@pytest.mark.parametrize("name", ["vllm-cpu", "vllm-v1", "vllm-v1-cuda", "sglang"])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_pruned_fp64_noise_replay_equals_noising_every_token(name, temperature):
    """Profiles whose score is ``double(x) + G`` prune with their own bounds (vllm-cpu and sglang: a
    dense test on ``u``; vllm-v1-cuda: ``noise_bound``); winner, margin and rank must equal noising every token,
    whether the claim is the winner (the floor is then highest and pruning strongest) or not."""
    torch.manual_seed(1)
    n, vocab = 40, 5000
    logits = torch.randn(n, vocab) * 4
    p = SamplingParams(profile=name, temperature=temperature, seed=7, top_k=0, top_p=1.0)
    keys = RowKeys(tuple(["r"] * n), np.array([7] * n, dtype=object), np.arange(n) + 3, np.arange(n), params=(p,) * n)
    prof = get_profile(name)
    g = prof.gumbel(keys, torch.arange(n).repeat_interleave(vocab), torch.arange(vocab).repeat(n), vocab).reshape(n, vocab)
    s = (logits / temperature if temperature != 1 else logits).double() + g
    for claimed in (s.argmax(-1), torch.randint(0, vocab, (n,))):
        r = replay(logits, [p] * n, get_profile(name), keys, claimed=claimed)
        assert torch.equal(r.token, s.argmax(-1))
        sc = s.gather(1, claimed[:, None]).squeeze(1)
        assert torch.equal(r.margin, (s.max(-1).values - sc) * temperature)
        assert torch.equal(r.gumbel_rank, (s > sc[:, None]).sum(-1))


# ---------------------------------------------------------------- vLLM V1's CUDA stream, on the CPU

def test_philox_matches_random123_known_answers():
    """Random123's known-answer vectors for Philox4x32-10 (the generator cuRAND's
    ``curandStatePhilox4_32_10_t`` implements): counter, key -> output."""
    from verinfer.sampling.philox import philox4x32

    f = 0xFFFFFFFF
    vectors = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
               ((f, f, f, f), (f, f), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
               ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
                (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in vectors:
        assert tuple(int(w) for w in philox4x32(*ctr, *key)) == want


def _curand_exponential(x: int) -> np.float32:
    """``-log(curand uniform)`` of one Philox word, as PyTorch's CUDA ``exponential_`` (fp32)."""
    u = np.float32(np.float32(x) * np.float32(2.0 ** -32) + np.float32(2.0 ** -33))
    return -(np.float32(-(2.0 ** -24)) if u >= np.float32(1) - np.float32(2.0 ** -24) else np.log(u, dtype=np.float32))


def test_cuda_exponential_stream_layout():
    """Entry j of draw k: thread j mod T, lane (j // T) mod 4 of that thread's (j // 4T)-th curand4
    call, whose counter starts at k * ceil(V / 4T) (DistributionTemplates.h; module docstring)."""
    from verinfer.sampling.philox import philox4x32
    from verinfer.sampling.profiles.vllm_v1 import cuda_exponential, cuda_threads_used

    seed, vocab = (1 << 40) + 77, 5000
    assert cuda_threads_used(vocab) == 5120  # 20 blocks of 256: every entry its own thread, lane 0
    assert cuda_threads_used(vocab, cuda_threads=1024) == 1024  # capped: 4 blocks resident
    assert cuda_threads_used(128_256, 132 * 2048) == 501 * 256  # Llama-3 vocabulary on an H100: not capped
    cases = [(None, 3, 4321, 3, 0, 4321), (1024, 2, 4321, 2 * 2 + 1, 0, 225), (1024, 0, 1500, 0, 1, 476),
             (1024, 5, 3000, 5 * 2 + 0, 2, 952)]
    for threads, step, j, counter, lane, thread in cases:
        got = cuda_exponential(seed, np.array([step]), np.array([j]), vocab, threads)[0]
        words = philox4x32(counter, 0, thread, 0, seed & 0xFFFFFFFF, seed >> 32)
        assert got == _curand_exponential(int(words[lane])), (threads, step, j)


def test_cuda_whole_draw_equals_the_entries_asked_one_by_one():
    """The dense replay walks a draw in the stream's own order (curand4 call, lane, thread); the pair
    path computes each entry's place by division: both must give the same ``u``, capped or not."""
    from verinfer.sampling.profiles.vllm_v1 import _cuda_row, _stream, cuda_exponential, exponential_of

    vocab = 5000
    for threads in (None, 1024, 256):  # 1, 2 and 5 curand4 calls per thread and draw
        for seed, step in ((7, 0), ((1 << 40) + 3, 9)):
            k0, k1, t, per_draw = _stream(seed, vocab, threads)
            whole = exponential_of(_cuda_row(k0, k1, np.uint64(step), int(t), int(per_draw), vocab))
            one_by_one = cuda_exponential(seed, np.full(vocab, step), np.arange(vocab), vocab, threads)
            np.testing.assert_array_equal(whole, one_by_one)


def test_cuda_exponential_draws_are_exponential_and_fresh_each_step():
    from scipy.stats import kstest

    from verinfer.sampling.profiles.vllm_v1 import cuda_exponential

    vocab = 49_152
    cols = np.arange(vocab)
    q0 = cuda_exponential(1234, np.zeros(vocab, np.int64), cols, vocab)
    q1 = cuda_exponential(1234, np.ones(vocab, np.int64), cols, vocab)
    assert q0.dtype == np.float32 and (q0 > 0).all() and np.isfinite(q0).all()
    assert kstest(q0, "expon").pvalue > 1e-3 and kstest(q1, "expon").pvalue > 1e-3
    assert np.mean(q0 == q1) < 1e-3  # step 1 is a new draw, not step 0 again
    from verinfer.sampling.profiles.vllm_v1 import MAX_GUMBEL

    assert float(-np.log(np.float64(min(q0.min(), q1.min())))) <= MAX_GUMBEL  # the pruning bound holds
    assert not np.array_equal(q0, cuda_exponential(1235, np.zeros(vocab, np.int64), cols, vocab))


def test_vllm_v1_cuda_profile_replays_its_own_draws_and_differs_from_the_cpu_stream():
    from verinfer.sampling.profiles.vllm_v1 import cuda_exponential

    torch.manual_seed(3)
    logits = torch.randn(6, 3000) * 2
    cuda = SamplingParams(profile="vllm-v1-cuda", seed=99, top_k=0, top_p=1.0)
    keys = RowKeys(tuple(["r"] * 6), np.array([99] * 6, dtype=object), np.arange(6) + 10, np.arange(6))
    for threads in (None, 1024):
        params = cuda.with_(stream={"cuda_threads": threads}) if threads else cuda
        q = torch.stack([torch.from_numpy(cuda_exponential(99, np.full(3000, k), np.arange(3000), 3000, threads))
                         for k in range(6)])
        want = torch.argmax(torch.softmax(logits, -1) / q, -1)
        got = replay(logits, [params] * 6, get_profile("vllm-v1-cuda"), keys, claimed=want)
        assert torch.equal(got.token, want) and got.margin.max() == 0
    capped = replay(logits, [cuda] * 6, get_profile("vllm-v1-cuda"), keys).token  # ignores the cap: other noise
    assert not torch.equal(capped, want)
    cpu = replay(logits, [cuda.with_(profile="vllm-v1")] * 6, get_profile("vllm-v1"), keys, claimed=want)
    assert not torch.equal(cpu.token, want)
    problems = get_profile("vllm-v1-cuda").problems
    assert problems(cuda) == [] and problems(cuda.with_(stream={"cuda_threads": 270_336})) == []
    assert "cuda_threads must be an integer" in problems(cuda.with_(stream={"cuda_threads": 3}))[0]
    assert "takes only" in problems(cuda.with_(stream={"row": 1}))[0]
    assert "takes no stream fields" in get_profile("vllm-v1").problems(cuda.with_(profile="vllm-v1",
                                                                                   stream={"cuda_threads": 512}))[0]


# ---------------------------------------------------------------- device: scoring where the logits are

@pytest.mark.parametrize("name,filters", [
    ("vllm", {"top_k": 50, "top_p": 0.95}), ("vllm", {}), ("vllm", {"top_p": 0.9}), ("vllm", {"min_p": 0.1}),
    ("greedy", {"temperature": 0.0}), ("vllm-cpu", {}), ("vllm-cpu", {"top_k": 20}), ("vllm-v1", {}),
    ("vllm-v1-cuda", {}), ("sglang", {}), ("sglang", {"top_k": 20, "top_p": 0.9}), ("llama.cpp", {}),
    ("transformers", {}),
])
def test_replay_creates_every_tensor_where_the_logits_are(name, filters):
    """Verification keeps the logits on the model's device and brings back per-token columns only
    (``Backend.prefill(on_device=True)``), so the sampler must create its tensors on the logits' device,
    never on the default one. With the default device set to ``meta`` (no data), any tensor created
    without a device fails or changes the result; the replay must equal the ordinary one, field by field."""
    from dataclasses import fields

    torch.manual_seed(0)
    n, vocab = 6, 3000
    logits = torch.randn(n, vocab) * 3
    p = SamplingParams(profile=name, seed=5, **({"temperature": 1.0, "top_k": -1, "top_p": 1.0} | filters))
    if name == "transformers":
        p = p.with_(stream={"batch_size": 1, "row": 0, "vocab": vocab})
    keys = RowKeys(tuple(["r"] * n), np.array([5] * n, dtype=object), np.arange(n) + 3, np.arange(n), params=(p,) * n)
    claimed = torch.randint(0, vocab, (n,))
    want = replay(logits, [p] * n, get_profile(name), keys, claimed=claimed)
    torch.set_default_device("meta")
    try:
        got = replay(logits, [p] * n, get_profile(name), keys, claimed=claimed)
    finally:
        torch.set_default_device("cpu")
    for f in fields(want):
        a, b = getattr(want, f.name), getattr(got, f.name)
        assert (a is None and b is None) or torch.equal(a, b), f.name


def test_vllm_device_noise_equals_the_cpu_noise():
    """On a GPU the ``vllm`` fp32 noise is computed with torch on the logits' device
    (``hash_pairs_torch``, ``_torch_gumbel32``); run here on the CPU tensors, the hashes must equal
    numpy's bit for bit and the Gumbel values agree to the last fp32 ulps of ``log``."""
    from verinfer.sampling import murmur3
    from verinfer.sampling.profiles.vllm import _torch_gumbel32, gumbel32, uniform32

    rng = np.random.default_rng(5)
    state = murmur3.prefix_ints(np.array([7, 2**40 + 3, 12345], dtype=object), np.array([3, 900, 17]))
    rows = rng.integers(0, 3, 20_000)
    cols = rng.integers(0, 49_152, 20_000)
    h_np = murmur3.hash_pairs_np(state, rows, cols, 49_152)
    h_t = murmur3.hash_pairs_torch(state, torch.from_numpy(rows), torch.from_numpy(cols))
    np.testing.assert_array_equal(h_t.numpy(), h_np.astype(np.int64))
    np.testing.assert_allclose(_torch_gumbel32(h_t).numpy(), gumbel32(uniform32(h_np)), rtol=2e-6, atol=2e-6)
