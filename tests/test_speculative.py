"""Speculative decoding (issue 17): vLLM V2's rejection sampler, the speculative provider and its verification."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams, parse_speculative
from verinfer.sampling.profiles import params_problems
from verinfer.sampling.speculative import processed_logits, rejection_sample, residual_logits
from verinfer.scoring.token_difr import verify_traces
from verinfer.simulate import variants
from verinfer.simulate.generate import build_requests
from verinfer.simulate.speculative import generate_speculative
from verinfer.trace import Trace, TraceError, read_traces, write_traces

SPEC = {"draft": "layers:28", "k": 3}
PARAMS = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=11, speculative=SPEC)


def _columns(backend, traces):
    blocks = list(verify_traces(backend, traces))
    return {k: np.concatenate([b.columns[k] for b in blocks]) for k in blocks[0].columns}


# -- the sampler itself ------------------------------------------------------------------------------

def test_identical_draft_is_always_accepted():
    """p = q: the ratio test ``log p > log u + log q`` holds for every u < 1, so all k drafts pass."""
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.standard_normal((5, 300)).astype(np.float32))
    for seed in range(20):
        drafts = [int(torch.multinomial(logits[j].softmax(-1), 1, generator=torch.Generator().manual_seed(seed)))
                  for j in range(4)]
        block = rejection_sample(logits, logits[:4], drafts, seed=seed, pos0=7, temperature=1.0)
        assert block.num_accepted == 4 and block.bonus and block.tokens[:4] == drafts and block.modes == "aaaab"


def test_greedy_accepts_iff_draft_is_target_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    assert rejection_sample(logits, None, [1, 0], seed=1, pos0=0, temperature=0.0).tokens == [1, 0, 2]
    block = rejection_sample(logits, None, [1, 2], seed=1, pos0=0, temperature=0.0)
    assert block.tokens == [1, 0] and block.num_accepted == 1 and block.modes == "ar"


def test_residual_excludes_every_token_the_draft_overweights():
    rng = np.random.default_rng(1)
    target = rng.standard_normal(500).astype(np.float32)
    draft = target + rng.standard_normal(500).astype(np.float32)
    res = residual_logits(target, draft, int(np.argmax(draft)), 1.0)
    p, q = np.exp(target - np.logaddexp.reduce(target)), np.exp(draft - np.logaddexp.reduce(draft))
    assert np.all(np.isneginf(res[q >= p * (1 + 1e-4)]))
    assert np.all(np.isfinite(res[q < p * (1 - 1e-4)]))


def test_speculative_sampler_emits_the_target_distribution():
    """Leviathan et al.'s theorem, through vLLM's exact noise: the first token of a step follows the
    target's softmax whatever the draft (chi-square over 3,000 seeds; fails if the rule is wrong)."""
    target = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0] * 6])
    draft = torch.tensor([[0.0, 2.5, 0.0, 1.0, 0.0, -2.0]])
    q = draft[0].softmax(-1).numpy()
    counts = np.zeros(6)
    for seed in range(3000):
        d = int(np.random.default_rng(seed).choice(6, p=q / q.sum()))
        counts[rejection_sample(target, draft, [d], seed=seed, pos0=3, temperature=1.0).tokens[0]] += 1
    p = target[0].double().softmax(-1).numpy()
    assert chisquare(counts, p * counts.sum()).pvalue > 1e-4


def test_processed_logits_apply_temperature_and_filters():
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0]])
    x = processed_logits(logits, SamplingParams(temperature=2.0, top_k=2, seed=0))
    assert x[0, :2].tolist() == [2.0, 1.5] and torch.isinf(x[0, 2:]).all()
    assert torch.equal(processed_logits(logits, SamplingParams(temperature=0.0)), logits)


# -- claims and traces -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,problem", [
    ({"draft": "layers:28"}, "speculative.k"),
    ({"draft": "", "k": 2}, "speculative.draft"),
    ({"draft": "w4", "k": 0}, "speculative.k"),
    ({"draft": "w4", "k": 2, "depth": 1}, "unknown field"),
    ("layers:28", "must be an object"),
])
def test_malformed_speculative_claims_are_named(spec, problem):
    assert any(problem in p for p in params_problems(SamplingParams(seed=0, speculative=spec)))


def test_speculative_claims_need_the_vllm_profile():
    assert any("vllm" in p for p in params_problems(SamplingParams(profile="sglang", seed=0, speculative=SPEC)))
    assert params_problems(PARAMS) == []


def test_parse_speculative():
    assert parse_speculative("layers:28:4") == {"draft": "layers:28", "k": 4}
    assert parse_speculative("w4:2") == {"draft": "w4", "k": 2}
    for bad in ("layers", "layers:0:4", "w4:x", "w4:0", ":3"):
        with pytest.raises(ValueError, match="--speculative"):
            parse_speculative(bad)


