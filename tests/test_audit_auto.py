"""``--mode auto``: which tests the responses allow, their Holm combination into one verdict, and
audits of real servers on loopback (``verinfer serve``: honest, 4-bit weights, and a proxy that
rewrites seeds, which only the seeded test can see)."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from verinfer.auditing.auto import AutoTest, carried_by, combine, plan_tests, probe_calls, seeds_honoured
from verinfer.auditing.client import Call, Endpoint
from verinfer.auditing.plan import AuditSpec, generation_calls
from verinfer.auditing.reference import LocalReference
from verinfer.auditing.report import write_reports
from verinfer.auditing.responses import Claim
from verinfer.auditing.run import run_audit
from verinfer.prompts import Prompt, load_prompts
from verinfer.serve import ServeConfig, serve_in_thread
from verinfer.stats.verdict import Verdict

# --------------------------------------------------------------------------------------------------
# The combination


def _verdict(p: float, alpha: float, name: str = "s") -> Verdict:
    return Verdict(p >= alpha, p, alpha, 10, 2, "sequence", 0.5, name, 0.4, 0.6, 1, None if p >= alpha else 5, name)


def test_combine_is_holm_and_names_the_test_that_carried_the_decision():
    alpha = 0.01
    results = [AutoTest("seeded", None, "no bands"), AutoTest("logprobs", _verdict(0.004, alpha / 3, "lp"), "ran"),
               AutoTest("rank", _verdict(0.002, alpha / 3, "rk"), "ran"), AutoTest("mmd", _verdict(0.9, alpha / 3), "ran")]
    v = combine(results, alpha)
    assert v.p_value == pytest.approx(3 * 0.002) and not v.consistent  # min(1, K * min p), K = tests that ran
    assert carried_by(results) == "rank" and "[rank]" in v.statistic_name and "rank carried the decision" in v.method
    assert [r.p_holm for r in results[1:]] == pytest.approx([0.008, 0.006, 0.9])
    assert [r.rejects for r in results] == [None, True, True, False]
    assert "seeded not run: no bands" in v.method and v.tokens_needed == 5
    # Bonferroni's bound, not the smallest p: 0.004 alone would reject at 1%, not among three tests
    assert combine([AutoTest("rank", _verdict(0.004, alpha / 3), "ran"), AutoTest("mmd", _verdict(0.5, alpha / 3), "ran"),
                    AutoTest("logprobs", _verdict(0.7, alpha / 3), "ran")], alpha).consistent
    with pytest.raises(ValueError, match="no test could run"):
        combine([AutoTest("rank", None, "fewer than 2 completions")], alpha)


def test_combined_false_positive_rate_holds_for_dependent_and_independent_tests():
    """Under the null every test's p-value is uniform; however they depend on each other (the same
    completions feed them), the combined verdict rejects at most alpha of the time."""
    rng = np.random.default_rng(0)
    alpha, runs = 0.05, 4000
    for shared in (0.0, 0.9):  # independent, then strongly dependent p-values
        base = rng.uniform(size=runs)
        flagged = 0
        for b in base:
            ps = [b if rng.uniform() < shared else rng.uniform() for _ in range(4)]
            flagged += not combine([AutoTest(n, _verdict(p, alpha / 4), "ran")
                                    for n, p in zip(("seeded", "logprobs", "rank", "mmd"), ps)], alpha).consistent
        rate = flagged / runs
        assert rate <= alpha + 3 * np.sqrt(alpha * (1 - alpha) / runs), (shared, rate)


def _record(choices: list[dict]) -> dict:
    return {"response": {"choices": choices}}


def _claim(ids: list[int], source: str = "returned") -> Claim:
    return Claim("p", 0, [1], ids, source, None, None)


def test_tests_follow_the_form_of_the_responses():
    spec = AuditSpec(mode="auto", choices=2, seeds=True)
    lp = {"content": []}
    full = [_record([{"logprobs": lp}, {"logprobs": lp}])] * 3
    claims = [_claim([5, 6])] * 6
    why = plan_tests(spec, full, claims, True, True, "bands")
    assert {n for n, w in why.items() if w is None} == {"seeded", "surprise", "logprobs", "mmd"}
    assert "surprise ran" in why["rank"]  # rank's draws would multiply the cost for a weaker test
    api = plan_tests(spec, full, claims, True, False, "bands")  # a reference API: no surprise, rank instead
    assert api["rank"] is None and "reference API" in api["surprise"] and "reference API" in api["seeded"]
    assert "no seeds were sent" in plan_tests(AuditSpec(mode="auto", choices=2), full, claims, True, True,
                                              "bands")["seeded"]
    why = plan_tests(spec, [_record([{"logprobs": None}])] * 3, [_claim([5], "retokenized")] * 3, True, True, "bands")
    assert why["surprise"] is None
    assert "no logprobs" in why["logprobs"] and "fewer than 2 completions per prompt" in why["mmd"]
    assert "no token ids" in why["seeded"]
    assert "does not honour seeds" in plan_tests(spec, full, claims, False, True, "bands")["seeded"]
    assert "no bands or calibration" in plan_tests(spec, full, claims, True, True, None)["seeded"]
    assert "reference API" in plan_tests(spec, full, claims, True, False, "bands")["seeded"]


def test_auto_sends_seeds_only_when_asked_and_then_probes_them(backend):
    """Issue #42 item 2: customers' traffic carries no seed, and neither does auto's unless --seeds."""
    plain = generation_calls(AuditSpec(mode="auto", choices=2, seed=7), load_prompts("chitchat", 3, seed=11),
                             backend.tokenizer, "m")
    assert all("seed" not in c.body for c in plain) and plain[1].body["n"] == 2 and plain[1].body["logprobs"]
    assert "--seeds applies to --mode auto" in AuditSpec(mode="rank", seeds=True).problems()[0]
    spec = AuditSpec(mode="auto", choices=2, seed=7, seeds=True)
    calls = generation_calls(spec, load_prompts("chitchat", 3, seed=11), backend.tokenizer, "m")
    body = calls[1].body
    assert body["seed"] == 7 + 2 and body["n"] == 2 and body["logprobs"] is True and body["return_token_ids"]
    probes = probe_calls(calls)
    assert len(probes) == 2 and probes[0].key != calls[0].key
    assert {k: v for k, v in probes[0].body.items() if k != "user"} == calls[0].body
    assert seeds_honoured([(_claim([1, 2]), _claim([1, 2]))] * 2)
    assert not seeds_honoured([(_claim([1, 2]), _claim([1, 3])), (_claim([4]), _claim([4]))])
    assert not seeds_honoured([(_claim([]), _claim([]))])  # nothing to compare
    assert isinstance(probes[0], Call) and probes[0].meta["kind"] == "seed-probe"


