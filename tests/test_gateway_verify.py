"""What ``verinfer gateway`` records verifies: ``verinfer serve`` (the vLLM profile) behind the gateway,
seeded chat traffic (seeds assigned by the gateway or sent by the client, ``n = 2``, streamed), and
the recorded shards judged with a calibration fitted on locally generated honest traces: CONSISTENT.
The same traffic through a seed-rewriting proxy placed between gateway and engine, and to a server
with 4-bit weights (``--misconfig w4``) that claims the honest model: INCONSISTENT. Without token
ids the gateway re-tokenizes with the claimed model's tokenizer and gets the same prompt and the
same canonical outputs."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.audit_servers import seed_proxy
from verinfer.production.exchange import Recording
from verinfer.production.gateway import Gateway, GatewayConfig, gateway_in_thread
from verinfer.serve import ServeConfig, serve_in_thread
from verinfer.sharded import find_shards
from verinfer.trace import read_traces

KNOBS = dict(temperature=1.0, top_k=50, top_p=0.95)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts():
    from verinfer.prompts import load_prompts

    return load_prompts("chitchat", 6, seed=21)


@pytest.fixture(scope="module")
def calibrator(backend):
    """Honest seeded traces generated locally (other prompts and seeds, the same settings)."""
    from verinfer.prompts import load_prompts
    from verinfer.sampling.params import SamplingParams
    from verinfer.scoring.traces import score_traces
    from verinfer.simulate.generate import build_requests, generate
    from verinfer.stats.summary import fit_calibrator

    params = SamplingParams(profile="vllm", seed=500, **KNOBS)
    honest = generate(backend, build_requests(backend, load_prompts("chitchat", 10, seed=4), params), MAX_TOKENS, 10)
    return fit_calibrator(score_traces(backend, honest).columns, (1,),
                          signature={"model": backend.model_id, "dtype": "float32", "sampling": [params.signature()]})


def _traffic(url: str, prompts) -> list[dict]:
    """Six chat requests as clients send them: no seed (the gateway assigns one), a seed, n = 2, streamed."""
    bodies = []
    for i, p in enumerate(prompts):
        body = {"model": "smollm2-135m", "messages": p.message_dicts(), "max_tokens": MAX_TOKENS, **KNOBS}
        if i >= 2:
            body["seed"] = 7000 + 10 * i
        if i == 4:
            body["n"] = 2
        if i == 5:
            body["stream"] = True
        bodies.append(body)
    with httpx.Client(timeout=300) as client:
        for body in bodies:
            r = client.post(f"{url}/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert "token_ids" not in r.text  # the client did not ask for them
    return bodies


def _recorded(directory):
    return [t for p in find_shards(directory) for t in read_traces(p)]


def _judge(backend, traces, calibrator):
    from verinfer.api import verify

    return verify(traces, calibration=calibrator, batch_size=1, backend=backend).summary


@pytest.fixture(scope="module")
def served(backend, one_torch_thread, tmp_path_factory):
    with contextlib.ExitStack() as stack:
        honest = stack.enter_context(serve_in_thread(backend, ServeConfig(max_batch=8)))
        w4 = stack.enter_context(serve_in_thread(backend, ServeConfig(misconfig=("w4",), max_batch=8)))
        proxy = stack.enter_context(seed_proxy(honest, tmp_path_factory.mktemp("proxy")))
        yield {"honest": honest, "w4": w4, "seed-proxy": proxy}


def _through_gateway(upstream: str, directory, prompts, **kw) -> tuple[list, list[dict], Gateway]:
    g = Gateway(GatewayConfig(upstream, directory, kw.pop("recording", Recording("serve", "vllm", "smollm2-135m")),
                              assign_seeds=True, shard_records=4, **kw), log=lambda *a, **k: None)
    with gateway_in_thread(g) as url:
        bodies = _traffic(url, prompts)
    return _recorded(directory), bodies, g


def test_recorded_traffic_verifies_consistent_and_dishonest_engines_do_not(backend, served, prompts, calibrator,
                                                                          tmp_path):
    traces, bodies, g = _through_gateway(served["honest"], tmp_path / "honest", prompts)
    assert len(traces) == 7 and g.counters.recorded == 7 and g.counters.unrecordable == 0
    assert len(find_shards(tmp_path / "honest")) == 2  # 4 + 3: rotated by count, the last written at shutdown
    by_request = {}
    for t in traces:
        by_request.setdefault(t.meta["request_id"], []).append(t)
    seeds = sorted(tuple(t.sampling.seed for t in ts) for ts in by_request.values())
    assigned = [t for t in traces if t.meta["seed_assigned"]]
    assert len(assigned) == 2 and all(0 <= t.sampling.seed < 2**31 for t in assigned)
    assert (7020,) in seeds and (7030,) in seeds and (7040, 7041) in seeds and (7050,) in seeds  # n = 2: seed + j
    assert {t.meta["token_source"] for t in traces} == {"returned"} and sum(t.meta["stream"] for t in traces) == 1
    summary = _judge(backend, traces, calibrator)
    print(f"\ngateway, honest verinfer serve: {summary.verdict_text}")
    assert summary.consistent, summary.verdict_text
    assert summary.exact_match_rate >= 0.99

    for name in ("seed-proxy", "w4"):
        dishonest, _, _ = _through_gateway(served[name], tmp_path / name, prompts)
        summary = _judge(backend, dishonest, calibrator)
        print(f"gateway, {name}: {summary.verdict_text}")
        assert len(dishonest) == 7 and not summary.consistent, (name, summary.verdict_text)


def test_without_token_ids_the_gateway_retokenizes_to_the_same_ids(backend, served, prompts, tmp_path):
    from verinfer.auditing.run import stop_ids

    stops = frozenset(stop_ids(backend.tokenizer))
    rec = Recording("serve", "vllm", "smollm2-135m", backend.tokenizer, stops)
    returned, _, _ = _through_gateway(served["honest"], tmp_path / "ids", prompts[:4], recording=rec)
    retok, _, _ = _through_gateway(served["honest"], tmp_path / "text", prompts[:4], recording=rec, token_ids=False)
    assert {t.meta["token_source"] for t in retok} == {"retokenized"}
    assert {t.meta["prompt_source"] for t in retok} == {"rendered"}
    pairs = {t.sampling.seed: t for t in returned if not t.meta["seed_assigned"]}
    checked = 0
    for t in retok:
        if t.sampling.seed not in pairs:
            continue
        ref = pairs[t.sampling.seed]
        assert t.prompt_token_ids == ref.prompt_token_ids  # our chat template rendering equals the engine's
        body = [x for x in ref.output_token_ids if x not in stops]
        if backend.tokenizer.encode(backend.tokenizer.decode(body), add_special_tokens=False) == body:
            assert t.output_token_ids == body  # canonical outputs come back exactly (no stop token in text)
            checked += 1
    assert checked >= 1
    assert all("round_trip_mismatch" in t.meta["drift"] for t in retok)  # re-tokenization drift is measured
