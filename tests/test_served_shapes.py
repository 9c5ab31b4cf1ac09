"""The shapes users serve (issue #40 item 2), fast: tiny random models that keep the published vocabularies.

Built by ``experiments/served_shapes.py``'s own builder (the published Llama-3-8B and Gemma-3-1B configs
with hidden size 64, one or two layers, random fp32 weights): every sampler profile replays exactly at
128,256 entries (262,144 entries: the trained Gemma-3-270M, ``tests/test_gemma.py``), TOPLOC commits pass
and tampered ones fail, and diagnose names a top-k 40 provider that claimed top-k 50 at 128k entries.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _experiment():
    """``experiments/served_shapes.py`` as a module (experiments/ is not a package)."""
    name = "served_shapes_experiment"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / "served_shapes.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules[name]


shapes = _experiment()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shapes")
    return {"llama": shapes.build_shape("llama3-8b", 1, root=root, tiny=True),
            "llama-other": shapes.build_shape("llama3-8b", 1, root=root, tiny=True, seed=1),
            "gemma": shapes.build_shape("gemma3-1b", 2, root=root, tiny=True)}


@pytest.fixture(scope="module")
def backends(built):
    from verinfer.models.backend import Backend

    return {k: Backend.load(str(v)) for k, v in built.items()}


def test_published_numbers_and_tiny_bodies(built, backends):
    llama = shapes.shape_config(shapes.SHAPES["llama3-8b"], 1)
    assert (llama["hidden_size"], llama["vocab_size"], llama["intermediate_size"]) == (4096, 128256, 14336)
    assert shapes.shape_config(shapes.SHAPES["qwen2.5-7b"], 1)["vocab_size"] == 152064
    gemma = shapes.shape_config(shapes.SHAPES["gemma3-1b"], 2)
    assert gemma["vocab_size"] == 262144 and gemma["layer_types"] == ["sliding_attention", "full_attention"]
    assert backends["llama"].vocab_size == 128256 and backends["llama"].hidden_size == 64
    assert backends["gemma"].vocab_size == 262144
    assert backends["gemma"].model.config.layer_types == ["sliding_attention", "full_attention"]
    assert backends["gemma"].model.config.sliding_window == 512
    # same seed, same weights (rebuilding reuses the directory); another seed, other weights
    a, b = backends["llama"].model.lm_head.weight, backends["llama-other"].model.lm_head.weight
    assert a.shape == b.shape and not (a == b).all()


def test_every_profile_replays_exactly(backends):
    """Greedy and every seeded profile (filtered and over the full vocabulary) at 128,256 entries, plus one
    long prompt: 100% of tokens exact. (262,144 entries and the sliding window: the trained Gemma-3-270M,
    ``tests/test_gemma.py``.)"""
    backend = backends["llama"]
    args = argparse.Namespace(n=2, max_tokens=8, seed=4242, long_prompt=600)
    results = shapes.run_replay(backend, args)
    profiles = {r["profile"] for r in results}
    from verinfer.sampling.profiles import profile_names

    assert profiles == set(profile_names())
    assert not [r for r in results if "skipped" in r]
    assert sum(r["tokens"] for r in results) == (len(results) - 1) * 2 * 8 + 8
    wrong = [(r["case"], r["mismatches"]) for r in results if r["exact"] != r["tokens"]]
    assert not wrong
    assert sum(r["above_tokenizer"] for r in results) > 0  # ids past the 49,152-entry tokenizer replay too


def test_toploc_commits_pass_and_tampered_ones_fail(backends):
    from verinfer import api

    backend = backends["llama"]
    sets = shapes.toploc_sets(backend, n=2, max_tokens=40, seed=99, other=backends["llama-other"])
    checked = {}
    for name, traces in sets.items():
        assert traces, name
        res = api.verify(traces, backend=backend, default_calibration=False)
        checked[name] = (*shapes.toploc_chunks(res), len(traces))
    passed, total, errors, prefill, n = checked["honest"]
    assert total == n * (1 + 2) and passed == total and prefill == n and not errors  # prefill proof + 2 chunks
    passed, total, errors, prefill, n = checked["another seed's outputs under the honest commits"]
    assert total == n * 3 and passed == prefill == n and len(errors) == n  # only the (same) prompts' proofs pass
    # another prompt's commit: refused (another length) or checked; its decode chunks never pass (a prefill
    # proof can: its top-128 entries may all lie in the chat template's rows that both prompts share)
    passed, total, errors, prefill, n = checked["each trace with the next trace's commits"]
    assert passed == prefill and len(errors) == n
    passed, total, errors, prefill, n = checked["commits from other weights (same shape, another seed)"]
    assert total == n * 3 and passed == 0 and len(errors) == n


def test_diagnose_names_top_k_40_at_128k(backends):
    from verinfer import api

    backend = backends["llama"]
    traces = shapes.diagnose_traces(backend, "top-k 40", n=3, max_tokens=48, seed=31)
    assert all(t.sampling.top_k == 50 for t in traces)
    d = api.diagnose(traces, backend=backend)
    b = d.best.candidate
    assert b.axis == "top_k" and b.interval[0] <= 40 <= b.interval[1], d.text  # fitted (issue #41 item 1)
    assert d.claim_rejected and d.claim.exact < 1.0
