"""Audits of a real ``vllm serve`` (vLLM's CPU build 0.32.0, its own venv) on loopback.

Marked ``engines`` (``python -m pytest -q -m engines``; ``.ci/run`` runs them). The server is the
engine's own OpenAI server on verinfer's bundled model in fp32. Checked: greedy and seeded audits
of the honest server are CONSISTENT; the same server behind ``engines/vllm_cpu/seed_proxy.py``
(which adds 1 to every request's seed) is INCONSISTENT in seeded mode; ``--reference-url`` pointed
at the server scores with vLLM's prompt logprobs (``echo`` + ``logprobs``), calls the honest server
consistent and a smaller model of the same family (verinfer's own server, ``layers-20``) not.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests.audit_servers import openai_server, seed_proxy

pytestmark = [pytest.mark.engines, pytest.mark.xdist_group("shared-vllm")]  # the session's vLLM server

ENGINE = Path(__file__).resolve().parents[1] / "engines" / "vllm_cpu"
READY_S = 900  # the CPU build loads in about 2.5 min on an idle 2-core machine


def _run_module():
    spec = importlib.util.spec_from_file_location("vllm_cpu_run", ENGINE / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def vllm_server(log_dir: Path):
    """The engine's own OpenAI server on the bundled model in fp32 (tests/conftest.py's ``vllm_url``: one
    per session for every engines module, as a start takes about 2.5 minutes)."""
    run = _run_module()
    python, directory = run.engine_python(), run.model_dir("smollm2-135m")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    argv = lambda port: [str(python), "-m", "vllm.entrypoints.openai.api_server",  # noqa: E731
                         "--model", str(directory), "--served-model-name", "smollm2-135m", "--dtype", "float32",
                         "--enforce-eager", "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port)]
    with openai_server(argv, log_dir, env, READY_S) as url:
        yield url


@pytest.fixture(scope="module")
def proxy_url(vllm_url, tmp_path_factory):
    with seed_proxy(vllm_url, tmp_path_factory.mktemp("proxy")) as url:
        yield url


def _audit(backend, providers, out: Path, **kw):
    from verinfer.api import audit

    return audit(providers, out=out, backend=backend, prompts="chitchat", prompt_seed=3, concurrency=4,
                 api_key_env=None, **kw)


def test_greedy_audit_of_a_real_vllm_server(vllm_url, backend, tmp_path):
    result = _audit(backend, {"vllm": vllm_url}, tmp_path, n=6, max_tokens=24)
    a = result.providers[0]
    print(f"\ngreedy, local reference: {a.verdict.text}")
    assert a.verdict.consistent, a.verdict.text
    assert a.verdict.tokens >= 60
    assert np.mean(a.columns["exact_match"]) >= 0.99
    # vLLM returned the ids itself (return_token_ids), not a re-tokenization of its text
    assert {c.source for c in a.claims} == {"returned"}, {c.source for c in a.claims}


def test_reference_url_scores_with_vllm_prompt_logprobs(vllm_url, backend, tmp_path):
    from verinfer.serve import ServeConfig, serve_in_thread

    with serve_in_thread(backend, ServeConfig(misconfig=("layers-20",), max_batch=8)) as smaller:
        result = _audit(backend, {"vllm": vllm_url, "smaller": smaller}, tmp_path, n=8, max_tokens=24,
                        reference_url=vllm_url, reference_api_model="smollm2-135m")
    assert "reference API" in result.reference
    honest, smaller = result.providers
    print(f"\ngreedy, vLLM as reference: vllm {honest.verdict.text}; layers-20 {smaller.verdict.text}")
    assert honest.verdict.consistent, honest.verdict.text
    assert float(np.max(honest.columns["margin"])) < 1e-3  # vLLM's prefill scores its own greedy decode
    assert not smaller.verdict.consistent, smaller.verdict.text
    stored = (tmp_path / "reference" / "responses.jsonl").read_text().splitlines()
    assert len(stored) == 16 and all("logprobs" in json.loads(line)["response"]["choices"][0] for line in stored)


def test_seeded_audit_of_a_real_vllm_server_and_of_a_seed_rewriting_proxy(vllm_url, proxy_url, backend, tmp_path):
    """Bands for the configuration are built here (honest fp32 and bf16 only, to stay small)."""
    from verinfer.auditing.bands import build_bands
    from verinfer.auditing.plan import AuditSpec
    from verinfer.prompts import load_prompts

    seeded = dict(mode="seeded", profile="vllm-cpu", temperature=1.0, top_k=50, top_p=0.95, seed=100,
                  max_tokens=24)
    spec = AuditSpec(**seeded)
    bands = tmp_path / "bands.json"
    bands.write_text(json.dumps(build_bands(backend, load_prompts("chitchat", 8, seed=11), spec,
                                            variants=("honest", "bf16"))))
    result = _audit(backend, {"vllm": vllm_url, "proxy": proxy_url}, tmp_path / "audit", n=6, bands=bands,
                    **seeded)
    honest, proxy = result.providers
    print(f"\nseeded: vllm {honest.verdict.text}; proxy {proxy.verdict.text}")
    assert honest.verdict.consistent, honest.verdict.text
    assert np.mean(honest.columns["exact_match"]) >= 0.99
    assert not proxy.verdict.consistent, proxy.verdict.text


def test_vllm_as_the_trusted_reference_of_an_auto_audit(vllm_url, backend, tmp_path):
    """``--reference-url`` for the seedless tests (issue #29 item 4): vLLM samples the reference's
    draws (``n``, token ids) and returns the prompt logprobs that score them and the providers'
    logprobs; the providers are ``verinfer serve``: honest CONSISTENT, 4-bit weights INCONSISTENT."""
    import contextlib

    from verinfer.serve import ServeConfig, serve_in_thread

    with contextlib.ExitStack() as stack:
        providers = {name: stack.enter_context(serve_in_thread(backend, ServeConfig(misconfig=mis, max_batch=8)))
                     for name, mis in {"honest": (), "w4": ("w4",)}.items()}
        result = _audit(backend, providers, tmp_path, n=8, max_tokens=16, mode="auto", samples=4, choices=2, seed=5,
                        reference_url=vllm_url, reference_api_model="smollm2-135m")
    honest, w4 = result.providers
    print(f"\nauto, vLLM as reference: honest {honest.verdict.text}; w4 {w4.verdict.text}")
    assert honest.verdict.consistent, honest.verdict.text
    assert not w4.verdict.consistent, w4.verdict.text
    assert {t["test"] for t in w4.tests if t["ran"]} == {"logprobs", "rank", "mmd"}
    stored = [json.loads(line) for line in (tmp_path / "reference" / "responses.jsonl").read_text().splitlines()]
    draws = [r for r in stored if r["kind"] == "reference-draws"]
    assert draws and all(len(r["response"]["choices"]) == 4 and "token_ids" in r["response"]["choices"][0]
                         for r in draws)
    echo = [r for r in stored if r["request"].get("echo")]
    assert echo and all(r["response"]["choices"][0]["logprobs"]["top_logprobs"][-1] for r in echo)
