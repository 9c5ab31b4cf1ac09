"""verinfer diagnose: the core on synthetic logits (a stand-in backend whose prefill yields stored
logits), then end to end on the bundled model, and bad input."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import binom
from typer.testing import CliRunner

from verinfer.models.backend import PrefillBlock
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import RowKeys, get_profile
from verinfer.sampling.sampler import picks_at_offsets, sample
from verinfer.scoring.diagnosis import (
    ALPHA,
    CLAIM,
    EPS,
    HONEST_OFF_BOUNDARY,
    Candidate,
    Tally,
    bug_loglik,
    bug_rate,
    bug_test,
    candidate_grid,
    off_boundary,
    penalized,
    rank,
    shifted,
    token_loglik,
    vuong,
)
from verinfer.scoring.diagnosis_run import diagnose, diagnose_traces, resolve_bands
from verinfer.scoring.fit import family_of
from verinfer.trace import Trace

VOCAB = 300
CLAIM_PARAMS = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=7000)


class StoredLogits:
    """A backend stand-in: ``prefill`` yields each trace's stored logits in blocks, as Backend.prefill does."""

    model_id, dtype_name, vocab_size, max_length = "synthetic", "float32", VOCAB, None
    decodes, reference_name = True, "transformers"  # as Backend: it claims to decode, but is never asked to

    def __init__(self, logits: list[torch.Tensor]):
        self.logits = logits

    def prefill(self, sequences, starts, token_budget=4096, row_block=512, on_device=False, **_):
        for i, lg in enumerate(self.logits):
            for lo in range(0, lg.shape[0], 40):  # several blocks per trace: sums must not depend on blocking
                hi = min(lo + 40, lg.shape[0])
                yield PrefillBlock(torch.full((hi - lo,), i), torch.arange(lo, hi), lg[lo:hi], torch.zeros(hi - lo, 1))


def synthetic(true: Candidate, n_traces: int = 8, length: int = 80, seed: int = 0, bug_rate: float = 0.05,
              noise: float = 0.0, scale: float = 2.5):
    """Traces claiming CLAIM_PARAMS whose tokens were sampled under ``true`` from random logits (a
    penalty sees each trace's own earlier tokens, as an engine's does; a bug replaces a ``bug_rate`` of
    tokens by one drawn uniformly among the top K raw logits, as ``simulate.variants.TopKUniformBug``).
    ``noise``: the provider samples from the logits plus Gaussian noise of that std (an honest
    lower-precision provider), the verifier replays the clean ones."""
    gen = torch.Generator().manual_seed(seed)
    claimed = [CLAIM_PARAMS.with_(seed=CLAIM_PARAMS.seed + i) for i in range(n_traces)]
    actual = true.params(claimed)
    logits, traces = [], []
    for i in range(n_traces):
        lg = torch.randn(length, VOCAB, generator=gen) * scale
        served = lg + noise * torch.randn(length, VOCAB, generator=gen) if noise else lg
        prompt = [int(t) for t in torch.randint(VOCAB, (5,), generator=gen)]
        profile = get_profile(actual[i].profile)
        if true.penalty:  # row by row: a penalty depends on the tokens before
            out: list[int] = []
            for k in range(length):
                row = penalized(served[k:k + 1], [(prompt, out)], *true.penalty)
                keys = RowKeys((f"t{i}",), np.array([actual[i].seed], dtype=object), np.array([len(prompt) - 1 + k]),
                               np.array([k]))
                out.append(int(sample(row, [actual[i]], profile, keys)[0]))
        else:
            keys = RowKeys((f"t{i}",) * length, np.array([actual[i].seed] * length, dtype=object),
                           np.arange(length) + len(prompt) - 1 + (true.shift or 0), np.arange(length))
            out = sample(served, [actual[i]] * length, profile, keys).tolist()
        if true.bug:  # the bug: a rate of tokens uniform among the top K raw logits
            fires = (torch.rand(length, generator=gen) < bug_rate).tolist()
            picks = lg.topk(true.bug).indices.gather(1, torch.randint(true.bug, (length, 1), generator=gen))[:, 0]
            out = [int(p) if f else t for t, f, p in zip(out, fires, picks.tolist())]
        logits.append(lg)
        traces.append(Trace.of_output(f"t{i}", StoredLogits.model_id, prompt, out, claimed[i]))
    return StoredLogits(logits), traces


