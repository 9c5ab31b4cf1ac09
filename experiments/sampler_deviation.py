"""Sampler deviations against the pooled fp32 + bf16 honest calibration: margin-only vs margin + shape.

    python experiments/sampler_deviation.py --out experiments/results/sampler_deviation.md

Generates traces on chitchat prompts with vLLM's seeded sampler claiming T=1, top-k 50, top-p 0.95,
from honest providers (fp32; bf16 as GPU providers run; batch-1 decode) and from providers whose
sampler deviates (top-k 40 / 25 / 60, top-p 0.76, temperature 1.1 / 0.9) while claiming the honest
settings. The fp32 reference scores them; a calibration is fitted on honest fp32 + bf16 traces of
calibration prompts (disjoint from the held-out prompts), once with the margin detector only
(``shape=False``, the verdict before issue #28) and once with the sampler-shape statistics
(``verinfer.scoring.sampler_shape``), and each variant's held-out traces are judged by the one
verdict rule. The table gives the verdict, its p-value and the tokens at the first rejecting look.

Traces are cached under ``$VERINFER_CACHE/experiments/sampler_deviation`` (fixed seeds; a rerun only
re-scores and re-analyses). ``--cal-prompts`` / ``--test-prompts`` / ``--max-tokens`` set the scale.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from verinfer.machine import describe
from verinfer.models.backend import Backend
from verinfer.models.load import cache_root
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.scoring.traces import score_traces
from verinfer.simulate.generate import build_requests
from verinfer.simulate.variants import get_variant
from verinfer.stats.summary import fit_calibrator
from verinfer.stats.verdict import calibrated_verdict
from verinfer.trace import read_traces, write_traces

CLAIM = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=7000)
ORDER = ("honest", "bf16", "top-k-40", "temperature-1.1", "top-p-0.76", "top-k-60", "temperature-0.9", "top-k-25",
         "batch-1")  # generated in this order; --generate-only may be stopped part way
POOL, TEST_OFFSET = 400, 200  # prompts drawn once; calibration takes the first ones, held-out ones start at 200


def traces_for(backend: Backend, variant: str, prompts, split: str, max_tokens: int, cache: Path,
               claim: SamplingParams = CLAIM):
    """Traces of ``variant`` claiming ``claim`` on ``prompts`` (generated once, cached)."""
    path = cache / f"{split}-m{max_tokens}-{variant}.jsonl"
    if path.exists():
        return read_traces(path)
    requests = build_requests(backend, prompts, claim.with_(seed=claim.seed + 100_000))  # request i: seed + i
    traces = get_variant(variant).generate(backend, requests, max_tokens, 12)
    write_traces(traces, path)
    print(f"generated {split} {variant}: {sum(len(t.output_token_ids) for t in traces)} tokens", flush=True)
    return traces


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cal-prompts", type=int, default=24, help="calibration prompts per honest precision")
    ap.add_argument("--test-prompts", type=int, default=12, help="held-out prompts per variant")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--batch-sizes", default="10,20", help="calibrated batch sizes (the verdict uses the largest)")
    ap.add_argument("--generate-only", action="store_true", help="fill the trace cache and stop")
    ap.add_argument("--set-traces", type=int, default=16, help="traces per random set")
    ap.add_argument("--draws", type=int, default=200, help="random sets per variant")
    ap.add_argument("--resample", type=int, default=None, help="bootstrap this many windows per batch size "
                    "(thresholds without the disjoint-batch FPR guarantee) for batches the honest tokens cannot fill")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.cal_prompts > TEST_OFFSET or args.test_prompts > POOL - TEST_OFFSET:
        raise SystemExit(f"--cal-prompts <= {TEST_OFFSET} and --test-prompts <= {POOL - TEST_OFFSET}")
    cache = cache_root() / "experiments" / "sampler_deviation"
    cache.mkdir(parents=True, exist_ok=True)
    backend = Backend.load("smollm2-135m", "float32")
    prompts = load_prompts("chitchat", POOL, seed=28)
    cal_prompts, test_prompts = prompts[:args.cal_prompts], prompts[TEST_OFFSET:TEST_OFFSET + args.test_prompts]
    cal = {v: traces_for(backend, v, cal_prompts, f"cal{args.cal_prompts}", args.max_tokens, cache)
           for v in ("honest", "bf16")}
    test = {v: traces_for(backend, v, test_prompts, f"test{args.test_prompts}", args.max_tokens, cache)
            for v in ORDER}
    if args.generate_only:
        return 0
    return report(backend, cal, test, tuple(int(s) for s in args.batch_sizes.split(",")), args, cache)


def subsets(cols: dict[str, np.ndarray], size: int, draws: int, rng: np.random.Generator):
    """Score columns of ``draws`` random sets of ``size`` traces (sets overlap)."""
    ids = np.asarray(cols["trace_id"])
    names = np.unique(ids)
    rows = {t: np.flatnonzero(ids == t) for t in names}
    for _ in range(draws):
        pick = np.concatenate([rows[t] for t in rng.choice(names, size=min(size, names.size), replace=False)])
        yield {k: np.asarray(v)[pick] for k, v in cols.items()}


def report(backend, cal, test, batch_sizes, args, cache: Path) -> int:
    def columns(split, variant, traces):
        path = cache / f"{split}-m{args.max_tokens}-{variant}.scores.parquet"
        return score_traces(backend, traces, path).columns

    honest = [columns(f"cal{args.cal_prompts}", v, t) for v, t in cal.items()]
    pooled = {k: np.concatenate([c[k] for c in honest]) for k in honest[0]}
    calibrations = {"margin only": fit_calibrator(pooled, batch_sizes, shape=False, resample=args.resample),
                    "margin + shape": fit_calibrator(pooled, batch_sizes, resample=args.resample)}
    rows = []
    for variant, traces in test.items():
        cols = columns(f"test{args.test_prompts}", variant, traces)
        cells = []
        for cal_ in calibrations.values():
            v = calibrated_verdict(cols, cal_)
            rng = np.random.default_rng(0)
            share = np.mean([not calibrated_verdict(c, cal_).consistent
                             for c in subsets(cols, args.set_traces, args.draws, rng)])
            cells.append(f"{v.label} (p = {v.p_value:.2g}{f', after {v.tokens_needed} tokens' if v.tokens_needed else ''}"
                         f"{f', by {v.decided_by}' if not v.consistent and len(v.detectors) > 1 else ''}); "
                         f"{share:.1%} of sets")
        exact = float(np.mean(cols["exact_match"]))
        kind = "honest" if get_variant(variant).honest else "deviation"
        rows.append(f"| {variant} ({kind}) | {len(cols['margin'])} | {exact:.2%} | {cells[0]} | {cells[1]} |")
    command = " ".join(shlex.quote(a) for a in ["python", "experiments/sampler_deviation.py", *sys.argv[1:]])
    text = "\n".join([
        f"# Sampler deviations: margin-only vs margin + shape verdict ({dt.date.today()})", "",
        f"Command: `{command}`  ", f"Machine: {describe(torch.get_num_threads())}; load average {os.getloadavg()[0]:.1f} at the report  ",
        f"Claim: {CLAIM.signature()}; calibration: honest fp32 + bf16 traces of {args.cal_prompts} prompts each "
        f"({sum(len(c['margin']) for c in honest)} tokens), "
        f"{'disjoint batches' if args.resample is None else f'{args.resample} bootstrap windows'} of {batch_sizes} tokens (the verdict "
        f"uses the largest), 1% FPR; held-out: {args.test_prompts} other prompts per variant, up to "
        f"{args.max_tokens} tokens each. Each cell: the verdict on all held-out tokens of the variant (p-value, "
        f"tokens at the first rejecting look, the detector with the smallest p), then the share of "
        f"{args.draws} random sets of {args.set_traces} held-out traces called INCONSISTENT (sets overlap).", "",
        "| variant | tokens | exact match | margin only | margin + shape |",
        "|---|---|---|---|---|", *rows, ""])
    print(text)
    if args.out:
        from verinfer.files import write_atomic
        write_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
