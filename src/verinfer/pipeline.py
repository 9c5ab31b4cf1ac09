"""The jobs behind the command line: generate traces, verify them, calibrate, and the demo.

Each job is a plain function over the library (no printing); ``cli.py`` adds arguments, progress
bars and tables.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from verinfer.generate import Request, generate
from verinfer.models.backend import Backend
from verinfer.prompts import Prompt, render
from verinfer.sampling.params import SamplingParams
from verinfer.stats import Calibrator
from verinfer.stats.calibration import min_batches
from verinfer.trace import Trace, TraceError, write_traces
from verinfer.verify.commits import CommitCheck, check_commits, commit_rows
from verinfer.verify.report import ScoreWriter, Summary, fit_calibrator, summarize
from verinfer.verify.token_difr import SCORE_COLUMNS, verify_traces

Progress = Callable[[int], None] | None


def build_requests(backend: Backend, prompts: Sequence[Prompt], params: SamplingParams,
                   seed_stride: int = 1, id_prefix: str = "") -> list[Request]:
    """One request per prompt; request i gets seed ``params.seed + i * seed_stride``."""
    out = []
    for i, p in enumerate(prompts):
        seed = None if params.seed is None else params.seed + i * seed_stride
        out.append(Request(f"{id_prefix}{p.id}", tuple(render(backend.tokenizer, p)), params.with_(seed=seed),
                           tuple(p.message_dicts()) or None))
    return out


def check_traces(traces: Sequence[Trace], backend: Backend, source: str, skip_invalid: bool = False,
                 allow_model_mismatch: bool = False) -> tuple[list[Trace], list[str]]:
    """Validate traces against the verifier; raise on the first problem unless skipping (then count)."""
    kept, skipped = [], []
    for n, t in enumerate(traces, 1):
        problems = t.problems(backend.vocab_size, None if allow_model_mismatch else backend.model_id)
        if not problems:
            kept.append(t)
            continue
        message = f"{source}: record {n} (id {t.id!r}): {problems[0]}"
        if not skip_invalid:
            raise TraceError(message)
        skipped.append(message)
    if not kept:
        raise TraceError(f"{source}: no valid traces left to verify ({len(skipped)} skipped)")
    return kept, skipped


def verify_to_file(backend: Backend, traces: Sequence[Trace], scores_path: Path | None,
                   on_rows: Progress = None, commit_checks: list[CommitCheck] | None = None) -> dict[str, np.ndarray]:
    """Score every token (streaming to ``scores_path`` when given); returns the compact columns.

    Traces carrying activation commits are checked from the same prefill; their results are
    appended to ``commit_checks`` when a list is given.
    """
    keep = ("trace_id", "exact_match", "margin", "cross_entropy")
    parts: dict[str, list[np.ndarray]] = {k: [] for k in keep}

    def check(i: int, hidden) -> None:
        t = traces[i]
        if t.fingerprints:
            rows = commit_rows(hidden, len(t.prompt_token_ids), len(t.output_token_ids))
            commit_checks.append(check_commits(t.id, t.fingerprints, rows, len(t.prompt_token_ids)))

    wants_hidden = commit_checks is not None and any(t.fingerprints for t in traces)
    with ScoreWriter(scores_path) if scores_path else contextlib.nullcontext() as writer:
        for block in verify_traces(backend, traces, on_rows=on_rows,
                                   on_sequence_hidden=check if wants_hidden else None):
            if writer:
                writer.write(block.columns)
            for k in keep:
                parts[k].append(block.columns[k])
    return {k: np.concatenate(v) for k, v in parts.items()}


@dataclass
class DemoResult:
    honest: Summary
    wrong_seed: Summary
    calibration_tokens: int
    batch_size: int
    out_dir: Path
    audit: object | None = None  # verinfer.audit.run.AuditResult of the loopback audit
    audit_report: Path | None = None


def run_demo(backend: Backend, prompts: Sequence[Prompt], out_dir: Path, max_new_tokens: int = 48,
             batch_size: int = 8, on_tokens: Progress = None,
             on_stage: Callable[[str], None] | None = None, audit_prompts: int = 0,
             audit_tokens: int = 32) -> DemoResult:
    """Generate honest and wrong-seed traces, calibrate on a separate honest set, verify both.

    Three sets of traces on the same prompts, all with vLLM's sampler (T=1, top-k 50, top-p 0.95):
    an honest calibration set, an honest test set, and a set generated with other seeds than the
    ones it claims. The calibration set fixes the honest band; the two test sets are judged by it.
    With ``audit_prompts`` > 0, an honest and a 4-bit ``verinfer serve`` then run on loopback and
    the first ``audit_prompts`` prompts audit both over HTTP (``verinfer.audit.demo``).
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
        traces[name] = generate(backend, requests, max_new_tokens, batch_size,
                                on_batch=on_tokens)
    # The wrong-seed provider claims the honest test seeds.
    claimed = {t.id: t.sampling.seed for t in traces["honest"]}
    traces["wrong-seed"] = [Trace(**{**t.__dict__, "sampling": t.sampling.with_(seed=claimed[t.id])})
                            for t in traces["wrong-seed"]]
    columns = {}
    for name, ts in traces.items():
        write_traces(ts, out_dir / f"{name}.traces.jsonl")
        stage(f"verifying {name} traces")
        columns[name] = verify_to_file(backend, ts, out_dir / f"{name}.scores.parquet")
    n_cal = int(columns["calibration"]["margin"].size)
    calib_batch = max((b for b in (32, 16, 8, 4, 2, 1) if n_cal // b >= min_batches(0.01)), default=1)
    calibrator = fit_calibrator(columns["calibration"], (calib_batch,))
    (out_dir / "calibration.json").write_text(json.dumps(calibrator.to_dict(), indent=1))
    honest = summarize(columns["honest"], calibrator, calib_batch)
    wrong = summarize(columns["wrong-seed"], calibrator, calib_batch)
    (out_dir / "summary.json").write_text(json.dumps({"honest": honest.to_dict(), "wrong-seed": wrong.to_dict()},
                                                     indent=1, default=str))
    audit = report = None
    if audit_prompts:
        from verinfer.audit.demo import audit_loopback

        audit, report = audit_loopback(backend, list(prompts)[:audit_prompts], out_dir / "audit", audit_tokens,
                                       on_stage=stage)
    return DemoResult(honest, wrong, n_cal, calib_batch, out_dir, audit, report)


def load_calibrator(path: Path) -> Calibrator:
    try:
        return Calibrator.from_dict(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read calibration file ({exc})") from None


__all__ = ["SCORE_COLUMNS", "build_requests", "check_traces", "load_calibrator", "run_demo", "verify_to_file"]