def by_label(label: str) -> Candidate:
    return next(c for c in candidate_grid(CLAIM_PARAMS) if c.label == label)


# -- the core ------------------------------------------------------------------------------------------


def test_token_loglik_is_zero_at_a_match_and_floored_for_what_noise_cannot_explain():
    ll = token_loglik(np.array([0.0, 0.05, 0.2, 5.0, np.inf]), sigma=0.1, eps=EPS)
    assert ll[0] == pytest.approx(0.0, abs=1e-12)
    assert ll[0] > ll[1] > ll[2] > ll[3]
    assert ll[3] == ll[4] == pytest.approx(np.log(EPS))


def test_penalties_follow_vllm():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    prompt, out = [0], [1, 1, 2]
    rep = penalized(x, [(prompt, out)], "repetition", 2.0)
    assert rep.tolist() == [[1.0, -2.0, 0.25, 3.0]]  # prompt and output tokens; positive /, negative *
    freq = penalized(x, [(prompt, out)], "frequency", 0.5)
    assert freq.tolist() == [[2.0, -2.0, 0.0, 3.0]]  # output counts only (token 1 twice)
    pres = penalized(x, [(prompt, out)], "presence", 0.5)
    assert pres.tolist() == [[2.0, -1.5, 0.0, 3.0]]
    assert penalized(x, [(prompt, [])], "presence", 0.5).tolist() == x.tolist()


def test_grid_starts_with_the_claim_and_every_candidate_differs_and_is_replayable():
    grid = candidate_grid(CLAIM_PARAMS, ["bf16"])
    assert grid[0] == CLAIM
    assert len(grid) == len(set(grid)) >= 50
    pair = [CLAIM_PARAMS, CLAIM_PARAMS.with_(seed=CLAIM_PARAMS.seed + 1)]
    for c in grid[1:]:
        if c.replays and not c.penalty and c.band is None:
            assert c.params(pair) != pair, c.label
    assert {"seed +1", "seed -1", "seed +1000003", "one seed for every request"} <= {c.label for c in grid}
    assert {c.axis for c in grid} == {"claim", "temperature", "top_k", "top_p", "min_p", "seed", "profile",
                                      "penalty", "bug", "model"}
    greedy = candidate_grid(SamplingParams(profile="greedy"))
    assert {c.axis for c in greedy} == {"claim", "penalty", "bug"}


def test_seed_maps():
    claimed = [CLAIM_PARAMS.with_(seed=s) for s in (10, 11, 12)]
    assert [p.seed for p in Candidate("x", "seed", seed_map="+1").params(claimed)] == [11, 12, 13]
    assert [p.seed for p in Candidate("x", "seed", seed_map="-1").params(claimed)] == [9, 10, 11]
    assert [p.seed for p in Candidate("x", "seed", seed_map="same").params(claimed)] == [10, 10, 10]


def test_vuong_and_rank_keep_the_claim_first_among_equals():
    claim, same, better = Tally(), Tally(), Tally()
    ll0 = np.array([0.0, -9.0, -9.0, 0.0])
    claim.add(np.array([1, 0, 0, 1]), np.zeros(4), ll0, ll0)
    same.add(np.array([1, 0, 0, 1]), np.zeros(4), ll0, ll0)
    better.add(np.ones(4), np.zeros(4), np.zeros(4), ll0)
    assert vuong(same) == (0.0, 1.0)
    assert vuong(better)[1] < 0.5
    d = rank({CLAIM: claim, Candidate("same", "top_k", (("top_k", 9),)): same})
    assert d.best.candidate == CLAIM and not d.claim_rejected


@pytest.mark.parametrize("label", ["top-k 20", "top-p 0.8", "temperature 0.8", "seed +1", "one seed for every request",
                                   "profile vllm-v1", "repetition penalty 1.3", "frequency penalty 0.5"])
