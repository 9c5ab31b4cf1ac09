"""Gemma-3-270M on the real vLLM CPU engine (0.32.0, its own venv; issue #40 item 1): the second bundled
model, with its 262,144-entry vocabulary, sliding-window layers and Gemma's chat format, served by the
engine users run and judged by verinfer.

Marked ``engines`` (``python -m pytest -q -m engines``; ``.ci/run`` runs them). The engine decodes the
model directory verinfer converted (``engines/vllm_cpu/run.py``), from prompts rendered with Gemma's turn
format.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from verinfer import api
from verinfer.trace import read_traces

pytestmark = [pytest.mark.engines, pytest.mark.xdist_group("vllm_cpu_gemma")]

RUN = Path(__file__).resolve().parents[1] / "engines" / "vllm_cpu" / "run.py"


def _run_module():
    spec = importlib.util.spec_from_file_location("vllm_cpu_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _greedy_calibration(gemma):
    """The greedy null ``verify`` tells a user to fit (``shipped.no_default``): the simulator's honest fp32
    and bf16 greedy traces of other prompts, pooled, each precision its own group."""
    from verinfer.prompts import load_prompts
    from verinfer.simulate.generate import build_requests
    from verinfer.simulate.variants import get_variant
    from verinfer.sampling.params import SamplingParams

    greedy = SamplingParams(profile="greedy", temperature=0.0)
    requests = build_requests(gemma, load_prompts("chitchat", 8, seed=41), greedy)
    results = [api.verify(get_variant(v).generate(gemma, requests, 32, 8), backend=gemma, default_calibration=False)
               for v in ("honest", "bf16")]
    return api.calibrate(results, batch_sizes=(4,), precisions=("fp32", "bf16"))  # 99 disjoint batches: 396 tokens


def test_vllm_cpu_engine_serves_gemma_and_verinfer_judges_it(gemma, tmp_path):
    run = _run_module()
    directory = run.model_dir("gemma3-270m")
    prompts = run.rendered_prompts(directory, "chitchat", 8, seed=5)
    assert all(ids[:2] == gemma.tokenizer.convert_tokens_to_ids(["<bos>", "<start_of_turn>"]) for _, ids in prompts)
    files, _ = run.generate(run.engine_python(), directory, prompts, ("greedy", "seeded"), "float32", 32, 777,
                            tmp_path, model_id="gemma3-270m")
    greedy, seeded = read_traces(files["greedy"]), read_traces(files["seeded"])
    assert {t.sampling.profile for t in seeded} == {"vllm-cpu"} and len(greedy) == len(seeded) == 8
    wrong = [replace(t, id=t.id + "-wrong-seed", sampling=t.sampling.with_(seed=t.sampling.seed + 1)) for t in seeded]

    honest_seeded, wrong_seed = api.verify(seeded, backend=gemma), api.verify(wrong, backend=gemma)
    honest_greedy = api.verify(greedy, backend=gemma, calibration=_greedy_calibration(gemma))
    for name, result in (("greedy", honest_greedy), ("seeded", honest_seeded), ("wrong seed", wrong_seed)):
        print(f"\n{name}: {result.summary.verdict_text}")
    for name, result in (("greedy", honest_greedy), ("seeded", honest_seeded)):
        exact = np.asarray(result.columns["exact_match"], bool)
        assert exact.size >= 100 and exact.all(), f"{name}: {exact.mean():.4f} exact on {exact.size} tokens"
        assert result.consistent is True, f"{name}: {result.summary.verdict_text}"
    # the seeded verdicts come from Gemma's own shipped calibration of the vllm-cpu profile
    assert "calibration-gemma3-270m-vllm-cpu-" in (honest_seeded.summary.calibration or ""), honest_seeded.summary.note
    assert wrong_seed.consistent is False, wrong_seed.summary.verdict_text
