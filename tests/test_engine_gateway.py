"""``verinfer gateway`` in front of real engines (issue #26 part 3), marked ``engines``.

A real ``vllm serve`` (vLLM's CPU build, ``tests/test_engine_vllm_server.py`` starts it) and a real
``llama_cpp.server`` on the F32 GGUF (``tests/test_engine_llama_server.py``) behind the gateway; seeded
chat traffic from a load generator on the ``openai`` client (four threads; two requests without a
seed, which the gateway assigns; for vLLM one ``n = 2`` and one streamed); then ``verinfer monitor
--once`` (``Monitor.run_once``) verifies the shards the gateway wrote into a SQLite history, judged by
a calibration fitted on honest traces the profile simulates (other prompts and seeds): the window is
CONSISTENT. The same engine behind ``engines/vllm_cpu/seed_proxy.py`` (every seed + 1) placed between
gateway and engine: the window is INCONSISTENT, with its first flagged trace recorded. vLLM returns token ids (``return_token_ids``);
llama.cpp returns text only, so the gateway re-tokenizes with the claimed model's tokenizer, and
fills in the fields whose llama.cpp defaults differ from OpenAI's (``request_defaults``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.audit_servers import seed_proxy
from tests.test_engine_llama_server import NEUTRAL  # (its llama_url and the vllm_url: tests/conftest.py, per session)
from verinfer.production.exchange import Recording
from verinfer.production.gateway import Gateway, GatewayConfig, gateway_in_thread

pytestmark = pytest.mark.engines  # each test in the xdist group of the shared server it uses

KNOBS = dict(temperature=1.0, top_p=0.95)
TOP_K = 50
MAX_TOKENS = 24


def calibration(backend, profile: str):
    """A calibration fitted on honest traces the profile simulates (other prompts, other seeds)."""
    from verinfer.prompts import load_prompts
    from verinfer.sampling.params import SamplingParams
    from verinfer.scoring.traces import score_traces
    from verinfer.simulate.generate import build_requests, generate
    from verinfer.stats.summary import fit_calibrator

    params = SamplingParams(profile=profile, seed=900, top_k=TOP_K, **KNOBS)
    honest = generate(backend, build_requests(backend, load_prompts("chitchat", 10, seed=11), params), MAX_TOKENS, 10)
    return fit_calibrator(score_traces(backend, honest).columns, (1,),
                          signature={"model": backend.model_id, "dtype": "float32", "sampling": [params.signature()]})


def load_generator(url: str, n_prompts: int, fancy: bool) -> int:
    """Seeded chat traffic through the ``openai`` client, four at a time; the number of choices answered."""
    from openai import OpenAI

    from verinfer.prompts import load_prompts

    client = OpenAI(base_url=url, api_key="sk-not-recorded", max_retries=0, timeout=600)

    def one(i_prompt):
        i, prompt = i_prompt
        kw = dict(model="smollm2-135m", messages=prompt.message_dicts(), max_tokens=MAX_TOKENS,
                  extra_body={"top_k": TOP_K}, **KNOBS)
        if i >= 2:
            kw["seed"] = 3000 + 10 * i
        if fancy and i == 2:
            kw["n"] = 2
        if fancy and i == 3:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            assert chunks and not any("token_ids" in c.model_dump_json(exclude_none=True) for c in chunks)
            return 1
        r = client.chat.completions.create(**kw)
        assert "token_ids" not in r.model_dump_json(exclude_none=True)  # fields the client did not ask for
        return len(r.choices)

    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(one, enumerate(load_prompts("chitchat", n_prompts, seed=3))))


def record_and_verify(backend, upstream: str, directory: Path, calibrator, profile: str, fancy: bool,
                      recording: Recording | None = None, **kw):
    """Traffic through a gateway in front of ``upstream``, then ``verinfer monitor --once`` over its
    directory into a SQLite history; the one window (an hour) that holds all of it."""
    g = Gateway(GatewayConfig(upstream, directory / "traces", recording or Recording("engine", profile, "smollm2-135m"),
                              assign_seeds=True, shard_records=5, **kw), log=lambda *a, **k: None)
    with gateway_in_thread(g) as url:
        answered = load_generator(url, 8, fancy)
    windows = monitor_once(backend, directory, calibrator, g.counters.shards_written)
    assert sum(w.traces for w in windows) == g.counters.recorded
    return windows, answered, g


def monitor_once(backend, directory: Path, calibrator, shards: int):
    """``verinfer monitor --once`` over ``directory/traces`` into a SQLite history: the one window (an
    hour) that holds all of it (two when the traffic straddles the hour)."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from verinfer.production.monitor import Judge, Monitor
    from verinfer.production.store import Window, open_store

    store = open_store(f"sqlite:///{directory}/history.db")
    try:
        outcome = Monitor(directory / "traces", store, out_dir=directory / "scores", window_s=3600, backend=backend,
                          judge=Judge(calibrator, "calibration")).run_once()
        assert not outcome.failed and len(outcome.verified) == shards, outcome
        with Session(store.engine) as s:
            windows = s.scalars(select(Window)).all()
            s.expunge_all()
    finally:
        store.close()
    assert len(windows) in (1, 2)
    return windows