def test_synthetic_misconfigurations_are_recovered(label):
    """Each served configuration is named: a sampler family's member by a fitted value whose interval holds
    the served one (issue #41 item 1), the others by their candidate."""
    true = by_label(label)
    backend, traces = synthetic(true)
    d = diagnose_traces(backend, traces, candidate_grid(CLAIM_PARAMS))
    tied = [r.candidate for r in d.ranked if r.loglik == d.best.loglik]
    family = family_of(true)

    def names(c: Candidate) -> bool:
        if family is None:
            return c == true
        return family.value_of(c) is not None and c.interval[0] <= family.value_of(true) <= c.interval[1]

    assert any(names(c) for c in tied) and len(tied) <= 2, d.text  # presence and frequency tie where no repeat changed a token
    assert d.best.candidate.axis == true.axis
    assert d.claim_rejected and d.explained and d.best.exact > 0.99
    assert d.text.startswith("best explained by " + d.best.candidate.named)
    fitted = {f["family"] for f in d.settings["fits"]}
    assert (family is None or family.axis in fitted) and d.settings["screened"] >= sum(f["screened"] - 1 for f in d.settings["fits"])


@pytest.mark.parametrize("label, n_traces", [("bug: tokens uniform in top 2", 24),
                                             ("bug: tokens uniform in top 32", 16)])
def test_synthetic_sampler_bug_is_recovered_with_enough_events(label, n_traces):
    backend, traces = synthetic(by_label(label), n_traces=n_traces, seed=1)  # 5% of 1,920 / 1,280 tokens
    d = diagnose_traces(backend, traces, candidate_grid(CLAIM_PARAMS))
    assert d.best.candidate.label == label and d.claim_rejected and d.explained, d.text


# The claim and the bug candidates: a bug's count, rate and p-value come from the claim's replay alone,
# so the other candidates' replays (most of the cost) are left out; p-values are scaled to the full grid.
BUG_GRID = [c for c in candidate_grid(CLAIM_PARAMS) if c.axis in ("claim", "bug")]
FULL_GRID_BONFERRONI = (len(candidate_grid(CLAIM_PARAMS)) - 1) / (len(BUG_GRID) - 1)


@pytest.mark.parametrize("k, n_traces, scale", [(2, 200, 4.0), (32, 100, 2.5)])
def test_a_rare_sampler_bug_is_named_given_enough_tokens(k, n_traces, scale):
    """1% of tokens uniform in the top 2 over 16,000 tokens, or in the top 32 over 8,000, are named with
    the right K at p < 0.01 after Bonferroni over the whole grid (the flat floor never could: a top-32
    bug's 0.01 / 32 per token is barely above it, RESULTS 20). Only changes where the claim's pick is
    the top logit count, so a top-2 bug, which mostly swaps the top two, is seen where the logits are
    peaked (std 4 here; on the flatter std-2.5 logits it took about 48,000 tokens, and on SmolLM2's
    chat traces 3,855 tokens were not enough: RESULTS 20)."""
    label = f"bug: tokens uniform in top {k}"
    backend, traces = synthetic(by_label(label), n_traces=n_traces, seed=1, bug_rate=0.01, scale=scale)
    d = diagnose_traces(backend, traces, BUG_GRID)
    assert d.best.candidate.label == label and d.explained, d.text
    assert d.best.p * FULL_GRID_BONFERRONI < ALPHA, d.text
    assert d.best.events > d.best.expected and d.text.startswith(f"best explained by {label}")


def test_honest_noise_changes_tokens_but_names_no_bug():
    """An honest lower-precision provider (logits off by Gaussian noise of std 0.1) changes tokens at
    near-ties and across filter boundaries, some beyond the noise model (unexplained); none of them
    where the claim's pick is the top logit, so no bug is named. Counting every unexplained
    token instead, as the flat floor did, would name one."""
    backend, traces = synthetic(CLAIM, n_traces=200, noise=0.1)
    d = diagnose_traces(backend, traces, BUG_GRID)
    unexplained = round(d.claim.unexplained * d.claim.tokens)
    assert d.claim.exact < 0.97 and unexplained >= 20, d.text
    assert bug_test(unexplained, d.claim.tokens) * FULL_GRID_BONFERRONI < ALPHA
    assert not d.claim_rejected and d.best.candidate == CLAIM and d.explained, d.text
    assert all(r.events == 0 and r.p == 1.0 for r in d.ranked if r.candidate.bug)


def test_only_unexplained_tokens_emitted_where_the_pick_is_the_top_logit_count_for_a_bug():
    ll = np.log([1.0, EPS, EPS, 0.3])  # a match, two unexplained tokens, one the noise explains
    only = off_boundary(ll, pick_is_top=np.array([True, True, False, True]))
    assert only.tolist() == [False, True, False, False]


