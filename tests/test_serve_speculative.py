"""``verinfer serve --speculative``: seeded sampling decoded with vLLM's speculative sampler over real
loopback HTTP, replayed exactly by the verifier, through the audit client's traces too."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")

from verinfer.auditing.client import Endpoint  # noqa: E402
from verinfer.auditing.plan import AuditSpec  # noqa: E402
from verinfer.auditing.reference import LocalReference  # noqa: E402
from verinfer.auditing.run import run_audit  # noqa: E402
from verinfer.auditing.store import ResponseStore  # noqa: E402
from verinfer.prompts import load_prompts  # noqa: E402
from verinfer.sampling.params import SamplingParams  # noqa: E402
from verinfer.scoring.token_difr import verify_traces  # noqa: E402
from verinfer.serve import ServeConfig, serve_in_thread  # noqa: E402
from verinfer.serve.app import ServedModel  # noqa: E402
from verinfer.stats.summary import fit_calibrator  # noqa: E402
from verinfer.trace import Trace, read_traces  # noqa: E402

# A draft of 24 of the 30 layers, 2 drafts per step, at T = 0.7: every mode (a, r, b) shows up in 12 tokens.
SPEC = "layers:24:2"
CLAIM = {"draft": "layers:24", "k": 2}
SAMPLING = {"temperature": 0.7, "top_p": 0.95}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(backend):
    with serve_in_thread(backend, ServeConfig(speculative=SPEC, batch_wait_s=0.05)) as url:
        yield url


def _verify(backend, traces: list[Trace]) -> dict[str, np.ndarray]:
    blocks = list(verify_traces(backend, traces))
    return {k: np.concatenate([b.columns[k] for b in blocks]) for k in ("exact_match", "spec_mode")}


def test_seeded_outputs_verify_exactly_and_repeat(server, backend):
    prompt = backend.tokenizer.encode("The three most common trees in a northern forest are")
    body = {"prompt": prompt, "max_tokens": 12, "seed": 11, "n": 2, "logprobs": 1, "return_token_ids": True,
            **SAMPLING}
    with httpx.Client(base_url=server, timeout=600) as client:
        first = client.post("/completions", json=body)
        assert first.status_code == 200, first.text
        again = client.post("/completions", json={**body, "n": 1})
        greedy = client.post("/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                   "return_token_ids": True})
        health = client.get(server.removesuffix("/v1") + "/health").json()
    choices = first.json()["choices"]
    traces = []
    for ch in choices:
        assert ch["verinfer_sampling"] == {"profile": "vllm", "top_k": -1, "min_p": 0.0, "seed": 11 + ch["index"],
                                           "speculative": CLAIM, **SAMPLING}
        modes = ch["verinfer_spec_modes"]
        assert len(modes) == len(ch["token_ids"]) == 12 and set(modes) <= set("arb")
        lp = ch["logprobs"]
        assert len(lp["tokens"]) == 12 and all(v <= 0 for v in lp["token_logprobs"])
        traces.append(Trace(id=f"t{ch['index']}", model=backend.model_id, prompt_token_ids=ch["prompt_token_ids"],
                            output_token_ids=ch["token_ids"], sampling=SamplingParams.from_dict(ch["verinfer_sampling"]),
                            spec_modes=modes))
        assert traces[-1].problems(backend.vocab_size) == []
    cols = _verify(backend, traces)
    assert cols["exact_match"].all()
    assert list(cols["spec_mode"]) == list("".join(t.spec_modes for t in traces))
    assert choices[0]["token_ids"] != choices[1]["token_ids"]  # choice j samples with seed + j
    # The same request gives the same tokens and modes.
    assert again.json()["choices"][0]["token_ids"] == choices[0]["token_ids"]
    assert again.json()["choices"][0]["verinfer_spec_modes"] == choices[0]["verinfer_spec_modes"]
    # Greedy requests keep the batched decoder (same tokens): they claim the draft but report no modes.
    g = greedy.json()["choices"][0]
    assert g["verinfer_sampling"]["speculative"] == CLAIM and "verinfer_spec_modes" not in g
    assert health["spec_requests"] == 3 and health["spec_tokens"] == 36
    assert health["spec_accepted"] == sum(c["verinfer_spec_modes"].count("a") for c in choices) + \
        again.json()["choices"][0]["verinfer_spec_modes"].count("a")


def test_streamed_seeded_audit_yields_traces_that_replay(server, backend, tmp_path):
    """``verinfer audit run --mode seeded --stream`` against the speculative server: the audit's
    traces claim the draft and carry the modes, the verifier replays them exactly, and only a
    calibration of the same speculative claim judges them (as ``verinfer verify`` would)."""
    spec = AuditSpec(mode="seeded", profile="vllm", seed=500, max_tokens=10, stream=True, **SAMPLING)
    rng = np.random.default_rng(0)  # a stand-in calibration: this test checks the traces, not the verdict
    columns = {"margin": rng.exponential(0.01, 400), "cross_entropy": rng.exponential(1.0, 400),
               "exact_match": np.ones(400, dtype=bool)}
    claimed = {"model": backend.model_id, "dtype": "float32", "sampling": [{**spec.signature(), "speculative": CLAIM}]}
    plain = {**claimed, "sampling": [spec.signature()]}
    prompts = load_prompts("chitchat", 2, seed=5)
    endpoint = Endpoint("spec", server, backend.model_id, None)
    # A calibration of plain decoding cannot judge the speculative traces: refused once they claim it
    # (the responses are kept, so the audit below sends nothing again).
    with pytest.raises(ValueError, match="the calibration does not match its traces"):
        run_audit([endpoint], prompts, spec, LocalReference(backend), tmp_path,
                  calibrator=fit_calibrator(columns, (1,), signature=plain), concurrency=2)
    calibrator = fit_calibrator(columns, (1,), signature=claimed)
    result = run_audit([endpoint], prompts, spec, LocalReference(backend), tmp_path, calibrator=calibrator,
                       concurrency=2)
    assert result.providers[0].requests_sent == 0
    assert all(r["request"]["stream"] for r in ResponseStore(tmp_path / "spec" / "responses.jsonl").records())
    traces = read_traces(tmp_path / "spec" / "traces.jsonl")
    assert len(traces) == 2
    for t in traces:
        assert t.sampling.speculative == CLAIM and t.sampling.seed in (500, 501)
        assert t.spec_modes is not None and len(t.spec_modes) == len(t.output_token_ids)
    assert _verify(backend, traces)["exact_match"].all()
    assert result.providers[0].verdict.exact_match_rate == 1.0


def _start_error(backend, config: ServeConfig) -> str:
    """What stops a server from starting: a config problem, or the ValueError building it raises."""
    if config.problems():
        return config.problems()[0]
    with pytest.raises(ValueError) as info:
        ServedModel(backend, config)
    return str(info.value)


def test_a_malformed_value_fails_at_start_with_one_line_error(backend):
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           **{k: v for k, v in os.environ.items() if k in ("HOME", "VERINFER_CACHE", "PYTHONPATH")}}
    proc = subprocess.run([sys.executable, "-m", "verinfer.cli", "serve", "--speculative", "layers:24", "--port", "0"],
                          capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --speculative layers:24: ") and "layers:N" in lines[0], proc.stderr

    for value, fragment in (("layers:24:0", "speculative.k must be an integer in [1, 32]"),
                            ("bogus:2", "'bogus'"), ("", "expected DRAFT:K"),
                            ("layers:31:2", "the model has 30 decoder layers")):  # a draft that cannot be built
        problem = _start_error(backend, ServeConfig(speculative=value))
        assert problem.startswith(f"--speculative {value}:") and fragment in problem, problem
    assert "'vllm' profile" in _start_error(backend, ServeConfig(speculative=SPEC, sampler="vllm-v1"))
    # a sampler bug hooks the batched decoder, which speculative decoding does not use
    assert "bug-top2" in _start_error(backend, ServeConfig(speculative=SPEC, misconfig=("bug-top2",)))


def test_an_abandoned_speculative_request_stops_at_its_next_token(backend):
    from verinfer.serve.jobs import Abandoned, Job
    from verinfer.serve.scheduler import Scheduler
    from verinfer.serve.served import Drafts
    from verinfer.simulate.generate import Request

    worker = Scheduler(backend, drafts=Drafts(backend)).start()
    try:
        params = SamplingParams(seed=3, speculative=CLAIM, **SAMPLING)
        job = Job(Request("r", tuple(backend.tokenizer.encode("Once upon a time")), params), max_tokens=200)
        worker.submit(job)
        while not job.future.running():
            time.sleep(0.01)
        time.sleep(0.5)  # decoding: 200 tokens take far longer
        job.abandon()
        with pytest.raises(Abandoned):
            job.future.result(timeout=120)
        assert worker.abandoned == 1 and worker.spec_requests == 0 and worker.decode_steps == 0
    finally:
        worker.close()