@pytest.mark.xdist_group("shared-vllm")
def test_vllm_behind_the_gateway_verifies_and_a_seed_rewriting_proxy_does_not(vllm_url, backend, tmp_path):
    calibrator = calibration(backend, "vllm-cpu")
    honest, answered, g = record_and_verify(backend, vllm_url, tmp_path / "vllm", calibrator, "vllm-cpu", True)
    print(f"\nvllm serve behind the gateway: " + "; ".join(f"{w.note} ({w.tokens} tokens)" for w in honest))
    assert answered == 9 and g.counters.recorded == 9 and g.counters.unrecordable == g.counters.dropped == 0
    assert g.counters.ids_refused == 0  # vLLM takes return_token_ids
    assert all(w.verdict == "CONSISTENT" and w.first_flagged is None for w in honest), [w.note for w in honest]
    assert all(w.exact_match_rate >= 0.99 for w in honest)
    (tmp_path / "proxy-log").mkdir()
    with seed_proxy(vllm_url, tmp_path / "proxy-log") as proxied:
        dishonest, _, _ = record_and_verify(backend, proxied, tmp_path / "proxy", calibrator, "vllm-cpu", False)
    print("vllm serve behind a seed-rewriting proxy: " + "; ".join(f"{w.note}, first flagged {w.first_flagged}"
                                                                   for w in dishonest))
    assert any(w.verdict == "INCONSISTENT" and w.first_flagged.startswith("engine/") for w in dishonest)


@pytest.mark.xdist_group("shared-llama")
def test_llama_cpp_behind_the_gateway_verifies_and_a_seed_rewriting_proxy_does_not(llama_url, backend,
                                                                                    tmp_path):
    from verinfer.auditing.run import stop_ids

    calibrator = calibration(backend, "llama.cpp")
    rec = Recording("llama", "llama.cpp", "smollm2-135m", backend.tokenizer, frozenset(stop_ids(backend.tokenizer)))
    neutral = {k: v for k, v in NEUTRAL.items() if k != "top_k"}  # the client sends top_k itself
    honest, answered, g = record_and_verify(backend, llama_url, tmp_path / "llama", calibrator, "llama.cpp", False,
                                            recording=rec, defaults=neutral)
    print(f"\nllama_cpp.server behind the gateway: " + "; ".join(f"{w.note} ({w.tokens} tokens)" for w in honest))
    assert answered == 8 and g.counters.recorded == 8 and g.counters.unrecordable == 0
    assert all(w.verdict == "CONSISTENT" for w in honest), [w.note for w in honest]
    (tmp_path / "proxy-log").mkdir()
    with seed_proxy(llama_url, tmp_path / "proxy-log") as proxied:
        dishonest, _, _ = record_and_verify(backend, proxied, tmp_path / "proxy", calibrator, "llama.cpp", False,
                                            recording=rec, defaults=neutral)
    print("llama_cpp.server behind a seed-rewriting proxy: " + "; ".join(
        f"{w.note}, first flagged {w.first_flagged}" for w in dishonest))
    assert any(w.verdict == "INCONSISTENT" and w.first_flagged.startswith("llama/") for w in dishonest)


@pytest.mark.xdist_group("shared-vllm")
def test_vllm_answers_reach_the_client_as_vllm_sends_them(vllm_url, tmp_path):
    """Byte for byte but the response id and time: the ids the gateway asked for come back as the
    ``null`` vLLM writes for fields nobody asked for, in whole responses and in every stream event."""
    import re

    import httpx

    volatile = re.compile(rb'"(id|created|system_fingerprint)":("[^"]*"|\d+|null)')
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
            "seed": 11, "top_k": TOP_K, **KNOBS}
    g = Gateway(GatewayConfig(vllm_url, tmp_path, Recording("vllm", "vllm-cpu", "smollm2-135m"), shard_records=1),
                log=lambda *a, **k: None)
    with gateway_in_thread(g) as url:
        for extra in ({}, {"n": 2}, {"stream": True}, {"stream": True, "return_token_ids": True}):
            direct = httpx.post(f"{vllm_url}/chat/completions", json={**body, **extra}, timeout=300)
            proxied = httpx.post(f"{url}/chat/completions", json={**body, **extra}, timeout=300)
            assert proxied.status_code == direct.status_code == 200
            assert volatile.sub(b"", proxied.content) == volatile.sub(b"", direct.content), extra
            if not extra.get("return_token_ids"):
                assert b'token_ids":[' not in proxied.content
    assert g.null_ids is True and g.counters.recorded == 5

