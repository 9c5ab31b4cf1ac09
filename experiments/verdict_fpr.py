"""False-positive rate and power of the one verdict rule on held-out data.

    python experiments/verdict_fpr.py --out experiments/results/verdict_fpr.md

Generates traces on chitchat prompts with vLLM's seeded sampler (T=1, top-k 50, top-p 0.95) from
honest providers (fp32, and bf16 as GPU providers run) and misconfigured ones (4-bit weights, wrong
seed, fp8 KV cache), scores them with the fp32 reference, calibrates the bounded-margin detector
on the first half of the prompts (fp32 + bf16 honest tokens), and judges random sets of held-out
traces (the second half) with ``verinfer.stats.verdict.calibrated_verdict``: the share of honest
sets called INCONSISTENT is the verdict's false-positive rate (target: the calibration's FPR), the
share of misconfigured sets is its power. For comparison the two rules the verdict module replaced
are applied to the same flags: ``verify``'s (flag rate and its Wilson lower bound above the FPR)
and ``audit``'s (a single one-sided binomial test on all batches, no sequential looks).

Traces and scores are cached under ``$VERINFER_CACHE/experiments/verdict_fpr`` (a rerun only
re-analyses).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.stats import binomtest

from verinfer.machine import describe
from verinfer.models.backend import Backend
from verinfer.models.load import cache_root
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.scoring.scores import read_scores
from verinfer.scoring.traces import score_traces
from verinfer.simulate.generate import build_requests
from verinfer.simulate.variants import get_variant
from verinfer.stats.evaluation import wilson_interval
from verinfer.stats.summary import fit_calibrator
from verinfer.stats.verdict import CLIPPED, DETECTOR, calibrated_verdict, token_detector
from verinfer.trace import read_traces, write_traces

SOURCES = {"honest fp32": ("honest", True), "honest bf16": ("bf16", True), "w4 (4-bit weights)": ("w4", False),
           "wrong seed": ("wrong-seed", False), "fp8 KV cache": ("fp8-kv", False)}


def per_trace_scores(backend, variant: str, requests, max_tokens: int, cache: Path) -> list[dict[str, np.ndarray]]:
    """Score columns of each trace, in request order (generated once, cached as a trace file)."""
    path = cache / f"{variant}.jsonl"
    if path.exists():
        traces = read_traces(path)
    else:
        traces = get_variant(variant).generate(backend, requests, max_tokens, 16)
        write_traces(traces, path)
    scores = cache / f"{variant}.scores.parquet"
    cols = read_scores(scores) if scores.exists() else score_traces(backend, traces, scores).columns
    ids = np.asarray(cols["trace_id"], dtype=object)
    keys = ("margin", "cross_entropy", "exact_match")
    return [{k: np.asarray(cols[k])[ids == t.id] for k in keys} for t in traces]


def previous_rules(flags: np.ndarray, fpr: float) -> tuple[bool, bool]:
    """(verify's Wilson rule, audit's single binomial test) rejecting, as before the one rule."""
    k, n = int(flags.sum()), int(flags.size)
    wilson = k / n > fpr and wilson_interval(k, n).low > fpr
    binom = binomtest(k, n, fpr, alternative="greater").pvalue < fpr
    return wilson, binom


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="prompts (half calibrate, half held out)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--set-sizes", default="2,4,8,16", help="held-out traces per judged set")
    ap.add_argument("--batch-size", type=int, default=4, help="tokens per calibrated batch")
    ap.add_argument("--sets", type=int, default=2000, help="random held-out sets per source and size")
    ap.add_argument("--fpr", type=float, default=0.01)
    ap.add_argument("--rules", default=f"{DETECTOR[1]},{CLIPPED[1]}", help="margin detectors (calibrator rules) to compare")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/verdict_fpr.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = dt.datetime.now(dt.timezone.utc)
    backend = Backend.load("smollm2-135m")
    prompts = load_prompts("chitchat", args.n, seed=21)
    requests = build_requests(backend, prompts, SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95,
                                                               seed=31000))
    cache = cache_root() / "experiments" / "verdict_fpr" / f"n{args.n}-t{args.max_tokens}"
    cache.mkdir(parents=True, exist_ok=True)
    margins = {}
    for label, (variant, _) in SOURCES.items():
        print(f"{label}: generating and scoring", file=sys.stderr, flush=True)
        margins[label] = per_trace_scores(backend, variant, requests, args.max_tokens, cache)
    half = args.n // 2
    keys = ("margin", "cross_entropy", "exact_match")

    def fit(labels: list[str]):
        cal = [c for label in labels for c in margins[label][:half]]
        return fit_calibrator({k: np.concatenate([c[k] for c in cal]) for k in keys}, (args.batch_size,), args.fpr), \
            sum(c["margin"].size for c in cal)

    honest_labels = [label for label, (_, honest) in SOURCES.items() if honest]
    calibrations = {"pooled (fp32 + bf16)": fit(honest_labels), "bf16 only": fit(["honest bf16"])}
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in args.set_sizes.split(",")]
    rows = []
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    for (cal_name, (calibrator, cal_tokens)), rule in [(c, r) for c in calibrations.items() for r in rules]:
        for label, (_, honest) in SOURCES.items():
            held = [c["margin"] for c in margins[label][half:]]
            for k in sizes:
                one = wilson_rej = binom_rej = 0
                tokens = []
                for _ in range(args.sets):
                    pick = rng.choice(len(held), size=k, replace=False)
                    m = np.concatenate([held[i] for i in pick])
                    if m.size < args.batch_size:
                        continue
                    v = calibrated_verdict(m, calibrator, args.batch_size, "margin", rule)
                    flags = calibrator.predict(m, args.batch_size, metric="margin", rule=rule)
                    w, b = previous_rules(flags, args.fpr)
                    one += not v.consistent
                    wilson_rej += w
                    binom_rej += b
                    tokens.append(m.size)
                ci = wilson_interval(one, args.sets)
                rows.append({"calibration": cal_name, "rule": rule, "calibration_tokens": cal_tokens, "source": label,
                             "honest": honest, "traces": k, "tokens_median": float(np.median(tokens)),
                             "rejected": one / args.sets, "ci": [ci.low, ci.high],
                             "wilson_rule": wilson_rej / args.sets, "single_binomial": binom_rej / args.sets})
                print(json.dumps(rows[-1]), flush=True)
    command = "python experiments/verdict_fpr.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    load = os.getloadavg()
    lines = [
        "# Verdict false-positive rate and power on held-out traces", "",
        f"Command: `{command.strip()}`  ",
        f"Date: {started:%Y-%m-%d %H:%M} UTC; machine: {describe(args.threads)}; load average at start "
        f"{load[0]:.2f}  ",
        f"Setup: SmolLM2-135M, {args.n} chitchat prompts (seed 21) x up to {args.max_tokens} tokens, vLLM sampler "
        "(T=1, top-k 50, top-p 0.95, seeds 31000 + i), fp32 reference. Calibrations: margin detectors "
        f"({', '.join(f'`{r}`' for r in rules)}) fitted on the honest tokens of the first {half} prompts, pooled over fp32 and bf16 "
        f"({calibrations['pooled (fp32 + bf16)'][1]} tokens) or bf16 only ({calibrations['bf16 only'][1]} tokens), "
        f"batches of {args.batch_size} tokens, {args.fpr:.0%} FPR. Each row judges "
        f"{args.sets} random sets of held-out traces (prompts {half}-{args.n - 1}) with the one verdict rule "
        f"(sequential binomial test, Bonferroni over doubling looks, alpha = {args.fpr:.0%}).", "",
        "| calibration | detector | source | traces per set | median tokens | verdict: rejected (95% CI) | "
        "previous verify rule | previous audit rule |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['calibration']} | `{r['rule']}` | {r['source']} | {r['traces']} | {r['tokens_median']:.0f} | {r['rejected']:.2%} "
                     f"({r['ci'][0]:.2%}-{r['ci'][1]:.2%}) | {r['wilson_rule']:.2%} | {r['single_binomial']:.2%} |")
    lines += ["", "Detector the verdict uses by default (`verinfer.stats.verdict.token_detector`): " + "; ".join(
        f"{name}: `{token_detector(cal)[1]}`" for name, (cal, _) in calibrations.items()) + "."]
    lines += ["", "For honest sources *rejected* is the false-positive rate (target at most "
              f"{args.fpr:.0%}); for misconfigured ones it is the power. Sets of one source overlap "
              "(drawn from the same held-out traces), so rows are estimates for that population, not "
              "independent trials."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