def test_bug_rate_is_the_ml_estimate_and_the_test_is_the_binomial_tail():
    rho = bug_rate(10, 12, 5000, 2)
    grid = np.linspace(0, 0.05, 50001)
    assert grid[np.argmax([bug_loglik(r, 10, 12, 5000, 2) for r in grid])] == pytest.approx(rho, abs=2e-6)
    assert 0 < rho < 10 / 5000
    assert bug_rate(0, 3, 5000, 2) == 0.0 and bug_loglik(0.0, 0, 3, 5000, 2) == 0.0
    assert bug_loglik(rho, 10, 12, 5000, 2) > bug_loglik(bug_rate(10, 12, 5000, 32), 10, 12, 5000, 32)  # K=2 fits
    assert bug_test(0, 5000) == 1.0
    assert bug_test(5, 5000) == pytest.approx(binom.sf(4, 5000, HONEST_OFF_BOUNDARY))
    assert bug_test(5, 5000) < bug_test(4, 5000) and bug_test(4, 2000) < bug_test(4, 5000)


def test_sglang_kept_set_sorts_once_and_its_ranks_are_the_lazy_ones():
    """SGLang's keep counts and hash columns come from one sort per row (the replay's costliest step):
    the replay equals the one whose ranks are sorted again lazily, as before."""
    from verinfer.sampling.profiles import sglang
    from verinfer.sampling.sampler import replay

    class Lazy(sglang.SglangProfile):
        def kept_set(self, x, top_k, top_p, min_p):
            kept = super().kept_set(x, top_k, top_p, min_p)
            getattr(kept, sglang._RANKS)["rows"].clear()  # every rank sorted again when the noise needs it
            return kept

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, VOCAB, generator=gen) * 3
    params = [CLAIM_PARAMS.with_(profile="sglang", top_k=k, top_p=p) for k, p in [(50, 0.95), (-1, 0.8)] * 20]
    keys = RowKeys(tuple(f"r{i}" for i in range(40)), np.array([7 + i for i in range(40)], dtype=object),
                   np.arange(40) + 5, np.arange(40))
    claimed = x.argmax(-1)
    new, old = (replay(x, params, prof, keys, claimed=claimed) for prof in (sglang.SglangProfile(), Lazy()))
    kept = sglang.SglangProfile().kept_set(x, torch.tensor([50] * 40), torch.full((40,), 0.95), torch.zeros(40))
    assert torch.equal(torch.stack([getattr(kept, sglang._RANKS)["rows"][r] for r in range(40)]),
                       sglang.sorted_ranks(x))
    for field in ("token", "margin", "filter_distance", "logprob", "logit_rank", "gumbel_rank"):
        assert torch.equal(getattr(new, field), getattr(old, field)), field


def test_synthetic_honest_traces_keep_the_claim():
    backend, traces = synthetic(CLAIM)
    d = diagnose_traces(backend, traces, candidate_grid(CLAIM_PARAMS))
    assert not d.claim_rejected and d.explained
    assert d.claim.exact == 1.0 and d.text.startswith("the claim explains it")


@pytest.mark.parametrize("profile", ["vllm", "sglang"])
def test_picks_at_offsets_are_the_samplers_own_picks_at_the_moved_positions(profile):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(24, VOCAB, generator=gen) * 2.5
    params = [CLAIM_PARAMS.with_(profile=profile, seed=CLAIM_PARAMS.seed + i % 3, top_k=-1 if i % 4 == 0 else 50)
              for i in range(24)]
    keys = RowKeys(tuple(f"t{i % 3}" for i in range(24)), np.array([p.seed for p in params], dtype=object),
                   np.arange(24) + 9, np.arange(24))
    picks = picks_at_offsets(logits, params, get_profile(profile), keys, range(-3, 4))
    for i, d in enumerate(range(-3, 4)):
        full = sample(logits, params, get_profile(profile), replace(keys, positions=keys.positions + d))
        screened = picks[i] >= 0  # rows whose kept set fits the top view: every top-k 50 row, some top-p ones
        assert bool(screened[[p.top_k > 0 for p in params]].all())
        assert torch.equal(picks[i][screened], full[screened])


