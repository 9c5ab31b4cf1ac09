"""What the monitor's verification budget (``--sample``) costs in detection: traces recorded until a
4-bit provider is flagged, at 100%, 10% and 1% sampling.

    python experiments/monitor_sampling.py --out experiments/results/monitor_sampling.md

A 4-bit-weights provider (the catalogue's ``w4``: RTN, groups of 128) serves seeded chitchat traffic
with vLLM's sampler at the shipped settings (T=1, top-k 50, top-p 0.95; ``--traces`` requests of
``--tokens`` tokens, in arrival order); each trace is scored once by the fp32 reference. A monitor
sampling fraction f verifies the traces ``production.budget.Budget(f, key)`` chooses; after each
verified trace the stream so far is judged as the monitor judges a window (``production.monitor.Judge``:
the shipped calibration ``verify`` uses, 1% FPR). For each f and each of ``--keys`` keys, the number
of traces recorded (verified or not) when the verdict first turns INCONSISTENT; a key whose stream
never turns within the traces is reported as not flagged. Honest traffic is flagged at the verdict's
own rate whatever f is: a sample of honest traces is honest traces.

Traces and scores are cached under ``$VERINFER_CACHE/experiments/monitor_sampling``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from verinfer.machine import describe
from verinfer.models.backend import Backend
from verinfer.models.load import cache_root
from verinfer.production.budget import Budget
from verinfer.production.monitor import Judge
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.scoring.scores import read_scores, signature
from verinfer.scoring.traces import score_traces
from verinfer.simulate.generate import build_requests
from verinfer.simulate.variants import get_variant
from verinfer.trace import read_traces, write_traces

FRACTIONS = (1.0, 0.1, 0.01)


def traffic(backend, n: int, tokens: int, cache: Path):
    """The 4-bit provider's traces in arrival order and their per-token scores (cached)."""
    path, scores = cache / f"w4-{n}x{tokens}.jsonl", cache / f"w4-{n}x{tokens}.scores.parquet"
    if path.exists():
        traces = read_traces(path)
    else:
        requests = build_requests(backend, load_prompts("chitchat", n, seed=0),
                                  SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=20000))
        traces = get_variant("w4").generate(backend, requests, tokens, 16)
        write_traces(traces, path)
    cols = read_scores(scores) if scores.exists() else score_traces(backend, traces, scores).columns
    return traces, cols


def first_flag(traces, cols, budget: Budget, judge: Judge, sig: dict) -> int | None:
    """Traces recorded when the verdict over the verified ones first turns INCONSISTENT (None: never)."""
    ids = np.asarray(cols["trace_id"]).astype(str)
    verified: list[str] = []
    for i, t in enumerate(traces, 1):
        if not budget.chosen(t.id):
            continue
        verified.append(t.id)
        mask = np.isin(ids, verified)
        if judge({k: v[mask] for k, v in cols.items()}, sig)["verdict"] == "INCONSISTENT":
            return i
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=600)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache = cache_root() / "experiments" / "monitor_sampling"
    cache.mkdir(parents=True, exist_ok=True)
    backend = Backend.load()
    traces, cols = traffic(backend, args.traces, args.tokens, cache)
    sig = signature(traces, backend.model_id, backend.dtype_name)
    judge = Judge()
    tokens = len(cols["margin"]) / len(traces)
    rows = [f"# Monitor sampling: traces recorded until a 4-bit provider is flagged\n",
            f"`{' '.join(shlex.quote(a) for a in ['python', *sys.argv])}` on {describe(1)}, "
            f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: {len(traces)} traces of the `w4` provider "
            f"({tokens:.1f} tokens each on average), judged by "
            f"{judge(cols, sig)['judged_by']} at 1% FPR after each verified trace; {args.keys} sampling keys per "
            f"fraction (one for 100%).\n",
            "| sampled | keys | flagged within the traces | traces recorded until flagged: median (min-max) | "
            "traces verified until flagged (median) | at 10 traces/s (a small GPU engine): seconds to flag (median) |",
            "|---|---|---|---|---|---|"]
    for f in FRACTIONS:
        keys = 1 if f == 1 else args.keys
        found = [first_flag(traces, cols, Budget(f, f"key-{k}".encode() * 4), judge, sig) for k in range(keys)]
        hits = [n for n in found if n is not None]
        verified = [sum(Budget(f, f"key-{k}".encode() * 4).chosen(t.id) for t in traces[:n])
                    for k, n in enumerate(found) if n is not None]
        med = f"{np.median(hits):.0f} ({min(hits)}-{max(hits)})" if hits else "-"
        rows.append(f"| {f:.0%} | {keys} | {len(hits)} of {keys} | {med} | "
                    f"{np.median(verified):.0f} | {np.median(hits) / 10:.1f} |" if hits else
                    f"| {f:.0%} | {keys} | 0 of {keys} | not within {len(traces)} | - | - |")
        print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
