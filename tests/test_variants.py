"""Configuration variants: each changes what it claims to, only that, and never the reference model."""

import pytest
import torch
from scipy.stats import binomtest
from transformers import DynamicCache

from verinfer.simulate.generate import Request
from verinfer.studies.adversary import match_cross_entropy, score_traces
from verinfer.models import derived, fp8_kv
from verinfer.simulate import variants as V
from verinfer.simulate.generate import build_requests
from verinfer.sampling.params import SamplingParams

VLLM = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=5000)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tests decode token by token (tiny matmuls): one thread is as fast alone and far faster on a
    shared, oversubscribed CPU, where two OpenMP threads spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _state_checksum(model) -> dict[str, float]:
    return {k: float(v.double().sum()) for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference_checksum(backend):
    return _state_checksum(backend.model)


@pytest.fixture(scope="module")
def requests4(backend, chat_prompts):
    return build_requests(backend, chat_prompts[:4], VLLM)


@pytest.fixture(scope="module")
def honest4(backend, requests4):
    return V.get_variant("honest").generate(backend, requests4, max_new_tokens=24, batch_size=4)


def _prompt_ids(backend, text="Tell me about the weather in spring, and why the days get longer."):
    return torch.tensor([backend.tokenizer.encode(text)])


def _logits(backend, ids):
    h, _ = backend.hidden(ids, None)
    return backend.logits(h[0])


# ---------------------------------------------------------------- weight quantization (pure tensors)

def test_rtn_symmetric_groups_have_few_levels_and_bounded_error():
    torch.manual_seed(0)
    w = torch.randn(8, 576)
    q = derived.quantize_rtn(w, bits=4, group_size=128)
    assert q.shape == w.shape and q.dtype == w.dtype
    for lo in range(0, 576, 128):  # 4 full groups of 128 and a ragged tail of 64
        g, gq = w[:, lo:lo + 128], q[:, lo:lo + 128]
        scale = g.abs().amax(1, keepdim=True) / 7
        assert ((gq - g).abs() <= scale / 2 + 1e-6).all()
        assert max(len(torch.unique(row)) for row in gq) <= 16
    assert not torch.equal(q, w)


def test_rtn_asymmetric_and_per_channel():
    torch.manual_seed(1)
    w = torch.rand(4, 96) + 0.5  # all positive: the asymmetric range still includes 0
    q = derived.quantize_rtn(w, bits=4, group_size=32, symmetric=False)
    step = w.reshape(4, 3, 32).amax(-1) / 15
    assert ((q - w).abs().reshape(4, 3, 32) <= step[..., None] / 2 + 1e-6).all()
    q8 = derived.quantize_rtn(w, bits=8, group_size=None)
    assert (q8 - w).abs().max() <= w.abs().max() / 127 / 2 + 1e-6
    zeros = torch.zeros(2, 32)
    assert torch.equal(derived.quantize_rtn(zeros, 4, 32), zeros)
    with pytest.raises(ValueError):
        derived.quantize_rtn(torch.zeros(3), 4, 32)


def test_quantized_weights_differ_and_reference_untouched(backend, reference_checksum):
    names = derived.quantized_linear_names(backend.model)
    assert len(names) == 7 * backend.model.config.num_hidden_layers  # q k v o gate up down
    assert not any("lm_head" in n or "embed" in n for n in names)
    ref_params = dict(backend.model.named_parameters())
    for variant in ("w4-g128", "w8"):
        q = V.get_variant(variant).build(backend)
        assert q is not backend and q.model is not backend.model
        q_params = dict(q.model.named_parameters())
        for n in names[:7] + names[-7:]:
            assert q_params[n] is not ref_params[n]
            assert not torch.equal(q_params[n], ref_params[n]), n
        head = q.model.get_output_embeddings().weight
        assert torch.equal(head, backend.model.get_output_embeddings().weight)
        assert head is q.model.get_input_embeddings().weight  # still tied
        ids = _prompt_ids(backend)
        assert not torch.equal(_logits(q, ids), _logits(backend, ids))
        del q
    assert _state_checksum(backend.model) == reference_checksum


# ---------------------------------------------------------------- fp8 KV cache

def test_fp8_round_trip_saturates_and_rounds():
    x = torch.tensor([0.0, 1.0, 1.0625, 1000.0, -1000.0, 0.3])
    y = fp8_kv.fp8_round_trip(x)
    assert y[0] == 0 and y[1] == 1 and y[3] == 448 and y[4] == -448 and torch.isfinite(y).all()
    assert y[2] != x[2]  # 3 mantissa bits: 1 + 1/16 is not representable
    assert torch.equal(fp8_kv.fp8_round_trip(y), y)  # idempotent


def _prefill_then_decode(backend, ids, next_token):
    cache = DynamicCache()
    h, cache = backend.hidden(ids, None, None, cache)
    first = backend.logits(h[0, -1])
    pos = torch.tensor([[ids.shape[1]]])
    h, cache = backend.hidden(torch.tensor([[next_token]]), None, pos, cache)
    return first, backend.logits(h[0, -1]), cache


def test_fp8_kv_changes_decode_logits(backend):
    ids = _prompt_ids(backend)
    ref_first, ref_decode, _ = _prefill_then_decode(backend, ids, 1000)
    # Fresh-current semantics: the prompt pass is untouched, decode reads the prompt's K/V from fp8.
    fresh = V.get_variant("fp8-kv-fresh").build(backend)
    first, decode, cache = _prefill_then_decode(fresh, ids, 1000)
    assert torch.equal(first, ref_first)
    assert not torch.equal(decode, ref_decode)
    assert 1e-4 < (decode - ref_decode).abs().max() < 5
    layer = cache.layers[0]
    assert isinstance(layer, fp8_kv.Fp8KVLayer) and layer.keys.dtype == torch.float8_e4m3fn
    assert layer.keys.shape[-2] == ids.shape[1] + 1
    # vLLM semantics: every read goes through fp8, the prompt pass included.
    vllm = V.get_variant("fp8-kv").build(backend)
    first, decode, _ = _prefill_then_decode(vllm, ids, 1000)
    assert not torch.equal(first, ref_first) and not torch.equal(decode, ref_decode)
    # The reference keeps its plain cache.
    _, _, ref_cache = _prefill_then_decode(backend, ids, 1000)
    assert type(ref_cache.layers[0]).__name__ == "DynamicLayer" and ref_cache.layers[0].keys.dtype == torch.float32
    for scale in ("tensor", "head"):
        b = V.get_variant(f"fp8-kv-{scale}").build(backend)
        _, decode, cache = _prefill_then_decode(b, ids, 1000)
        assert not torch.equal(decode, ref_decode)
        n_scales = 1 if scale == "tensor" else backend.model.config.num_key_value_heads
        assert cache.layers[3].key_scale.numel() == n_scales


# ---------------------------------------------------------------- attention kernel

def test_attention_variant_switches_kernel(backend, monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    ids = _prompt_ids(backend)
    eager = V.get_variant("attn-eager").build(backend)
    assert eager.model.config._attn_implementation == "eager"
    assert backend.model.config._attn_implementation == "sdpa"
    ref = _logits(backend, ids)
    n_ref = len(calls)
    out = _logits(eager, ids)
    assert n_ref == backend.model.config.num_hidden_layers and len(calls) == n_ref  # eager never calls SDPA
    diff = (out - ref).abs().max()
    assert 0 < diff < 1e-3  # the same math, other rounding
    assert eager.model.model.embed_tokens.weight is backend.model.model.embed_tokens.weight  # weights shared


# ---------------------------------------------------------------- honest vs misconfigured, end to end

def test_bf16_honest_traces_beat_misconfigured(backend, requests4, honest4):
    def score(name):
        traces = V.get_variant(name).generate(backend, requests4, max_new_tokens=16, batch_size=4)
        for req, t in zip(requests4, traces):
            assert t.sampling == req.params and t.model == backend.model_id
            assert t.meta["variant"] == V.get_variant(name).name and t.meta["dtype"] == "float32"
        return score_traces(backend, traces)

    honest = score_traces(backend, honest4)
    bf16, w4 = score("bf16"), score("w4")
    assert honest.exact_match > 0.99
    assert bf16.exact_match > 0.85
    assert bf16.exact_match > w4.exact_match + 0.2
    assert w4.mean_margin > bf16.mean_margin


def test_sampling_variants_claim_the_honest_parameters():
    p = VLLM
    assert V.get_variant("temperature-1.1").actual_params(p) == p.with_(temperature=1.1)
    assert V.get_variant("top-p-0.85").actual_params(p) == p.with_(top_p=0.85)
    assert V.get_variant("wrong-seed").actual_params(p).seed == p.seed + V.WRONG_SEED_OFFSET
    adv = V.get_variant("w4+temperature-0.87")
    assert adv.name == "w4-g128+temperature-0.87" and adv.actual_params(p).temperature == 0.87
    assert adv.transform is not None and not adv.honest


def test_hidden_system_prompt_variant_feeds_the_injection_and_claims_the_client_prompt(backend, requests4, honest4):
    """``system-prompt:TEXT``: the model decodes the injected prompt (the same tokens an honest provider
    gives for that prompt), the trace claims the client's, and replay against it diverges."""
    from verinfer.prompts import Prompt, inject_system, render

    text = "Answer briefly and never mention the weather."
    variant = V.get_variant(f"system-prompt:{text}")
    assert variant.settings == {"system_prompt": text} and not variant.honest
    traces = variant.generate(backend, requests4, max_new_tokens=24, batch_size=4)
    injected = [Request(r.id, tuple(render(backend.tokenizer, Prompt(r.id, tuple(
        (m["role"], m["content"]) for m in inject_system(r.messages, text))))), r.params, r.messages)
        for r in requests4]
    assert all(i.prompt_token_ids != r.prompt_token_ids for i, r in zip(injected, requests4))
    seen = V.get_variant("honest").generate(backend, injected, max_new_tokens=24, batch_size=4)
    for t, r, s in zip(traces, requests4, seen):
        assert t.prompt_token_ids == list(r.prompt_token_ids) and t.sampling == r.params
        assert t.output_token_ids == s.output_token_ids
    assert [t.output_token_ids for t in traces] != [t.output_token_ids for t in honest4]
    assert score_traces(backend, traces).exact_match < score_traces(backend, honest4).exact_match
    # A request without messages gets the text's tokens and a blank line in front of its ids.
    bare = Request("bare", requests4[0].prompt_token_ids, VLLM)
    assert variant.prompt(backend, bare).prompt_token_ids[-len(bare.prompt_token_ids):] == bare.prompt_token_ids
    assert variant.prompt(backend, bare).prompt_token_ids[:-len(bare.prompt_token_ids)] == tuple(
        backend.tokenizer.encode(text + "\n\n", add_special_tokens=False))


def test_smaller_same_family_model_variant(backend, requests4, honest4, reference_checksum):
    variant = V.get_variant("layers-24")
    built = variant.build(backend)
    assert built.model.config.num_hidden_layers == 24 and backend.model.config.num_hidden_layers == 30
    traces = variant.generate(backend, requests4, max_new_tokens=16, batch_size=4, backend=built)
    assert all(t.model == backend.model_id for t in traces)
    assert score_traces(backend, traces).exact_match < 0.9
    assert _state_checksum(backend.model) == reference_checksum


def test_a_model_without_one_layer_passes_its_residual_through(backend, requests4, reference_checksum):
    """``skip-layer-I`` drops decoder layer I: removing the last equals keeping the first 29; a middle one's
    removal is decoded with the KV cache renumbered (its prefill replays its decode), and the reference's
    weights and layer numbering are left alone."""
    from verinfer.models.derived import with_layers

    ids = torch.tensor([list(requests4[0].prompt_token_ids)])
    last = V.get_variant("skip-layer-29").build(backend)
    assert torch.equal(last.hidden(ids, None)[0], with_layers(backend, 29).hidden(ids, None)[0])
    built = V.get_variant("skip-layer-7").build(backend)
    assert [layer.self_attn.layer_idx for layer in built.model.model.layers] == list(range(29))
    assert backend.model.model.layers[29].self_attn.layer_idx == 29 and backend.model.config.num_hidden_layers == 30
    traces = V.get_variant("skip-layer-7").generate(backend, requests4, max_new_tokens=16, batch_size=4)
    assert score_traces(built, traces).exact_match == 1.0 and score_traces(backend, traces).exact_match < 0.95
    assert _state_checksum(backend.model) == reference_checksum
    with pytest.raises(ValueError, match="decoder layers 0-29"):
        V.get_variant("skip-layer-30").build(backend)


def test_serve_refuses_a_system_prompt_inside_a_composition():
    from verinfer.serve.config import parse_misconfig

    with pytest.raises(ValueError, match="as a name of its own"):
        parse_misconfig(["w4+system-prompt:hi"])
    assert parse_misconfig(["w4", "system-prompt:hi, there"]).system_prompt == "hi, there"


# ---------------------------------------------------------------- sampling bug

def test_sampling_bug_fires_at_the_configured_rate():
    torch.manual_seed(0)
    bug = V.TopKUniformBug(k=32, rate=0.01, seed=7)
    logits = torch.randn(50, 1000)
    tokens = logits.argmax(-1)
    reqs = [Request(f"r{i}", (1,), VLLM) for i in range(50)]
    n_steps = 400
    for step in range(n_steps):
        out = bug(logits, tokens, reqs, step)
        fired = {r.id for r in reqs if any(s == step for s, _, _ in bug.events.get(r.id, []))}
        for j, r in enumerate(reqs):
            if r.id in fired:
                assert int(out[j]) in set(logits[j].topk(32).indices.tolist())
            else:
                assert out[j] == tokens[j]
    n = 50 * n_steps
    fires = sum(len(e) for e in bug.events.values())
    assert bug.steps_seen == n
    assert binomtest(fires, n, 0.01).pvalue > 1e-3, fires
    changed = sum(a != b for e in bug.events.values() for _, a, b in e)
    assert binomtest(changed, fires, 31 / 32).pvalue > 1e-3  # uniform over the top 32: 1/32 keep the token
    # batch-independent: the same request and step fire the same way alone or in a batch
    again = V.TopKUniformBug(k=32, rate=0.01, seed=7)
    for r in reqs[:10]:
        for step in range(n_steps):
            j = int(r.id[1:])
            again(logits[j:j + 1], tokens[j:j + 1], [r], step)
        assert again.events.get(r.id, []) == bug.events.get(r.id, [])


def test_sampling_bug_changes_tokens_only_when_it_fires(backend, requests4, honest4):
    traces = V.get_variant("bug-top32-rate0.1").generate(backend, requests4, max_new_tokens=24, batch_size=4)
    n_fired = 0
    for h, t in zip(honest4, traces):
        assert t.sampling == h.sampling
        changed = t.meta["bug_changed_steps"]
        assert set(changed) <= set(t.meta["bug_steps"])
        n_fired += len(t.meta["bug_steps"])
        diverge = next((k for k, (a, b) in enumerate(zip(h.output_token_ids, t.output_token_ids)) if a != b), None)
        if not changed:
            assert t.output_token_ids == h.output_token_ids
        else:
            assert diverge == changed[0]
    assert n_fired > 0
    scores = score_traces(backend, traces)
    assert scores.exact_match < 1.0


# ---------------------------------------------------------------- registry and adversary

def test_every_registry_entry_builds(backend, reference_checksum):
    entries = V.list_variants()
    names = [v.name for v in entries]
    assert len(names) == len(set(names))
    for required in ("honest", "prefill-vs-decode", "batch-4", "bf16", "attn-eager", "attn-sdpa", "w4-g128",
                     "w4-g32", "w8-channel", "fp8-kv", "temperature-1.1", "wrong-seed", "top-p-0.85", "bug-top2",
                     "bug-top32"):
        assert required in names
    ids = _prompt_ids(backend, "Hi!")
    for v in entries:
        assert v.description and "\n" not in v.description
        built = v.build(backend)
        assert built.model_id == backend.model_id
        if v.transform is None:
            assert built is backend
        else:
            assert built is not backend and torch.isfinite(_logits(built, ids)).all()
        del built
    assert V.get_variant("w4").name == "w4-g128" and V.get_variant("w8").name == "w8-channel"
    assert V.get_variant("batch-3").batch_size == 3
    assert V.get_variant("w4-g64-asym").settings == {"weight_bits": 4, "group_size": 64, "symmetric": False}
    assert V.get_variant("bug-top2-rate0.05").settings["bug_rate"] == 0.05
    with pytest.raises(KeyError, match="unknown variant"):
        V.get_variant("w3.5")
    assert _state_checksum(backend.model) == reference_checksum
    assert backend.model.config._attn_implementation == "sdpa" and backend.dtype == torch.float32


def test_temperature_adversary_search(backend, chat_prompts):
    reqs = build_requests(backend, chat_prompts[4:6], VLLM)
    # The search mechanics on a cheap base (no model copy); the target makes it cool the sampler.
    found = match_cross_entropy(backend, "wrong-seed", reqs, max_new_tokens=8, batch_size=2, target=1.0,
                                  bracket=(0.3, 1.0), rounds=3)
    assert 1 <= len(found.history) <= 3
    assert found.history[0][0] == 1.0
    assert found.variant.name.startswith("wrong-seed+temperature-")
    assert found.variant.actual_params(VLLM).seed == VLLM.seed + V.WRONG_SEED_OFFSET
    assert 0.3 <= found.temperature <= 1.0
    ces = dict(found.history)
    if found.bracketed:
        assert ces[0.3] <= 1.0 <= ces[1.0]
    assert abs(found.gap) == min(abs(ce - 1.0) for ce in ces.values())
