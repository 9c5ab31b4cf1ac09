"""The seedless modes against a reference API (``--reference-url``): the top-k approximation of the
completion scores, audits with ``verinfer serve`` as the trusted reference on loopback, and a
reference that cannot serve (unreachable, no prompt logprobs): one line, exit 2, the providers'
paid-for responses kept."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from tests.audit_servers import asgi_in_thread
from verinfer.auditing.client import Endpoint, ProviderClient
from verinfer.auditing.draws import completion_scores
from verinfer.auditing.plan import AuditSpec
from verinfer.auditing.reference import ApiReference
from verinfer.auditing.remote_reference import api_view, position_moments
from verinfer.auditing.run import run_audit
from verinfer.auditing.store import ResponseStore
from verinfer.prompts import Prompt
from verinfer.sampling.params import SamplingParams
from verinfer.serve import ServeConfig, serve_in_thread

SHORT = [Prompt(f"q{i}", (("user", text),)) for i, text in enumerate(
    ("Name a colour.", "Say hello.", "Pick a number.", "Name an animal.", "Give me a word.", "Name a city."))]


def _rows(backend, prompt, output):
    """Raw log-softmax rows at the output positions of prompt + output, and the output tokens."""
    (block,) = list(backend.prefill([prompt + output], [len(prompt)]))
    return torch.log_softmax(block.logits.double(), dim=-1).numpy(), np.array(output)


@pytest.mark.parametrize("params", [SamplingParams(profile="vllm", temperature=1.0),
                                    SamplingParams(profile="vllm", temperature=0.7),
                                    SamplingParams(profile="vllm", temperature=1.0, top_k=20, top_p=0.9)])
def test_position_moments_are_exact_with_the_whole_vocabulary_and_close_with_the_top_20(backend, params):
    prompt = backend.tokenizer.encode("The capital of France is")
    output = backend.tokenizer.encode(" Paris, a city of lights and a river that runs")
    exact = completion_scores(backend, [prompt], [output], params)
    rows, targets = _rows(backend, prompt, output)
    whole = [v.sum() for v in position_moments(*api_view(rows, targets, rows.shape[1]), params)]
    assert whole == pytest.approx([exact.logprob[0], exact.expected[0], exact.variance[0]], rel=1e-4, abs=1e-4)
    top = [v.sum() for v in position_moments(*api_view(rows, targets, 20), params)]
    if params.temperature == 1.0:
        assert top[0] == pytest.approx(exact.logprob[0], rel=1e-5)  # the claimed token's own logprob is returned (fp32 there)
    assert top[1] == pytest.approx(exact.expected[0], rel=0.1, abs=0.5)  # the tail is approximated, not lost


# --------------------------------------------------------------------------------------------------
# Over HTTP: verinfer serve as the trusted reference


@pytest.fixture(scope="module")
def servers(backend):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        # Providers sample without seeds here: the cheap sampler keeps the test fast.
        urls = {name: stack.enter_context(serve_in_thread(backend, ServeConfig(sampler="torch-exponential",
                                                                               misconfig=mis, max_batch=16)))
                for name, mis in {"honest": (), "w4": ("w4",), "layers-8": ("layers-8",), "reference": ()}.items()}
        yield urls
    torch.set_num_threads(threads)


def _api(backend, url: str, out) -> ApiReference:
    store = ResponseStore(out / "reference" / "responses.jsonl")
    return ApiReference(ProviderClient(Endpoint("reference", url, backend.model_id, None), store), backend.tokenizer)


@pytest.mark.parametrize("mode, other", [("rank", "layers-8"), ("logprobs", "w4")])
def test_seedless_audit_against_a_reference_api(servers, backend, tmp_path, mode, other):
    """The other provider: the family's first 8 of 30 layers for rank (what this checks is the reference
    API in the rank test's place; the first 20 layers needed 12 prompts x 16 tokens, where 6 x 8 once
    reached only p = 0.044, and 4-bit weights need far more queries for rank: RESULTS.md section 21),
    4-bit weights for logprobs. The seed in the request body makes the served tokens independent of the
    tests run before on the shared servers (unseeded, rank once gave layers-8 a p above the level in CI's
    order; the audit itself sends no seed)."""
    prompts, tokens = SHORT, 8
    spec = AuditSpec(mode=mode, max_tokens=tokens, samples=4, seed=3, extra_body={"seed": 3})
    endpoints = [Endpoint(n, servers[n], backend.model_id, None) for n in ("honest", other)]
    result = run_audit(endpoints, prompts, spec, _api(backend, servers["reference"], tmp_path), tmp_path)
    honest, w4 = result.providers
    assert "reference API" in result.reference
    assert honest.verdict.consistent, honest.verdict.text
    assert not w4.verdict.consistent, w4.verdict.text
    stored = [json.loads(x) for x in (tmp_path / "reference" / "responses.jsonl").read_text().splitlines()]
    echo = [r for r in stored if r["request"].get("echo")]
    assert echo and all(r["request"]["max_tokens"] == 0 and r["request"]["return_tokens_as_token_ids"] for r in echo)
    draws = [r for r in stored if r["kind"] == "reference-draws"]
    if mode == "rank":  # one request of n = samples per completion judged, each with its own seed
        assert len(draws) == len(prompts) and {r["request"]["n"] for r in draws} == {4}
        assert len({r["request"]["seed"] for r in draws}) == len(prompts)
    else:  # nothing is drawn: the provider's returned logprobs against the reference's prompt logprobs
        assert draws == [] and all(p["bounded_alternatives"] == 0 for p in honest.prompts)
        assert sum(p["bounded_alternatives"] for p in w4.prompts) > 0  # 4-bit top tokens the reference ranks low
    again = _api(backend, servers["reference"], tmp_path)
    rerun = run_audit(endpoints, prompts, spec, again, tmp_path)
    assert again.client.sent == 0 and [a.requests_sent for a in rerun.providers] == [0, 0]  # all stored
    assert rerun.providers[1].verdict.p_value == w4.verdict.p_value


def test_auto_against_a_reference_api_runs_the_seedless_tests(servers, backend, tmp_path):
    spec = AuditSpec(mode="auto", max_tokens=8, samples=3, choices=2, seed=3, extra_body={"seed": 3})
    result = run_audit([Endpoint("w4", servers["w4"], backend.model_id, None)], SHORT, spec,
                       _api(backend, servers["reference"], tmp_path), tmp_path)
    (w4,) = result.providers
    by = {t["test"]: t for t in w4.tests}
    assert {n for n, t in by.items() if t["ran"]} == {"logprobs", "rank", "mmd"}
    assert "no seeds were sent" in by["seeded"]["note"] and "reference API" in by["surprise"]["note"]
    assert not w4.verdict.consistent, w4.verdict.text


def _cli(args: list[str]):
    from typer.testing import CliRunner

    from verinfer.cli.main import app

    return CliRunner().invoke(app, ["audit", "run", *args])


def test_an_unreachable_reference_is_one_line_and_keeps_the_provider_responses(servers, tmp_path):
    out = tmp_path / "audit"
    result = _cli(["-p", f"honest={servers['honest']}", "--mode", "rank", "--samples", "2", "--max-tokens", "4",
                   "--n", "2", "--reference-url", "http://127.0.0.1:9/v1", "--retries", "0", "--out", str(out),
                   "--api-key-env", "VERINFER_NO_KEY"])
    assert result.exit_code == 2, result.output
    assert "reference API" in result.output and "connection failed" in result.output
    assert "Traceback" not in result.output
    assert len((out / "honest" / "responses.jsonl").read_text().splitlines()) == 2  # paid for, kept


def test_a_reference_without_prompt_logprobs_is_named(servers, tmp_path):
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/completions")
    async def no_logprobs(body: dict):
        return {"choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}]}

    out = tmp_path / "audit"
    with asgi_in_thread(app) as url:
        result = _cli(["-p", f"honest={servers['honest']}", "--mode", "logprobs", "--max-tokens", "4", "--n", "2",
                       "--reference-url", url, "--out", str(out), "--api-key-env", "VERINFER_NO_KEY"])
    assert result.exit_code == 2, result.output
    assert "must return prompt logprobs" in result.output and "Traceback" not in result.output
    assert len((out / "honest" / "responses.jsonl").read_text().splitlines()) == 2


def test_the_surprise_test_is_refused_against_a_reference_api(backend, tmp_path):
    """Its z-statistic uses the approximated moments themselves: an honest provider was flagged at
    10 and 25 queries most of the time (RESULTS.md section 22), so it is refused before any request."""
    api = _api(backend, "http://127.0.0.1:9/v1", tmp_path)
    with pytest.raises(ValueError, match="surprise needs the reference's exact per-position moments"):
        run_audit([Endpoint("p", "http://127.0.0.1:9/v1", backend.model_id, None)], SHORT,
                  AuditSpec(mode="surprise", max_tokens=4), api, tmp_path / "a")
    assert not (tmp_path / "a").exists()