# --------------------------------------------------------------------------------------------------
# Over HTTP (short prompts: the reference's draws and scores are prefills of prompt + completion)

SHORT = [Prompt(f"q{i}", (("user", text),)) for i, text in enumerate(
    ("Name a colour.", "Say hello.", "Pick a number.", "Name an animal.", "Give me a word.", "Name a city."))]


@pytest.fixture(scope="module")
def servers(backend):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(serve_in_thread(backend, ServeConfig(sampler="vllm", misconfig=mis,
                                                                              max_batch=16)))
               for name, mis in {"honest": (), "w4": ("w4",)}.items()}
    torch.set_num_threads(threads)


def test_auto_runs_every_test_the_responses_allow_and_names_the_carrier(servers, backend, tmp_path):
    """The seed in the request body (the audit sends none of its own) keeps the served tokens independent
    of the tests run before on the shared servers."""
    spec = AuditSpec(mode="auto", max_tokens=8, samples=3, choices=2, seed=3, extra_body={"seed": 11})
    endpoints = [Endpoint(n, u, backend.model_id, None) for n, u in servers.items()]
    result = run_audit(endpoints, SHORT, spec, LocalReference(backend), tmp_path)
    honest, w4 = result.providers
    assert honest.verdict.consistent, honest.verdict.text
    assert not w4.verdict.consistent, w4.verdict.text
    ran = {t["test"]: t for t in w4.tests if t["ran"]}
    assert set(ran) == {"surprise", "logprobs", "mmd"}  # no seeds sent: no seeded test; surprise, not rank
    carrier = min(ran.values(), key=lambda t: t["p_holm"])["test"]
    assert f"[{carrier}]" in w4.verdict.text and f"{carrier} carried the decision" in w4.verdict.method
    assert w4.verdict.p_value == pytest.approx(min(1.0, 3 * min(t["p_value"] for t in ran.values())))
    stored = [json.loads(x) for x in (tmp_path / "honest" / "responses.jsonl").read_text().splitlines()]
    assert len(stored) == 6 and {r["request"]["seed"] for r in stored} == {11}  # the body's own: no probes
    json_path, html_path = write_reports(result, backend.tokenizer)
    doc = json.loads(json_path.read_text())
    assert [t["test"] for t in doc["providers"][1]["tests"]] == ["seeded", "surprise", "logprobs", "rank", "mmd"]
    assert f"[{carrier}]" in html_path.read_text()


