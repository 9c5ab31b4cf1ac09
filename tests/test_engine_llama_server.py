"""Audits of a real ``llama_cpp.server`` (llama-cpp-python 0.3.36, its own venv) on loopback.

Marked ``engines`` (``python -m pytest -q -m engines``; ``.ci/run`` runs them). The server runs the
F32 copy of verinfer's bundled GGUF (``engines/llama_cpp/f32_gguf.py``: every tensor dequantized,
exactly verinfer's fp32 reference weights), so an honest server differs from the reference only by
kernel rounding. The server cannot take a prompt as token ids and returns no token ids: the audit
sends chat messages (the server applies the GGUF's chat template) and re-tokenizes the returned
text. Its defaults (top-k 40, min-p 0.05, repeat penalty 1.1, greedy included) are neutralised
with ``extra_body``. Checked: greedy and seeded (``--profile llama.cpp``) audits of the honest
server are CONSISTENT; the same server behind ``engines/vllm_cpu/seed_proxy.py`` (seed + 1) is
INCONSISTENT in seeded mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.audit_servers import openai_server, seed_proxy

pytestmark = [pytest.mark.engines, pytest.mark.xdist_group("shared-llama")]  # the session's llama server

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engines" / "llama_cpp"
READY_S = 300  # the F32 model (540 MB) loads in a few seconds on the idle machine
NEUTRAL = {"top_k": 0, "min_p": 0, "repeat_penalty": 1}  # llama-cpp-python's server defaults otherwise apply


def llama_engine_python() -> Path:
    """The engine's venv (tests/conftest.py's session fixture ``engine_python``)."""
    venv = subprocess.run(["bash", str(ENGINE / "setup.sh")], check=True, capture_output=True, text=True).stdout
    return Path(venv.strip().splitlines()[-1]) / "bin" / "python"


def build_f32_gguf(engine_python: Path, out_dir: Path) -> Path:
    """The bundled model as an F32 GGUF (tests/conftest.py's session fixture ``f32_gguf``)."""
    from verinfer.models.load import resolve

    out = out_dir / "smollm2-135m-f32.gguf"
    subprocess.run([str(engine_python), str(ENGINE / "f32_gguf.py"), str(resolve("smollm2-135m").path), str(out)],
                   check=True, capture_output=True, text=True)
    return out


def test_the_f32_copy_holds_the_reference_weights(f32_gguf):
    """Tensors llama.cpp and transformers store alike (no head permutation) equal verinfer's converted
    reference weights bit for bit."""
    import gguf
    from safetensors.numpy import load_file

    from verinfer.models.load import local_dir, resolve

    ref = {}
    for f in sorted(Path(local_dir(resolve("smollm2-135m"))).glob("*.safetensors")):
        ref.update(load_file(f))
    ours = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(f32_gguf).tensors}
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for i in range(30):
        for g, h in (("ffn_down", "mlp.down_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                     ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                     ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            pairs[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{h}.weight"
    for g, h in pairs.items():
        assert ours[g].dtype == np.float32 and np.array_equal(ours[g].reshape(ref[h].shape), ref[h]), g


@contextlib.contextmanager
def llama_server(engine_python: Path, f32_gguf: Path, log_dir: Path):
    """``llama_cpp.server`` on the F32 copy (tests/conftest.py's session fixture ``llama_url``)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    argv = lambda port: [str(engine_python), "-m", "llama_cpp.server", "--model", str(f32_gguf),  # noqa: E731
                         "--model_alias", "smollm2-135m", "--host", "127.0.0.1", "--port", str(port),
                         "--n_threads", "1", "--n_ctx", "1024", "--logits_all", "False", "--verbose", "False"]
    with openai_server(argv, log_dir, env, READY_S) as url:
        yield url


@pytest.fixture(scope="module")
def proxy_url(llama_url, tmp_path_factory):
    with seed_proxy(llama_url, tmp_path_factory.mktemp("proxy")) as url:
        yield url


@pytest.fixture(scope="module")
def top_k_40_url(llama_url, tmp_path_factory):
    """The server behind a front that makes it sample top-k 40 whatever the client asks (seeds kept)."""
    with seed_proxy(llama_url, tmp_path_factory.mktemp("top-k-40"), "--seed-offset", "0", "--set", "top_k=40") as url:
        yield url


def _audit(backend, providers, out: Path, prompts="chitchat", **kw):
    from verinfer.api import audit

    return audit(providers, out=out, backend=backend, prompts=prompts, prompt_seed=3, concurrency=2,
                 api_key_env=None, extra_body=NEUTRAL, **kw)


def test_the_server_takes_no_token_id_prompts_and_returns_no_token_ids(llama_url):
    r = httpx.post(f"{llama_url}/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
    assert r.status_code >= 400 and "Input should be a valid string" in r.text, r.text[:300]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "return_token_ids": True, **NEUTRAL}
    choice = httpx.post(f"{llama_url}/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert "token_ids" not in choice and isinstance(choice["message"]["content"], str)


def test_greedy_audit_of_a_real_llama_cpp_server(llama_url, backend, tmp_path):
    result = _audit(backend, {"llama": llama_url}, tmp_path, n=6, max_tokens=24)
    a = result.providers[0]
    print(f"\ngreedy: {a.verdict.text}")
    assert a.verdict.consistent, a.verdict.text
    assert a.verdict.tokens >= 60
    assert np.mean(a.columns["exact_match"]) >= 0.99
    assert {c.source for c in a.claims} == {"retokenized"}  # the server returns text only
    assert not any(c.drift.get("round_trip_mismatch") for c in a.claims)
    assert not a.served["warnings"], a.served["warnings"]  # usage counts agree with the re-tokenized text


def test_seeded_audits_are_judged_by_the_shipped_calibration_with_its_sampler_shape_detectors(
        top_k_40_url, backend, tmp_path):
    """Issue #41 item 5: a 32 x 48 seeded audit at the shipped settings (T = 1, top-k 50, top-p 0.95) given no
    bands or calibration is judged by the shipped llama.cpp calibration, as ``verify`` judges the same
    tokens: the margin and the sampler-shape detectors. Behind a front that makes it sample top-k 40 while
    the audit claims 50, the server is INCONSISTENT by the narrower side (the margin bands alone had said
    CONSISTENT, p = 1, in the issue). The honest server and the seed + 1 front, judged the same way: the
    test below."""
    seeded = dict(mode="seeded", profile="llama.cpp", temperature=1.0, top_k=50, top_p=0.95, seed=100,
                  max_tokens=48)
    result = _audit(backend, {"topk40": top_k_40_url}, tmp_path / "audit", n=32, **seeded)
    (top_k_40,) = result.providers
    print(f"\nseeded 32 x 48, top-k 40: {top_k_40.verdict.text} "
          f"({np.mean(top_k_40.columns['exact_match']):.1%} exact, {top_k_40.verdict.tokens} tokens)")
    assert result.judged_by == "calibration-smollm2-135m-llama.cpp-t1-k50-p0.95-minp0.json (shipped default)"
    assert json.loads(result.reports[0].read_text())["calibration"] == result.judged_by
    assert not top_k_40.verdict.consistent and "narrower side" in top_k_40.verdict.text, top_k_40.verdict.text
    stored = json.loads((tmp_path / "audit" / "topk40" / "responses.jsonl").read_text().splitlines()[0])
    assert stored["request"]["repeat_penalty"] == 1 and stored["request"]["top_k"] == 50  # the claim wins


def test_seeded_audit_where_retokenized_text_merges_sampled_tokens_is_consistent_and_a_seed_rewriting_proxy_not(
        llama_url, proxy_url, backend, tmp_path):
    """Issue #27 item 0: 16 prompts x 32 tokens at T = 1, top-k 50, top-p 0.95, where sampled tokens
    merge when the returned text is re-tokenized (the server returns no ids). Before the alignment
    (``verinfer.auditing.alignment``) every token after a merge mismatched and this honest server was
    called INCONSISTENT; now the merges are re-split where the replay sampled, reported as drift, and
    left out of the verdict. Judged, as no bands or calibration are given, by the shipped llama.cpp
    calibration (the margin and the sampler-shape detectors). The same server behind a front that adds 1
    to every seed: INCONSISTENT."""
    from verinfer.prompts import load_prompts

    seeded = dict(mode="seeded", profile="llama.cpp", temperature=1.0, top_k=50, top_p=0.95, seed=100,
                  max_tokens=32)
    # the issue's 16 prompts (sampled as they were before audits replaced repeated prompts: where merges occur),
    # judged by the shipped calibration
    issue_prompts = load_prompts("chitchat", 16, seed=3)
    honest, proxy = _audit(backend, {"llama": llama_url, "proxy": proxy_url}, tmp_path / "audit", prompts=issue_prompts,
                           n=16, **seeded).providers
    print(f"\nseeded, 16 prompts: llama {honest.verdict.text}; drift {honest.drift}; proxy {proxy.verdict.text}")
    assert not proxy.verdict.consistent, proxy.verdict.text
    assert honest.drift["realigned"]["sequences"] >= 1, honest.drift  # merges occurred: what this test is about
    assert honest.drift["count_mismatch"]["sequences"] == 0, honest.drift
    assert honest.verdict.consistent, honest.verdict.text
    assert np.mean(honest.columns["exact_match"]) >= 0.95


def test_code_prompts_the_server_tokenizes_otherwise_are_warned_about(llama_url, backend, tmp_path):
    """Issue #41 item 5: ``llama_cpp.server`` tokenizes some human-eval prompts otherwise than the
    reference renders them (its ``usage.prompt_tokens`` differs; it returns no prompt ids), and nothing
    warned. The audit's ``prompt_rendering`` warning counts exactly the prompts whose count differs,
    asked of the server directly."""
    from verinfer.prompts import load_prompts, render

    prompts = load_prompts("human-eval", 32, seed=3)[:16]  # 16 long code prompts are enough to show it
    differ = []
    for p in prompts:
        body = {"model": "smollm2-135m", "messages": p.message_dicts(), "max_tokens": 1, "temperature": 0, **NEUTRAL}
        usage = httpx.post(f"{llama_url}/chat/completions", json=body, timeout=120).json()["usage"]
        if usage["prompt_tokens"] != len(render(backend.tokenizer, p)):
            differ.append(p.id)
    a = _audit(backend, {"llama": llama_url}, tmp_path, prompts=prompts, n=len(prompts), max_tokens=4).providers[0]
    print(f"\nhuman-eval: {len(differ)} of {len(prompts)} prompts counted otherwise by the server; "
          f"warnings {a.served['warnings']}")
    assert differ, "every prompt counted alike: this test no longer shows what it is about"
    assert a.served["contradictions"].get("prompt_rendering") == len(differ)
    assert sorted(c.prompt_id for c in a.claims if "prompt_rendering" in c.served["problems"]) == sorted(differ)
    assert any(w.startswith(f"{len(differ)} of {len(prompts)} responses saw another prompt") for w in a.served["warnings"])
