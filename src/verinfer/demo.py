"""The main job on the bundled model (``verinfer demo``): honest and wrong-seed traces calibrated and
verified, then an honest and a 4-bit ``verinfer serve`` audited over loopback HTTP.

It runs on the public API (``verinfer.api``), as a user's own script would.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from verinfer.api import VerifyResult, calibrate, verify
from verinfer.files import write_atomic
from verinfer.models.backend import Backend
from verinfer.prompts import Prompt
from verinfer.sampling.params import SamplingParams
from verinfer.simulate.generate import build_requests, generate
from verinfer.stats.calibration import min_batches
from verinfer.stats.verdict import token_detector
from verinfer.trace import Trace, write_traces

Progress = Callable[[int], None] | None
DEMO_PROVIDERS = {"honest": (), "w4": ("w4",)}


@dataclass
class DemoResult:
    honest: VerifyResult
    wrong_seed: VerifyResult
    calibration_tokens: int
    batch_size: int
    detector: str  # the calibrated rule token verdicts used (verinfer.stats.verdict.token_detector)
    out_dir: Path
    audit: object | None = None  # verinfer.auditing.run.AuditResult of the loopback audit
    audit_report: Path | None = None


def run_demo(backend: Backend, prompts: Sequence[Prompt], out_dir: Path, max_tokens: int = 48,
             batch_size: int = 8, on_tokens: Progress = None,
             on_stage: Callable[[str], None] | None = None, audit_prompts: int = 0,
             audit_tokens: int = 32) -> DemoResult:
    """Generate honest and wrong-seed traces, calibrate on a separate honest set, verify both.

    Three sets of traces on the same prompts, all with vLLM's sampler (T=1, top-k 50, top-p 0.95):
    an honest calibration set, an honest test set, and a set generated with other seeds than the
    ones it claims. The calibration set fixes the honest band; the two test sets are judged by it.
    With ``audit_prompts`` > 0, an honest and a 4-bit ``verinfer serve`` then run on loopback and
    the first ``audit_prompts`` prompts audit both over HTTP (``audit_loopback``).
    """
    stage = on_stage or (lambda _: None)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95)
    sets = {
        "calibration": build_requests(backend, prompts, base.with_(seed=1000), id_prefix="cal-"),
        "honest": build_requests(backend, prompts, base.with_(seed=5000), id_prefix="test-"),
        "wrong-seed": build_requests(backend, prompts, base.with_(seed=9000), id_prefix="test-"),
    }
    traces: dict[str, list[Trace]] = {}
    for name, requests in sets.items():
        stage(f"generating {name} traces")
        traces[name] = generate(backend, requests, max_tokens, batch_size, on_batch=on_tokens)
    # The wrong-seed provider claims the honest test seeds.
    claimed = {t.id: t.sampling.seed for t in traces["honest"]}
    traces["wrong-seed"] = [Trace(**{**t.__dict__, "sampling": t.sampling.with_(seed=claimed[t.id])})
                            for t in traces["wrong-seed"]]
    for name, ts in traces.items():
        write_traces(ts, out_dir / f"{name}.traces.jsonl")
    stage("verifying calibration traces")
    cal = verify(out_dir / "calibration.traces.jsonl", backend=backend)
    n_cal = int(cal.columns["margin"].size)
    calib_batch = max((b for b in (32, 16, 8, 4, 2, 1) if n_cal // b >= min_batches(0.01)), default=1)
    calibrator = calibrate(cal, batch_sizes=(calib_batch,), out=out_dir / "calibration.json")
    results = {}
    for name in ("honest", "wrong-seed"):
        stage(f"verifying {name} traces")
        results[name] = verify(out_dir / f"{name}.traces.jsonl", backend=backend, calibration=calibrator,
                               batch_size=calib_batch)
    write_atomic(out_dir / "summary.json", json.dumps({k: r.to_dict() for k, r in results.items()}, indent=1,
                                                      default=str))
    audit = report = None
    if audit_prompts:
        audit, report = audit_loopback(backend, list(prompts)[:audit_prompts], out_dir / "audit", audit_tokens,
                                       on_stage=stage)
    return DemoResult(results["honest"], results["wrong-seed"], n_cal, calib_batch,
                      " ".join(token_detector(calibrator)), out_dir, audit, report)


def audit_loopback(backend: Backend, prompts: Sequence[Prompt], out_dir: Path, max_tokens: int = 32,
                   providers: dict[str, tuple[str, ...]] = DEMO_PROVIDERS,
                   on_stage: Callable[[str], None] | None = None):
    """Serve each configuration on loopback, audit all of them, write the reports; returns
    (``AuditResult``, the HTML report's path)."""
    from verinfer.api import audit
    from verinfer.serve import ServeConfig, serve_in_thread

    with contextlib.ExitStack() as stack:
        urls = {}
        for name, misconfig in providers.items():
            if on_stage:
                on_stage(f"starting the {name} server on loopback")
            urls[name] = stack.enter_context(serve_in_thread(backend, ServeConfig(misconfig=misconfig,
                                                                                  max_batch=len(prompts))))
        result = audit(urls, out=out_dir, prompts=prompts, n=len(prompts), max_tokens=max_tokens,
                       concurrency=len(prompts), api_key_env=None, backend=backend, on_stage=on_stage)
    return result, result.reports[1]