def test_auto_adds_the_seeded_test_when_bands_judge_it_and_it_alone_sees_a_seed_rewriting_proxy(
        servers, backend, tmp_path):
    """Bands for the claimed seeded settings are built here (honest fp32 and bf16 only, small)."""
    from tests.audit_servers import seed_proxy
    from verinfer.auditing.bands import Bands, build_bands

    spec = AuditSpec(mode="auto", max_tokens=8, samples=4, seed=3, seeds=True)
    path = tmp_path / "bands.json"
    path.write_text(json.dumps(build_bands(backend, SHORT,
                                           AuditSpec(mode="seeded", max_tokens=24, seed=3), variants=("honest", "bf16"))))
    (tmp_path / "proxy").mkdir()
    with seed_proxy(servers["honest"], tmp_path / "proxy") as proxy:
        endpoints = [Endpoint("honest", servers["honest"], backend.model_id, None),
                     Endpoint("proxy", proxy, backend.model_id, None)]
        result = run_audit(endpoints, SHORT, spec, LocalReference(backend),
                           tmp_path / "audit", bands=Bands.load(path))
    honest, proxy = result.providers
    assert {t["test"] for t in honest.tests if t["ran"]} == {"seeded", "surprise", "logprobs"}
    assert honest.verdict.consistent, honest.verdict.text
    assert not proxy.verdict.consistent and "[seeded]" in proxy.verdict.text, proxy.verdict.text
    by = {t["test"]: t for t in proxy.tests}
    assert by["seeded"]["rejects"] and not by["surprise"]["rejects"] and not by["logprobs"]["rejects"]


def test_the_command_line_prints_each_test_of_an_auto_audit(servers, tmp_path):
    from typer.testing import CliRunner

    from verinfer.cli.main import app

    out = tmp_path / "audit"
    result = CliRunner().invoke(app, ["audit", "run", "-p", f"honest={servers['honest']}", "--mode", "auto", "--n", "2",
                                      "--max-tokens", "4", "--samples", "2", "--out", str(out),
                                      "--api-key-env", "VERINFER_NO_KEY", "--extra-body", '{"seed": 5}'])
    assert result.exit_code == 0, result.output
    assert "logprobs: p " in result.output and "surprise: p " in result.output
    assert "seeded: not run (no seeds were sent" in result.output and "mmd: not run" in result.output
    assert "rank: not run (surprise ran" in result.output
    assert json.loads((out / "audit.json").read_text())["providers"][0]["tests"][0]["test"] == "seeded"


def test_verdict_lines_print_no_zero_width_interval_and_bound_an_underflowed_p():
    """Issue #42 item 4: "95% CI -21.3593--21.3593" and "p = 0" were printed."""
    flat = Verdict(False, 0.0, 0.01, 10, 2, "sequence", -21.3593, "surprise z", -21.3593, -21.3593, 1, 5, "m",
                   interval=False)  # as the surprise, logprobs and MMD tests give it: no interval
    assert "95% CI" not in flat.text and "p < 2e-308" in flat.text and "p = 0" not in flat.text
    assert "(95% CI 0.4000-0.6000)" in _verdict(0.5, 0.01).text and "p = 0.5" in _verdict(0.5, 0.01).text
    negative = Verdict(True, 0.5, 0.01, 10, 2, "sequence", -1.0, "s", -1.5, -0.5, 1, None, "m")
    assert "(95% CI -1.5000 to -0.5000)" in negative.text


def test_long_stages_report_progress_with_an_estimate():
    """Issue #42 item 4: draws and scoring printed nothing for up to 29 minutes."""
    from verinfer.auditing.progress import StageProgress

    now, lines = [0.0], []
    progress = StageProgress(lines.append, "reference draws", 100, "completions", every=10, clock=lambda: now[0])
    for t in (1, 5, 12, 14, 40):
        now[0] = t
        progress.advance(10)
    assert lines == ["reference draws: 30/100 completions in 12 s, about 28 s left",
                     "reference draws: 50/100 completions in 40 s, about 40 s left"]
    now[0] = 400
    progress.advance(50)
    assert lines[-1] == "reference draws: 100/100 completions in 6.7 min, done"
