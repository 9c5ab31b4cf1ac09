"""Acceptance: real model, traces generated with a KV cache, verified by prefill (issue #3)."""

import dataclasses

import numpy as np
import pytest

from verinfer.simulate.generate import generate
from verinfer.simulate.generate import build_requests
from verinfer.scoring.traces import score_traces
from verinfer.sampling.params import SamplingParams
from verinfer.scoring.scores import read_scores
from verinfer.scoring.token_difr import verify_traces

SAMPLED = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=1000)
MAX_NEW = 40


@pytest.fixture(scope="module")
def honest(backend, chat_prompts):
    return generate(backend, build_requests(backend, chat_prompts, SAMPLED), MAX_NEW, batch_size=6)


def scores(backend, traces, **kw):
    blocks = list(verify_traces(backend, traces, **kw))
    return {k: np.concatenate([b.columns[k] for b in blocks]) for k in blocks[0].columns}


def test_honest_vllm_traces_replay(backend, honest):
    s = scores(backend, honest)
    assert s["margin"].size == sum(len(t.output_token_ids) for t in honest) > 300
    assert s["exact_match"].mean() >= 0.98
    assert (s["margin"] == 0).mean() >= 0.95


def test_wrong_seed_is_far_from_honest(backend, honest):
    h = scores(backend, honest)
    wrong = [dataclasses.replace(t, sampling=t.sampling.with_(seed=t.sampling.seed + 10_000)) for t in honest]
    w = scores(backend, wrong)
    assert w["exact_match"].mean() <= h["exact_match"].mean() - 0.15
    mean_h, mean_w = np.minimum(h["margin"], 20).mean(), np.minimum(w["margin"], 20).mean()
    assert mean_w >= 10 * mean_h and mean_w > 0.1


def test_greedy_traces_replay(backend, chat_prompts):
    traces = generate(backend, build_requests(backend, chat_prompts, SamplingParams(profile="greedy")), MAX_NEW, 6)
    s = scores(backend, traces)
    assert s["exact_match"].mean() >= 0.99


def test_torch_exponential_traces_replay(backend, chat_prompts):
    params = SamplingParams(profile="torch-exponential", temperature=0.8, top_p=0.9, seed=77)
    traces = generate(backend, build_requests(backend, chat_prompts[:6], params), 24, 6)
    s = scores(backend, traces)
    assert s["exact_match"].mean() >= 0.98


def test_chunking_does_not_change_scores(backend, honest):
    """Tiny micro-batches and row blocks (the streaming path) give the same scores as large ones."""
    big = scores(backend, honest)
    small = scores(backend, honest, token_budget=64, row_block=7)
    order_big = np.lexsort((big["position"], big["trace_id"].astype(str)))
    order_small = np.lexsort((small["position"], small["trace_id"].astype(str)))
    for key in ("claimed", "verifier_token", "exact_match"):
        np.testing.assert_array_equal(big[key][order_big], small[key][order_small])
    np.testing.assert_allclose(big["margin"][order_big], small["margin"][order_small], atol=1e-3)


def test_scores_file(backend, honest, tmp_path):
    path = tmp_path / "s.parquet"
    compact = score_traces(backend, honest[:3], path).columns
    table = read_scores(path)
    assert set(table) >= {"trace_id", "position", "claimed", "margin", "filter_distance", "gumbel_rank"}
    assert len(table["margin"]) == len(compact["margin"]) == sum(len(t.output_token_ids) for t in honest[:3])
    assert not list(tmp_path.glob("*.tmp"))
