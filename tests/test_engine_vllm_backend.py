"""``--backend vllm`` on the real vLLM CPU engine (0.32.0, its own venv): the reference's hidden states
computed by vLLM itself score the engine's own traces as the transformers backend does, token for token.

Marked ``engines`` (``python -m pytest -q -m engines``; ``.ci/run`` runs them). The traces are the vLLM
CPU engine's own seeded fp32 outputs (``tests/fixtures/engines``), as claimed and under a wrong seed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from verinfer import api
from verinfer.commits.trace_commits import CommitSpec
from verinfer.models import vllm_backend
from verinfer.trace import read_traces

pytestmark = [pytest.mark.engines, pytest.mark.xdist_group("vllm_cpu")]

HERE = Path(__file__).resolve().parent
RUN = HERE.parent / "engines" / "vllm_cpu" / "run.py"


def _engine_python() -> Path:
    spec = importlib.util.spec_from_file_location("vllm_cpu_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.engine_python()


def test_vllm_hidden_states_score_as_the_transformers_reference(backend, monkeypatch):
    monkeypatch.setenv(vllm_backend.PYTHON_ENV, str(_engine_python()))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    honest = read_traces(HERE / "fixtures" / "engines" / "vllm_cpu_seeded_fp32.jsonl")
    wrong = [replace(t, id=t.id + "-wrong-seed", sampling=t.sampling.with_(seed=t.sampling.seed + 1)) for t in honest]
    reference = vllm_backend.VllmBackend.load("smollm2-135m", "float32")
    try:
        for claimed in (honest, wrong):
            a, b = api.verify(claimed, backend=backend), api.verify(claimed, backend=reference)
            ca, cb = a.columns, b.columns
            for column in ("trace_id", "position", "exact_match"):
                assert list(ca[column]) == list(cb[column]), column
            gap = np.abs(np.asarray(ca["margin"], float) - np.asarray(cb["margin"], float))
            assert np.nanmax(gap) < 1e-2, f"largest margin gap {np.nanmax(gap):.3g}"
            assert (a.consistent, a.summary.verdict_text) == (b.consistent, b.summary.verdict_text)
        assert a.consistent is False  # the wrong seed is caught by both
        assert np.asarray(api.verify(honest, backend=reference).columns["exact_match"], bool).mean() == 1.0
        # TOPLOC proofs (built by the transformers generator) checked against vLLM's hidden states
        committed = api.generate("chitchat", n=4, max_tokens=48, seed=9, backend=backend,
                                 commits=CommitSpec(toploc_k=128))
        checks = api.verify(committed, backend=reference).scored.commit_checks
        assert len(checks) == 4 and all(c.error is None and c.toploc_passed.all() for c in checks), checks
    finally:
        reference.worker.close()
    assert reference.worker.proc.returncode == 0  # the engine shut down cleanly, its scratch removed
    assert not reference.worker.scratch.exists()
