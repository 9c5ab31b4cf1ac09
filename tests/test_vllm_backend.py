"""``--backend vllm`` without vLLM: the process, the protocol, the head and the commands' options, with
``tests/fixtures/fake_vllm_worker.py`` (the worker's arguments and protocol, hidden states from
transformers) in place of vLLM. The real vLLM CPU engine is in ``tests/test_engine_vllm_backend.py``."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy

from tests.cli_app import invoke
from verinfer import api
from verinfer.commits.activation_difr import FingerprintSpec
from verinfer.commits.trace_commits import CommitSpec
from verinfer.models import vllm_backend
from verinfer.models.load import ReferenceFailed
from verinfer.models.vllm_backend import VllmBackend, engine_args
from verinfer.serve import ServeConfig, serve_in_thread
from verinfer.trace import write_traces

FAKE = Path(__file__).parent / "fixtures" / "fake_vllm_worker.py"


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_backend, "WORKER", FAKE)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a failed worker's log stays there
    monkeypatch.setenv(vllm_backend.PYTHON_ENV, sys.executable)
    yield
    api._load.cache_clear()


@pytest.fixture(scope="module")
def traces():
    honest = api.generate("chitchat", n=6, max_tokens=40, seed=11)
    wrong = [replace(t, id=t.id + "-wrong-seed", sampling=t.sampling.with_(seed=t.sampling.seed + 1)) for t in honest]
    return honest, wrong


def test_engine_arguments_are_parsed_or_refused():
    assert engine_args("vllm") == {}
    assert engine_args("vllm:tensor_parallel_size=2,gpu_memory_utilization=0.8,quantization=fp8") == {
        "tensor_parallel_size": 2, "gpu_memory_utilization": 0.8, "quantization": "fp8"}
    for bad, said in (("sglang", "unknown backend"), ("vllm:tp", "not KEY=VALUE"), ("vllm:2x=1", "not KEY=VALUE")):
        with pytest.raises(ValueError, match=said):
            engine_args(bad)


def test_scores_from_the_workers_hidden_states_equal_the_transformers_backends(fake_vllm, backend, traces, tmp_path):
    honest, wrong = traces
    ref = VllmBackend.load("smollm2-135m", "float32", "cpu", {"tensor_parallel_size": 1})
    try:
        assert (ref.vocab_size, ref.hidden_size, ref.stop_ids(), ref.model_id, ref.dtype_name) == (
            backend.vocab_size, backend.hidden_size, backend.stop_ids(), backend.model_id, backend.dtype_name)
        for claimed in (honest, wrong):
            a, b = api.verify(claimed, backend=backend), api.verify(claimed, backend=ref)
            ca, cb = a.columns, b.columns
            for column in ("trace_id", "position", "exact_match"):
                assert list(ca[column]) == list(cb[column]), column
            for column in ("margin", "depth_shift"):  # the same rows, unpadded: float noise only
                assert np.allclose(np.asarray(ca[column], float), np.asarray(cb[column], float), atol=1e-3,
                                   equal_nan=True), column
            assert a.summary.verdict_text == b.summary.verdict_text
        assert np.mean(np.asarray(api.verify(wrong, backend=ref).columns["exact_match"], bool)) < 0.9
        # a null fitted on the vLLM reference's scores records it, and judges no other reference's scores
        own = api.calibrate(api.verify(honest, backend=ref, default_calibration=False), batch_sizes=(1,))
        assert own.signature["reference"] == "vllm" and "reference" not in a.scored.signature
        assert api.verify(honest, backend=ref, calibration=own).summary.verdict is not None
        with pytest.raises(ValueError, match="reference: calibrated on the vllm reference's scores, these are the "
                                             "transformers reference's"):
            api.verify(honest, backend=backend, calibration=own)
        assert api.verify(wrong, backend=ref).summary.calibration.endswith("(shipped default)")  # transformers'
        # a seeded audit of a live server, judged with the vLLM reference by the shipped calibration
        with serve_in_thread(backend, ServeConfig(max_batch=4)) as url:
            audited = api.audit({"p": url}, out=tmp_path / "audit", prompts="chitchat", n=3, mode="seeded",
                                profile="vllm", top_k=50, top_p=0.95, max_tokens=16, api_key_env=None, backend=ref)
        assert audited.providers[0].verdict.consistent, audited.providers[0].verdict.text
        assert audited.judged_by.endswith("(shipped default)")
        # activation commits are checked against the same hidden states (TOPLOC and fingerprints)
        spec = CommitSpec(fingerprint=FingerprintSpec(dim=8, hidden_size=ref.hidden_size), toploc_k=128)
        committed = api.generate("chitchat", n=2, max_tokens=40, seed=5, backend=backend, commits=spec)
        checks = api.verify(committed, backend=ref).scored.commit_checks
        assert len(checks) == 2 and all(c.error is None and c.toploc_passed.all() for c in checks)
        with pytest.raises(ValueError, match="prefills only"):
            ref.hidden(None, None)
        with pytest.raises(ValueError, match="derived copies"):
            api.diagnose(wrong, backend=ref, variants="default")
        # diagnose runs its prefill-only candidates; the model search is never started (it would decode)
        found = api.diagnose(wrong, backend=ref)
        assert found.best.candidate.axis != "claim"
    finally:
        ref.worker.close()
    assert ref.worker.proc.returncode is not None and not ref.worker.scratch.exists()


def test_an_engine_that_fails_is_named_with_its_log(fake_vllm, monkeypatch, traces):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "load")
    with pytest.raises(ReferenceFailed, match=r"could not load the model: ValueError.*\(log: .*vllm\.log\)"):
        VllmBackend.load("smollm2-135m")
    monkeypatch.setenv("FAKE_VLLM_FAIL", "exit")
    ref = VllmBackend.load("smollm2-135m")
    with pytest.raises(ReferenceFailed, match=r"failed while prefilling \d+ tokens: RuntimeError: the fake engine "
                                              r"died \(log: "):
        api.verify(traces[0], backend=ref)
    assert ref.worker.log_path.exists()  # kept for the user to read
    ref.worker.close()


def test_commands_take_the_backend_and_refuse_what_it_cannot_do(fake_vllm, traces, tmp_path):
    path = tmp_path / "shards" / "wrong.jsonl"
    write_traces([replace(t, provider="acme", meta={"request_time": "2026-12-01T00:00:00Z"}) for t in traces[1]],
                 path)
    done = invoke("verify", path, "--backend", "vllm", "--scores", tmp_path / "v.parquet")
    assert done.returncode == 1 and "INCONSISTENT" in done.stdout, done.stdout + done.stderr
    db = f"sqlite:///{tmp_path}/m.db"
    done = invoke("monitor", path.parent, "--db", db, "--once", "--backend", "vllm")
    assert done.returncode == 1, done.stderr  # a window this run touched is INCONSISTENT
    engine = sqlalchemy.create_engine(db)
    with engine.connect() as conn:
        windows = conn.execute(sqlalchemy.text("SELECT verdict, tokens FROM windows")).all()
    engine.dispose()
    assert windows == [("INCONSISTENT", sum(len(t.output_token_ids) for t in traces[1]))], windows
    for args, said in ((("verify", path, "--backend", "sglang"), "unknown backend 'sglang'"),
                       (("verify", path, "--backend", "vllm", "--ray"), "--ray runs transformers replicas"),
                       (("monitor", path.parent, "--db", db, "--once", "--ray", "--backend", "vllm"),
                        "--ray runs transformers replicas"),
                       (("diagnose", path, "--backend", "vllm", "--variants", "default"), "derived copies"),
                       (("audit", "run", "-p", "x=http://127.0.0.1:9/v1", "--mode", "rank", "--backend", "vllm",
                         "-o", tmp_path / "a"), "--mode rank draws reference samples")):
        done = invoke(*args)
        assert done.returncode == 2 and said in done.stderr and len(done.stderr.strip().splitlines()) == 1, \
            done.stderr
    api.load_model(backend="vllm").worker.close()  # the loaded one, kept for the next command: not this time
    api._load.cache_clear()
    done = invoke("verify", path, "--backend", "vllm", env={vllm_backend.PYTHON_ENV: str(tmp_path / "no-python")})
    assert done.returncode == 2 and "not an executable interpreter" in done.stderr