@pytest.mark.parametrize("d", [7, -3])
def test_prompts_of_another_length_are_found_by_the_offset_search(d):
    """A position-keyed engine serving prompts ``d`` tokens longer: every draw moved by ``d``. The search
    names the offset, and the candidate is tested with every offset screened in the Bonferroni count."""
    backend, traces = synthetic(shifted(d))
    d_ = diagnose_traces(backend, traces, candidate_grid(CLAIM_PARAMS))
    assert d_.best.candidate == shifted(d) and d_.claim_rejected and d_.explained, d_.text
    assert d_.settings["prompt_shift"]["best"] == d and d_.settings["prompt_shift"]["tried"]
    fits = sum(f["screened"] - 1 for f in d_.settings["fits"])  # the families the offset's noise made look better
    assert d_.tried == len(d_.ranked) + d_.settings["prompt_shift"]["searched"] - 1 + fits == len(d_.ranked) + d_.settings["screened"]
    assert d_.text.startswith(f"best explained by prompts {abs(d)} tokens")
    honest = diagnose_traces(*synthetic(CLAIM), [CLAIM])
    assert not honest.settings["prompt_shift"]["tried"] and honest.tried == 1 and len(honest.ranked) == 1
    greedy = diagnose_traces(backend, [replace(t, sampling=t.sampling.with_(profile="greedy", seed=None))
                                       for t in traces], [CLAIM])
    assert greedy.settings["prompt_shift"] is None  # nothing position-keyed to search


def test_a_configuration_outside_the_grid_is_explained_by_no_candidate():
    backend, traces = synthetic(Candidate("seed +17", "seed", seed_map="+17"))  # offsets tried: +-1, +1000003
    d = diagnose_traces(backend, traces, candidate_grid(CLAIM_PARAMS))
    assert not d.explained and d.text.startswith("no candidate explains it")


def test_bands_are_checked_before_any_work():
    assert resolve_bands("default") == ["bf16", "w8-channel", "w4-g128", "fp8-kv"]
    assert "w4-g32-asym" in resolve_bands("catalogue") and "temperature-1.1" not in resolve_bands("catalogue")
    with pytest.raises(ValueError, match="unknown model variant 'w5'"):
        resolve_bands("bf16,w5")
    with pytest.raises(ValueError, match="does not change the model"):
        resolve_bands("top-p-0.85")


# -- end to end on the bundled model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    from verinfer.api import load_model

    return load_model()


def _requests(model, n: int = 6):
    from verinfer.prompts import load_prompts
    from verinfer.simulate.generate import build_requests

    return build_requests(model, load_prompts("chitchat", n), CLAIM_PARAMS)


@functools.cache  # one generation per variant, shared by the tests (the honest one by three); traces are not mutated
def _traces(model, variant: str, n: int = 6, tokens: int = 48):
    from verinfer.simulate.variants import get_variant

    return get_variant(variant).generate(model, _requests(model, n), max_new_tokens=tokens, batch_size=n)


def test_bundled_model_honest_traces_keep_the_claim(model):
    d = diagnose(_traces(model, "honest"), model)
    assert not d.claim_rejected and d.explained, d.text
    assert d.settings["template_search"] is None and d.settings["model_search"] is None  # searches cost honest traces nothing


@pytest.mark.parametrize("variant, label", [("temperature-0.8", "temperature 0.8"), ("wrong-seed", "seed +1000003")])
def test_bundled_model_sampler_misconfiguration_is_recovered(model, variant, label):
    d = diagnose(_traces(model, variant), model)
    assert d.best.candidate.label == label and d.claim_rejected, d.text


def _served_as(model, change: dict):
    """Honest requests served with ``change`` (``seed_shift``: every seed + that), claiming CLAIM_PARAMS."""
    from verinfer.simulate.generate import Request, generate

    honest = _traces(model, "honest")
    requests = [Request(t.id, tuple(t.prompt_token_ids), t.sampling.with_(seed=t.sampling.seed + change["seed_shift"])
                        if "seed_shift" in change else t.sampling.with_(**change)) for t in honest]
    return [replace(t, sampling=h.sampling) for t, h in zip(generate(model, requests, 48, len(requests)), honest)]


