"""verinfer's recorder inside vLLM's own OpenAI server (``--middleware``), marked ``engines``: a vLLM
server of its own (not the one ``tests/test_engine_vllm_server.py`` shares for the session, which idles
beside it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_engine_gateway import calibration, load_generator, monitor_once
from verinfer.production.exchange import Recording

pytestmark = [pytest.mark.engines, pytest.mark.xdist_group("middleware")]  # an engine of its own


def test_vllm_with_the_in_engine_recorder_verifies(backend, tmp_path):
    """``vllm serve --middleware verinfer.production.middleware.RecordingMiddleware``: no proxy; the
    engine's own API server records its traffic (seeds assigned, ids asked for and cut out) and the
    monitor finds it CONSISTENT; every answered choice is recorded once."""
    from tests.audit_servers import openai_server
    from tests.test_engine_vllm_server import READY_S, _run_module
    from verinfer.production.recorder import Counters, Recorder
    from verinfer.sharded import find_shards
    from verinfer.trace import read_traces

    run = _run_module()
    traces = tmp_path / "mw" / "traces"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "VERINFER_TRACES": str(traces),
           "VERINFER_PROFILE": "vllm-cpu", "VERINFER_MODEL": "smollm2-135m", "VERINFER_PROVIDER": "engine",
           "VERINFER_ASSIGN_SEEDS": "1", "VERINFER_SHARD_RECORDS": "5"}
    argv = lambda port: [str(run.engine_python()), "-m", "vllm.entrypoints.openai.api_server",  # noqa: E731
                         "--model", str(run.model_dir("smollm2-135m")), "--served-model-name", "smollm2-135m",
                         "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--host", "127.0.0.1",
                         "--port", str(port), "--middleware", "verinfer.production.middleware.RecordingMiddleware"]
    with openai_server(argv, tmp_path, env, READY_S) as url:
        answered = load_generator(url, 8, True)
    Recorder(traces, Recording("engine"), lambda *a, **k: None, Counters()).close()  # seals what exit left open
    recorded = [t for p in find_shards(traces) for t in read_traces(p)]
    assert answered == 9 and len(recorded) == 9 and len({t.id for t in recorded}) == 9
    assert {t.meta["token_source"] for t in recorded} == {"returned"}
    assert all(t.sampling.seed is not None for t in recorded) and any(t.meta["seed_assigned"] for t in recorded)
    windows = monitor_once(backend, tmp_path / "mw", calibration(backend, "vllm-cpu"), len(find_shards(traces)))
    print("\nvllm serve with the in-engine recorder: " + "; ".join(f"{w.note} ({w.tokens} tokens)" for w in windows))
    assert all(w.verdict == "CONSISTENT" and w.exact_match_rate >= 0.99 for w in windows), [w.note for w in windows]