@pytest.mark.parametrize("modes,problem", [
    ("aar", "3 letters for 4"),
    ("aaxr", "letter 2"),
    ("aabr", "bonus token after 2"),
    ("aaaa", "more than k=3"),
])
def test_spec_modes_are_validated(modes, problem):
    t = Trace("t", "m", [1, 2], [3, 4, 5, 6], PARAMS, spec_modes=modes)
    assert any(problem in p for p in t.problems())


def test_spec_modes_without_a_speculative_claim_are_refused(tmp_path):
    t = Trace("t", "m", [1, 2], [3, 4], PARAMS.with_(speculative=None), spec_modes="ar")
    assert any("claims no speculative decoding" in p for p in t.problems())
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "t", "model": "m", "prompt_token_ids": [1], "output_token_ids": [2], '
                    '"sampling": {"seed": 1}, "spec_modes": 5}\n')
    with pytest.raises(TraceError, match="spec_modes"):
        read_traces(path)


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_spec_modes_round_trip(tmp_path, suffix):
    t = Trace("t", "m", [1, 2], [3, 4, 5, 6, 7], PARAMS, spec_modes="aaabr")
    (back,) = read_traces(write_traces([t], tmp_path / f"t.{suffix}"))
    assert back.spec_modes == "aaabr" and back.sampling.speculative == SPEC


# -- the provider and the verifier on the bundled model -----------------------------------------------

@pytest.fixture(scope="module")
def requests_(backend):
    return build_requests(backend, load_prompts("chitchat", 2, seed=3), PARAMS)


@pytest.fixture(scope="module")
def honest(backend, requests_):
    return generate_speculative(backend, requests_, max_new_tokens=16)


def test_honest_speculative_outputs_replay_exactly(backend, honest):
    assert all(t.spec_modes and not t.problems(backend.vocab_size) for t in honest)
    modes = "".join(t.spec_modes for t in honest)
    assert "a" in modes and "r" in modes  # both paths exercised
    cols = _columns(backend, honest)
    assert cols["exact_match"].all() and np.all(cols["margin"] == 0)
    assert "".join(cols["spec_mode"]) == modes


def test_modes_are_reconstructed_when_the_provider_records_none(backend, honest):
    bare = [Trace.from_dict({**t.to_dict(), "spec_modes": None}, "t") for t in honest]
    cols = _columns(backend, bare)
    assert cols["exact_match"].all() and "".join(cols["spec_mode"]) == "".join(t.spec_modes for t in honest)


@pytest.mark.parametrize("variant", ["wrong-seed", "spec-draft-only", "spec-top1"])
def test_speculative_cheats_diverge(backend, requests_, variant):
    traces = variants.get_variant(variant).generate(backend, requests_, 16)
    cols = _columns(backend, traces)
    assert (~cols["exact_match"]).sum() >= 2 and (cols["margin"] > 0).sum() >= 2


def test_greedy_speculative_decoding_is_greedy_decoding(backend, requests_):
    greedy = [r.__class__(r.id, r.prompt_token_ids, r.params.with_(temperature=0.0)) for r in requests_]
    spec = generate_speculative(backend, greedy, max_new_tokens=12)
    plain = variants.get_variant("no-spec").generate(backend, greedy, 12)
    assert [t.output_token_ids for t in spec] == [t.output_token_ids for t in plain]
    assert _columns(backend, spec)["exact_match"].all()


def test_draft_models_by_name(backend):
    from verinfer.models.derived import draft_backend

    assert len(draft_backend(backend, "layers:2").model.model.layers) == 2
    assert draft_backend(backend, "smollm2-135m").vocab_size == backend.vocab_size  # a separate model
    with pytest.raises(ValueError, match="decoder layers"):
        draft_backend(backend, "layers:99")


def test_chunked_prompt_caching_gives_the_same_tokens_and_can_stop(backend, honest, requests_):
    """``decode_speculative(prefill_chunk=)`` caches the prompt in chunks (the server's cancellable
    prefill): same tokens as one pass here, ``between_chunks`` once per chunk edge, and raising there
    stops before the next chunk."""
    from verinfer.models.derived import draft_backend
    from verinfer.simulate.speculative import decode_speculative

    draft = draft_backend(backend, SPEC["draft"])
    req = requests_[0]
    edges = []
    out = decode_speculative(backend, draft, req, 16, backend.stop_ids(), prefill_chunk=16,
                             between_chunks=lambda: edges.append(1))
    assert out.tokens == honest[0].output_token_ids and out.modes == honest[0].spec_modes
    assert len(edges) == -(-(len(req.prompt_token_ids) - 1) // 16) - 1 and edges

    class Gone(Exception):
        pass

    def stop():
        raise Gone

    with pytest.raises(Gone):
        decode_speculative(backend, draft, req, 16, backend.stop_ids(), prefill_chunk=16, between_chunks=stop)