def test_bundled_model_hidden_system_prompt_is_found_with_its_length(model):
    """A provider that puts its own system message in (here in place of SmolLM2's default one) draws vLLM's
    position-keyed noise at other positions: diagnose names the prompts' length difference, exactly, and
    calls the remaining mismatches the other text's (context-shaped)."""
    from verinfer.simulate.variants import get_variant

    traces = _traces(model, "system-prompt:Be concise.")
    served = get_variant("system-prompt:Be concise.").prompt(model, _requests(model)[0])
    d = diagnose(traces, model)
    truth = len(served.prompt_token_ids) - len(traces[0].prompt_token_ids)
    assert truth != 0 and d.best.candidate == shifted(truth) and d.claim_rejected, d.text
    assert d.best.exact > d.claim.exact + 0.3 and "context-shaped" in d.text


def _coarse_only(monkeypatch, keep):
    """The model search's first level cut to the members ``keep`` passes, to keep CI's time (the whole
    level is listed in test_fit and screened in RESULTS 36's runs; here the trigger and the kind of member
    are what is tested)."""
    from verinfer.scoring import diagnosis_run
    from verinfer.scoring.fit import model_coarse

    monkeypatch.setattr(diagnosis_run, "model_coarse", lambda layers: [m for m in model_coarse(layers) if keep(m)])


def test_bundled_model_other_weights_are_found_by_the_model_search_else_classed_weights_shaped(model, tmp_path,
                                                                                                  monkeypatch):
    """No --variants: no sampler candidate explains 4-bit weights, so the derived models are searched
    (every RTN bit width, grouping and rounding, and a few depths; the removed layers and fp8 KV caches of
    the full first level are tested below) and the right one is named, counted
    in the Bonferroni correction with all it was screened against (issue #41 item 1). Without the
    search nothing names it, and the class carries the answer (item 2)."""
    _coarse_only(monkeypatch, lambda m: m.startswith(("w", "layers-")))  # the 53 members this test was built on
    traces = _traces(model, "w4-g128")
    d = diagnose(traces, model)
    b, found = d.best.candidate, d.settings["model_search"]
    assert b.band == "w4-g128" and "w4-g128" in b.near and d.claim_rejected and d.explained, d.text
    assert d.text.startswith("best explained by model w4-g128 (searched;") and found["tried"]
    assert found["screened"] >= 48 and d.tried >= len(d.ranked) + found["screened"] - 1
    from verinfer.trace import write_traces

    path = write_traces(traces, tmp_path / "w4.jsonl")
    result = _cli(str(path), "--no-search-models", "-o", str(tmp_path / "d.json"))
    off = json.loads((tmp_path / "d.json").read_text())
    assert result.exit_code == 1 and off["settings"]["model_search"] is None, result.output
    assert not off["explained"] and off["conclusion"].startswith("no candidate explains it"), off["conclusion"]
    assert off["deviation_class"]["kind"] == "weights" and "; the deviation is weights-shaped:" in off["conclusion"]
    assert off["replay_counts"]["tokens"] == sum(len(t.output_token_ids) for t in traces)


def test_bundled_model_a_removed_middle_layer_is_located_by_the_model_search(model, monkeypatch):
    """Layer damage is searched, not listed (issue #41 item 1): every single layer's removal is screened,
    and the one the provider's model lost is named, alone."""
    _coarse_only(monkeypatch, lambda m: m.startswith("skip-layer-"))
    d = diagnose(_traces(model, "skip-layer-13"), model)
    b = d.best.candidate
    assert b.band == "skip-layer-13" and b.near == ("skip-layer-13",) and d.claim_rejected, d.text
    assert d.best.exact == 1.0 and d.settings["model_search"]["screened"] >= 30


def test_bundled_model_fp8_kv_cache_flagged_by_the_verdict_is_searched_and_named(model, monkeypatch):
    """An fp8 KV cache leaves few tokens unexplained (numerics), so nothing triggers the search on the
    likelihood alone; a flag from the calibrated verdict does, and the search's decode replay names it
    (significant over the 130-odd candidates a full search counts from about 600 tokens on)."""
    _coarse_only(monkeypatch, lambda m: m.startswith(("fp8-kv", "w8-", "skip-layer-2")))
    traces = _traces(model, "fp8-kv", 16)
    quiet = diagnose(traces, model)
    assert quiet.settings["model_search"] is None and not quiet.claim_rejected, quiet.text
    d = diagnose(traces, model, flagged=True)
    b = d.best.candidate
    assert b.band == "fp8-kv" and "fp8-kv" in b.near and d.claim_rejected, d.text
    assert d.best.exact > quiet.claim.exact


