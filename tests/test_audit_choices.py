"""Seeded audits that send ``n > 1``: choice j of a request claims the request's seed + j, as vLLM
seeds the children of an ``n > 1`` request (and ``verinfer serve`` does the same); checked against a
live server, and the seed mapping shown to matter (choice 1 replayed under choice 0's seed diverges)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from verinfer.auditing.client import Endpoint
from verinfer.auditing.plan import AuditSpec, generation_calls
from verinfer.auditing.reference import LocalReference
from verinfer.auditing.run import run_audit
from verinfer.auditing.store import ResponseStore
from verinfer.prompts import load_prompts
from verinfer.serve import ServeConfig, serve_in_thread
from verinfer.trace import read_traces

SPEC = AuditSpec(mode="seeded", profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=7000, max_tokens=12,
                 choices=3)


@pytest.fixture(scope="module")
def prompts():
    return load_prompts("chitchat", 12, seed=9)


def test_requests_ask_n_and_claims_get_distinct_seeds(backend, prompts):
    calls = generation_calls(SPEC, prompts[:4], backend.tokenizer, "m")
    assert [c.body["n"] for c in calls] == [3] * 4
    assert [c.body["seed"] for c in calls] == [7000, 7003, 7006, 7009]  # prompt i: seed + i x choices
    claimed = [SPEC.params(SPEC.claim_index(i, j)).seed for i in range(4) for j in range(3)]
    assert claimed == list(range(7000, 7012))  # choice j: the request's seed + j, all distinct
    one = dataclasses.replace(SPEC, choices=1)
    assert "n" not in generation_calls(one, prompts[:2], backend.tokenizer, "m")[0].body
    assert [c.body["seed"] for c in generation_calls(one, prompts[:2], backend.tokenizer, "m")] == [7000, 7001]


@pytest.mark.parametrize("mode", ["greedy", "rank", "mmd"])
def test_choices_apply_to_seeded_audits_only(mode):
    problems = dataclasses.replace(SPEC, mode=mode, choices=2).problems()
    assert any("choices" in p for p in problems), problems
    assert any("choices" in p for p in dataclasses.replace(SPEC, choices=0).problems())


def test_seeded_audit_with_n_against_a_live_server(backend, prompts, tmp_path, one_torch_thread):
    from verinfer.scoring.traces import score_traces
    from verinfer.simulate.generate import build_requests, generate
    from verinfer.stats.summary import fit_calibrator

    honest = generate(backend, build_requests(backend, prompts, SPEC.params(0).with_(seed=123)), 16, 12)
    calibrator = fit_calibrator(score_traces(backend, honest).columns, (1,),
                                signature={"model": backend.model_id, "dtype": "float32",
                                           "sampling": [SPEC.signature()]})
    with serve_in_thread(backend, ServeConfig(max_batch=9)) as url:
        result = run_audit([Endpoint("honest", url, backend.model_id, None)], prompts[:3], SPEC,
                           LocalReference(backend), tmp_path, calibrator=calibrator, concurrency=3)
    audit = result.providers[0]
    assert audit.verdict.consistent and audit.verdict.exact_match_rate == 1.0, audit.verdict.text
    assert audit.verdict.sequences == 9 and audit.requests_sent == 3
    stored = ResponseStore(tmp_path / "honest" / "responses.jsonl").records()
    assert sorted((r["request"]["seed"], r["request"]["n"]) for r in stored) == [(7000, 3), (7003, 3), (7006, 3)]
    traces = read_traces(tmp_path / "honest" / "traces.jsonl")
    assert sorted(t.sampling.seed for t in traces) == list(range(7000, 7009))
    assert {t.id for t in traces} == {f"honest/{p.id}/{j}" for p in prompts[:3] for j in range(3)}

    # The mapping matters: every choice replayed under its request's seed (what an auditor that
    # ignored seed + j would claim) diverges for the choices j > 0 and stays exact for j = 0.
    same_seed = [dataclasses.replace(t, sampling=t.sampling.with_(seed=t.sampling.seed - int(t.id[-1])))
                 for t in traces]
    columns = score_traces(backend, same_seed).columns
    first = np.char.endswith(np.asarray(columns["trace_id"], dtype=str), "/0")
    exact = np.asarray(columns["exact_match"], dtype=bool)
    assert exact[first].all()
    assert exact[~first].mean() < 0.8, exact[~first].mean()  # a wrong seed: about 40% exact (README demo)
