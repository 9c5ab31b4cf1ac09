"""``verinfer audit`` against real servers on loopback: honest judged consistent, misconfigured
ones flagged with the tokens each needed, reports a person can read (checked in headless
Chromium), a reference API scoring like the local reference, resuming without repeated requests,
and clear one-line errors for malformed providers."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.audit_servers import asgi_in_thread
from tests.cli_app import invoke
from verinfer.auditing.bands import find_bands
from verinfer.auditing.client import Endpoint, ProviderClient, ProviderError
from verinfer.auditing.plan import AuditSpec
from verinfer.auditing.reference import ApiReference, LocalReference
from verinfer.auditing.report import write_reports
from verinfer.auditing.run import run_audit
from verinfer.auditing.store import ResponseStore
from verinfer.prompts import load_prompts
from verinfer.serve import ServeConfig, serve_in_thread
from verinfer.trace import read_traces

SPEC = AuditSpec(mode="greedy", max_tokens=32)
MISCONFIGS = {"honest": (), "w4": ("w4",), "fp8-kv": ("fp8-kv",),
              "system-prompt": ("system-prompt:You are a pirate. Always answer like a pirate, in rhymes.",)}


@pytest.fixture(scope="module")
def prompts():
    return load_prompts("chitchat", 10, seed=5)


@pytest.fixture(scope="module")
def servers(backend):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared; every test here uses these servers
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(serve_in_thread(backend, ServeConfig(misconfig=mis, max_batch=10)))
               for name, mis in MISCONFIGS.items()}
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bands(backend):
    found = find_bands(backend.model_id, SPEC.signature())
    assert found is not None, "the shipped greedy bands for smollm2-135m are missing"
    return found


@pytest.fixture(scope="module")
def audit(backend, servers, prompts, bands, tmp_path_factory):
    out = tmp_path_factory.mktemp("audit")
    endpoints = [Endpoint(name, url, backend.model_id, None) for name, url in servers.items()]
    result = run_audit(endpoints, prompts, SPEC, LocalReference(backend), out, bands=bands, concurrency=10)
    return result, write_reports(result, backend.tokenizer)


def test_honest_consistent_and_misconfigurations_flagged(audit, prompts):
    result, _ = audit
    verdicts = {a.endpoint.name: a.verdict for a in result.providers}
    for name, v in verdicts.items():
        print(f"{name}: {v.text}")
    assert verdicts["honest"].consistent and verdicts["honest"].tokens_needed is None
    assert verdicts["honest"].exact_match_rate == 1.0
    for name in ("w4", "fp8-kv", "system-prompt"):
        v = verdicts[name]
        assert not v.consistent, v.text
        assert v.p_adjusted < 0.01 and v.tokens_needed is not None and v.tokens_needed <= v.tokens
    assert verdicts["w4"].resembles == "4-bit-like"
    # Holm over four providers: adjusted p-values never below the raw ones
    assert all(v.p_adjusted >= v.p_value for v in verdicts.values())
    for a in result.providers:  # every response came with token ids and was stored
        assert a.drift["ids_returned"] == len(prompts) and a.responses_stored == len(prompts)
        assert a.drift["retokenize_mismatch"]["checked"] == len(prompts)
    # the injected system prompt is concealed: reported prompt ids match our rendering
    sp = next(a for a in result.providers if a.endpoint.name == "system-prompt")
    assert sp.drift["prompt_mismatch"]["sequences"] == 0


def test_json_report(audit):
    result, (json_path, _) = audit
    doc = json.loads(json_path.read_text())
    assert [p["name"] for p in doc["providers"]] == list(MISCONFIGS)
    w4 = doc["providers"][1]
    assert w4["verdict"]["text"].startswith("INCONSISTENT") and w4["verdict"]["p_adjusted"] is not None
    assert any(r["divergent_positions"] for r in w4["prompts"])
    assert all(not r["divergent_positions"] for r in doc["providers"][0]["prompts"])
    assert "api_key" not in json_path.read_text().lower()


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "headless Chromium is needed to check the HTML report (Debian package 'chromium')"
    return path


def test_html_report_as_a_person_sees_it(audit, prompts, tmp_path):
    from PIL import Image

    result, (_, html_path) = audit
    chromium = _chromium()
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*args, "--dump-dom", html_path.as_uri()], capture_output=True, text=True,
                         timeout=600).stdout
    assert "verinfer audit report" in dom
    assert dom.count('class="prompt-row"') == len(MISCONFIGS) * len(prompts)
    assert len(re.findall(r"\bCONSISTENT with the claimed configuration", dom)) == 1
    assert len(re.findall(r"\bINCONSISTENT with the claimed configuration", dom)) == 3
    honest_part = dom.split('id="provider-honest"')[1].split('id="provider-w4"')[0]
    w4_part = dom.split('id="provider-w4"')[1].split('id="provider-fp8-kv"')[0]
    assert '<mark class="div' not in honest_part and w4_part.count('<mark class="div') >= 10
    assert dom.count("<svg") >= 2 * len(MISCONFIGS) and "Holm-adjusted p" in dom
    page = html_path.read_text()  # self-contained: nothing fetched from elsewhere
    assert "<link" not in page and "<script" not in page and "url(http" not in page
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page)
    shot = tmp_path / "page.png"
    subprocess.run([*args, "--hide-scrollbars", "--window-size=1100,1400", f"--screenshot={shot}",
                    html_path.as_uri()], capture_output=True, timeout=600)
    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert img.shape[0] >= 1000
    non_white = (img.sum(axis=2) < 720).mean()
    red = ((img[..., 0] > 150) & (img[..., 1] < 110) & (img[..., 2] < 110)).sum()  # provider marker, verdict bar
    green = ((img[..., 1] > 100) & (img[..., 0] < 80) & (img[..., 2] < 110)).sum()  # honest verdict and marker
    blue = ((img[..., 2] > 170) & (img[..., 0] < 190) & (img[..., 1] > 150)).sum()  # band ranges in the plot
    assert non_white > 0.05 and red > 50 and green > 50 and blue > 200, (non_white, red, green, blue)


def test_reference_api_scores_like_the_local_reference(audit, servers, backend, tmp_path):
    """The honest server as a reference API (echo + prompt logprobs) reproduces the local margins."""
    result, _ = audit
    traces = read_traces(result.out_dir / "w4" / "traces.jsonl")
    store = ResponseStore(tmp_path / "reference" / "responses.jsonl")
    ref = ApiReference(ProviderClient(Endpoint("reference", servers["honest"], backend.model_id, None), store, 4),
                       backend.tokenizer)
    api = ref.score(traces, tmp_path)
    local = next(a for a in result.providers if a.endpoint.name == "w4").columns
    assert api["margin"].size == local["margin"].size
    np.testing.assert_allclose(api["margin"], local["margin"], atol=2e-3)
    assert (api["exact_match"] == local["exact_match"]).mean() > 0.99
    assert np.isfinite(api["margin"]).all() and (api["margin"] > 1).any()  # finite outside the top-k too


def counting_proxy(upstream: str, fail_after: int | None):
    """Forwards to ``upstream``; after ``fail_after`` requests answers 400 (an injected failure)."""
    app = FastAPI()
    app.state.forwarded = 0

    @app.post("/v1/{path:path}")
    async def forward(path: str, request: Request):
        if fail_after is not None and app.state.forwarded >= fail_after:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=400)
        app.state.forwarded += 1
        async with httpx.AsyncClient(timeout=300) as client:
            r = await client.post(f"{upstream}/{path}", content=await request.body(),
                                  headers={"content-type": "application/json"})
        return JSONResponse(r.json(), status_code=r.status_code)

    return app


def test_interrupted_audit_resumes_without_repeated_requests(backend, servers, prompts, bands, tmp_path):
    spec, prompts = AuditSpec(mode="greedy", max_tokens=12), prompts[:6]
    failing = counting_proxy(servers["honest"], fail_after=4)
    with asgi_in_thread(failing) as url:
        with pytest.raises(ProviderError, match="injected failure"):
            run_audit([Endpoint("p", url, backend.model_id, None)], prompts, spec, LocalReference(backend),
                      tmp_path, bands=bands, concurrency=1)
    assert failing.state.forwarded == 4
    assert len(ResponseStore(tmp_path / "p" / "responses.jsonl")) == 4  # paid-for responses kept
    resumed = counting_proxy(servers["honest"], fail_after=None)
    with asgi_in_thread(resumed) as url:
        result = run_audit([Endpoint("p", url, backend.model_id, None)], prompts, spec, LocalReference(backend),
                           tmp_path, bands=bands, concurrency=1)
        assert resumed.state.forwarded == len(prompts) - 4  # only what was missing
        run_audit([Endpoint("p", url, backend.model_id, None)], prompts, spec, LocalReference(backend),
                  tmp_path, bands=bands, concurrency=1)
        assert resumed.state.forwarded == len(prompts) - 4  # a third run pays for nothing
    assert result.providers[0].verdict.consistent and result.providers[0].responses_stored == len(prompts)


def test_retokenized_text_reports_drift_separately(backend, servers, prompts, bands, tmp_path):
    spec = AuditSpec(mode="greedy", max_tokens=24, token_ids=False)
    result = run_audit([Endpoint("honest", servers["honest"], backend.model_id, None)], prompts[:6], spec,
                       LocalReference(backend), tmp_path, bands=bands, concurrency=6)
    a = result.providers[0]
    assert a.drift["retokenized"] == 6 and a.drift["ids_returned"] == 0
    assert a.drift["round_trip_mismatch"]["checked"] == 6
    assert a.verdict.consistent, a.verdict.text


def garbage_app():
    app = FastAPI()

    @app.post("/{mode}/v1/chat/completions")
    async def chat(mode: str):
        choice = {"message": {"role": "assistant", "content": "hello"}, "finish_reason": "length"}
        if mode == "strings":
            choice["token_ids"] = ["a", "b"]
        elif mode == "vocab":  # ids from another tokenizer with a larger vocabulary
            choice["token_ids"] = [12, 250_000]
        elif mode == "nothing":
            choice = {"finish_reason": "length"}
        return JSONResponse({"id": "x", "choices": [choice]})

    return app


def _cli(*args):
    return invoke("audit", "run", *args)  # in this process (tests/cli_app.py): what the command does


@pytest.mark.parametrize("mode, fragments", [
    ("strings", ["provider 'bad'", "field 'token_ids' must be a list of integers"]),
    ("vocab", ["token id 250000 is outside the vocabulary"]),
    ("nothing", ["neither output token ids nor text"]),
])
def test_cli_malformed_provider_gives_one_line_error_and_keeps_responses(tmp_path, mode, fragments):
    with asgi_in_thread(garbage_app(), prefix=f"/{mode}/v1") as url:
        proc = _cli("--provider", f"bad={url}", "--n", "2", "--max-tokens", "4", "--out", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    assert len(ResponseStore(tmp_path / "bad" / "responses.jsonl")) == 2


def test_seeded_mode_with_a_calibration_file(backend, prompts, tmp_path):
    """Seeded audits replay the provider's vLLM sampler; the verdict comes from a `verinfer calibrate`
    style calibration fitted on honest seeded traces generated locally (other seeds, same settings)."""
    from verinfer.simulate.generate import generate
    from verinfer.scoring.traces import score_traces
    from verinfer.simulate.generate import build_requests
    from verinfer.stats.summary import fit_calibrator

    spec = AuditSpec(mode="seeded", profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=7000, max_tokens=16)
    honest_traces = generate(backend, build_requests(backend, prompts, spec.params(0).with_(seed=123)), 16, 10)
    calibrator = fit_calibrator(score_traces(backend, honest_traces).columns, (1,),
                                signature={"model": backend.model_id, "dtype": "float32",
                                           "sampling": [spec.signature()]})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with serve_in_thread(backend, ServeConfig(max_batch=10)) as honest, \
                serve_in_thread(backend, ServeConfig(misconfig=("wrong-seed",), max_batch=10)) as wrong:
            result = run_audit([Endpoint("honest", honest, backend.model_id, None),
                                Endpoint("wrong-seed", wrong, backend.model_id, None)], prompts[:6], spec,
                               LocalReference(backend), tmp_path, calibrator=calibrator, concurrency=6)
    finally:
        torch.set_num_threads(threads)
    honest_v, wrong_v = (a.verdict for a in result.providers)
    assert honest_v.consistent and honest_v.exact_match_rate == 1.0, honest_v.text
    assert not wrong_v.consistent and wrong_v.tokens_needed is not None, wrong_v.text
    assert "sequential binomial test" in wrong_v.method

    # One verdict rule: the tokens the audit verified, fed to `verinfer verify` with the same
    # calibration file, get the same flags, p-value and stopping point.
    (tmp_path / "cal.json").write_text(json.dumps(calibrator.to_dict()))
    for name, audited in (("honest", honest_v), ("wrong-seed", wrong_v)):
        proc = invoke("verify", tmp_path / name / "traces.jsonl", "--calibration", tmp_path / "cal.json",
                      "--json", tmp_path / f"{name}.json")  # the command, in this process (tests/cli_app.py)
        assert proc.returncode == (0 if name == "honest" else 1), proc.stderr
        verified = json.loads((tmp_path / f"{name}.json").read_text())["verdict"]
        for key in ("flagged", "units", "batch_size", "tokens", "tokens_needed", "looks"):
            assert verified[key] == getattr(audited, key), (name, key)
        assert verified["p_value"] == pytest.approx(audited.p_value, rel=1e-12)
    stored = ResponseStore(tmp_path / "honest" / "responses.jsonl")
    seeds = sorted(r["request"]["seed"] for r in stored.records())
    assert seeds == [7000 + i for i in range(6)]  # prompt i asked with seed + i, as replayed


def test_identical_prompts_are_asked_and_counted_once(backend, servers, prompts, bands, tmp_path):
    spec = AuditSpec(mode="greedy", max_tokens=8)
    proxy = counting_proxy(servers["honest"], fail_after=None)
    with asgi_in_thread(proxy) as url:
        result = run_audit([Endpoint("p", url, backend.model_id, None)], [prompts[0], prompts[1], prompts[0]], spec,
                           LocalReference(backend), tmp_path, bands=bands)
    assert proxy.state.forwarded == 2
    a = result.providers[0]
    assert [c.prompt_id for c in a.claims] == [prompts[0].id, prompts[1].id] and a.verdict.sequences == 2


def test_a_calibration_of_another_sampler_is_refused_before_any_request(backend, servers, prompts, tmp_path):
    """A calibration fitted on torch-exponential traces cannot judge a vLLM-sampler audit: refused
    with both signatures named, and the provider never sees a request."""
    from verinfer.stats.summary import fit_calibrator

    spec = AuditSpec(mode="seeded", profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=7000, max_tokens=8)
    other = {"model": backend.model_id, "dtype": "float32",
             "sampling": [{**spec.signature(), "profile": "torch-exponential"}]}
    rng = np.random.default_rng(0)
    calibrator = fit_calibrator({"margin": rng.exponential(size=400), "cross_entropy": rng.exponential(size=400),
                                 "exact_match": np.ones(400)}, (1,), signature=other)
    proxy = counting_proxy(servers["honest"], fail_after=None)
    with asgi_in_thread(proxy) as url:
        with pytest.raises(ValueError, match="torch-exponential"):
            run_audit([Endpoint("p", url, backend.model_id, None)], prompts[:2], spec, LocalReference(backend),
                      tmp_path, calibrator=calibrator)
    assert proxy.state.forwarded == 0


def test_a_seeded_audit_without_bands_refuses_before_any_request(backend, servers, prompts, tmp_path):
    """Settings no shipped calibration covers (top-k 40), or the shipped one at another FPR: refused, saying so."""
    from verinfer.api import audit

    proxy = counting_proxy(servers["honest"], fail_after=None)
    with asgi_in_thread(proxy) as url:
        with pytest.raises(ValueError, match="no bands for .* and no shipped calibration for these settings;"):
            audit({"p": url}, out=tmp_path, prompts=prompts, n=2, mode="seeded", profile="vllm", top_k=40,
                  top_p=0.95, max_tokens=8, api_key_env=None, backend=backend)
        with pytest.raises(ValueError, match=r"the shipped calibration-smollm2-135m-vllm-t1-k50-p0.95-minp0.json "
                                             r"judges at 0.01 FPR, not 0.05"):
            audit({"p": url}, out=tmp_path, prompts=prompts, n=2, mode="seeded", profile="vllm", top_k=50,
                  top_p=0.95, max_tokens=8, api_key_env=None, backend=backend, fpr=0.05)
    assert proxy.state.forwarded == 0
    assert not (tmp_path / "p").exists()


def test_a_seeded_audit_at_shipped_settings_is_judged_by_the_shipped_calibration(backend, servers, prompts, tmp_path):
    """Issue #41 item 5, one verdict rule: with no bands or calibration given, a seeded audit at settings a
    calibration ships for is judged by it, as `verify` judges the same tokens (the margin and the
    sampler-shape detectors), and the reports name it."""
    from verinfer.api import audit

    stages = []
    result = audit({"p": servers["honest"]}, out=tmp_path, prompts=prompts, n=3, mode="seeded", profile="vllm",
                   top_k=50, top_p=0.95, max_tokens=8, api_key_env=None, backend=backend, on_stage=stages.append)
    shipped = "calibration-smollm2-135m-vllm-t1-k50-p0.95-minp0.json (shipped default)"
    assert result.judged_by == shipped and result.bands is None
    assert any(s.startswith(f"judged by {shipped}: the margin and the sampler-shape detectors") for s in stages), stages
    assert json.loads(result.reports[0].read_text())["calibration"] == shipped
    assert f"Judged by the calibration {shipped}" in result.reports[1].read_text()
    assert result.providers[0].verdict.consistent, result.providers[0].verdict.text
    assert "4 detectors" in result.providers[0].verdict.method  # the calibrated rule and its side tests, not bands'


def test_api_audit_model_is_the_local_reference_and_old_names_still_work(backend, servers, prompts, tmp_path):
    """``model=`` is the reference model in api.audit as in the CLI: a provider's id there is refused
    with the new name before anything loads; ``reference_model=`` / ``sampler=`` keep working, warned,
    with ``model=`` then keeping its old meaning (the id sent to providers)."""
    from verinfer.api import audit

    with pytest.raises(ValueError, match="served_model='gpt-4o'"):
        audit({"p": "http://127.0.0.1:9/v1"}, out=tmp_path / "a", model="gpt-4o", api_key_env=None)
    assert not (tmp_path / "a").exists()
    proxy = counting_proxy(servers["honest"], fail_after=None)
    with asgi_in_thread(proxy) as url:
        with pytest.warns(DeprecationWarning, match="now model="), \
                pytest.warns(DeprecationWarning, match="now profile="):
            with pytest.raises(ValueError, match="no bands for"):  # refused before any request, as without them
                audit({"p": url}, out=tmp_path / "b", prompts=prompts, n=2, mode="seeded", sampler="vllm",
                      reference_model="smollm2-135m", model="provider-id", top_k=40, top_p=0.95,
                      max_tokens=8, api_key_env=None, backend=backend)
    assert proxy.state.forwarded == 0


def test_reports_show_the_bands_file_without_the_installation_path(audit):
    _, (json_path, html_path) = audit
    doc = json.loads(json_path.read_text())
    assert doc["bands"]["source"] == "bands-smollm2-135m-greedy.json", doc["bands"]
    assert "site-packages" not in html_path.read_text() and "src/verinfer" not in html_path.read_text()