def test_bundled_model_another_chat_template_is_found_by_the_template_search(model):
    """A server that renders the messages with another template (here ChatML without SmolLM2's default
    system message) answers another prompt: the template search re-renders the traces' messages and names
    it, ahead of the prompt offset the length difference also gives (which leaves the text's tokens
    unexplained); the class is context."""
    d = diagnose(_traces(model, "chat-template:chatml"), model)
    b, found = d.best.candidate, d.settings["template_search"]
    assert b.template == "chatml" and b.axis == "prompt" and d.claim_rejected and d.best.exact == 1.0, d.text
    assert d.text.startswith("best explained by prompts rendered by the ChatML chat template without a default "
                             "system message (searched;"), d.text
    assert found["tried"] and found["screened"] == 7 and d.settings["model_search"] is None
    assert d.shaped.kind == "context" and "reproduces the tokens" in d.shaped.evidence


def test_bundled_model_seed_offset_not_in_the_catalogue_is_recovered(model):
    d = diagnose(_served_as(model, {"seed_shift": 1}), model)
    assert d.best.candidate.label == "seed +1" and d.claim_rejected, d.text


def test_cli_recovers_a_top_k_not_in_the_catalogue_and_writes_json(model, tmp_path):
    from verinfer.trace import write_traces

    path = write_traces(_served_as(model, {"top_k": 20}), tmp_path / "t.jsonl")
    result = _cli(str(path), "-o", str(tmp_path / "d.json"), "--rows", "3")
    assert result.exit_code == 1, result.output  # the claim is rejected
    assert "best explained by top-k 20 (fitted; 95% interval" in result.output and "Bonferroni" in result.output
    saved = json.loads((tmp_path / "d.json").read_text())
    assert saved["best"]["label"] == "top-k 20" and saved["claim_rejected"] and len(saved["candidates"]) >= 30
    lo, hi = saved["best"]["interval"]
    assert lo <= 20 <= hi and saved["settings"]["fits"][0]["family"] == "top_k"


@pytest.mark.parametrize("variant", ["fp8-kv-tensor", "fp8-kv-fresh"])
def test_fp8_kv_decode_replay_reproduces_the_providers_decode(model, variant):
    """A prefill does not compute what an fp8-KV provider's decode did (scales fitted on the prompt
    pass; the current token read fresh); the teacher-forced decode replay does, token for token."""
    from verinfer.scoring.diagnosis_run import _score, decode_replay
    from verinfer.simulate.variants import get_variant

    band = get_variant(variant).build(model)
    traces = _traces(model, variant, n=3, tokens=12)
    exact, seen = [], set()

    def on_block(items, steps, logits):
        cols, _, _ = _score(logits, items, steps, traces, {}, 0.1, EPS)
        exact.extend(cols["exact_match"].tolist())
        seen.update(zip(items.tolist(), steps.tolist()))

    decode_replay(band, traces, on_block)
    assert seen == {(i, k) for i, t in enumerate(traces) for k in range(len(t.output_token_ids))}
    assert all(exact)  # the claimed sampler on the replayed logits emits every token the provider did


def test_bundled_model_band_names_the_quantized_model(model):
    d = diagnose(_traces(model, "w4-g128"), model, bands=["bf16", "w4-g128"])
    assert d.best.candidate.label == "model w4-g128" and d.claim_rejected, d.text


# -- bad input -----------------------------------------------------------------------------------------


def _cli(*args):
    import typer

    from verinfer.cli.diagnose import diagnose as command

    app = typer.Typer()
    app.command()(command)
    app.command("unused")(lambda: None)  # two commands: typer keeps the command name, as under `verinfer`
    return CliRunner().invoke(app, ["diagnose", *args])


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    missing = _cli(str(tmp_path / "none.jsonl"))
    assert missing.exit_code == 2 and "does not exist" in missing.output and "Traceback" not in missing.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    broken = _cli(str(bad))
    assert broken.exit_code == 2 and "bad.jsonl" in broken.output
    good = tmp_path / "t.jsonl"
    good.write_text(json.dumps(Trace.of_output("a", "smollm2-135m", [1, 2], [3], CLAIM_PARAMS).to_dict()) + "\n")
    assert _cli(str(good), "--variants", "w5").exit_code == 2
    same = _cli(str(good), "-o", str(good))
    assert same.exit_code == 2 and "error" in same.output
