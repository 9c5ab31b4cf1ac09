"""Audit cost: tokens and requests a provider audit needs for a verdict, per misconfiguration.

Usage: python benchmarks/audit_cost.py [--prompts N] [--max-tokens N] [--orders N] [--fpr F]

For each provider configuration (honest, and misconfigurations the server can hide behind the same
API) a ``verinfer serve`` runs on loopback and ``verinfer.auditing.run_audit`` audits it over real HTTP
with greedy spot checks (chat requests, returned token ids, local fp32 reference, the shipped bands
for SmolLM2-135M). From the scored sequences:

- the full audit's verdict and p-value at the target FPR;
- *tokens / requests needed*: a sequential audit looks at doubling prefixes of the sequences
  (1, 2, 4, ... requests) and stops at the first look whose p-value is below FPR / looks
  (Bonferroni over the looks, so stopping early keeps the false-positive rate at FPR). The order
  in which prompts are asked matters, so the sequences are re-ordered ``--orders`` times at random
  and the median and 90th percentile of the tokens and requests at the stop are reported, with the
  share of orders that reach a verdict within the audit at all. For the honest providers that share
  is the measured false-positive rate of the sequential audit: the fp32 one replays the reference
  bit for bit in greedy mode, the bf16 one is honest GPU-like noise on prompts the bands were not
  built from (the bands sample chitchat with seed 1, this benchmark with seed 11).

Requests counted are generation requests (one per prompt); an audit against a reference API adds
one scoring request (echo, ``max_tokens: 0``) per sequence, so double them for that mode.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from verinfer.auditing.bands import find_bands  # noqa: E402
from verinfer.auditing.client import Endpoint  # noqa: E402
from verinfer.auditing.plan import AuditSpec  # noqa: E402
from verinfer.auditing.reference import LocalReference  # noqa: E402
from verinfer.auditing.run import run_audit  # noqa: E402
from verinfer.stats.verdict import pooled_verdict  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.models.backend import Backend  # noqa: E402
from verinfer.prompts import load_prompts  # noqa: E402
from verinfer.serve import ServeConfig, serve_in_thread  # noqa: E402

PROVIDERS = {
    "honest": (),
    "honest bf16 (held-out prompts)": ("bf16",),
    "w8 (8-bit weights)": ("w8",),
    "fp8 KV cache": ("fp8-kv",),
    "w4 (4-bit weights)": ("w4",),
    "injected system prompt": ("system-prompt:You are a helpful assistant. Keep answers short.",),
    "older chat template": ("old-template",),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--orders", type=int, default=200)
    ap.add_argument("--fpr", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results") / "audit_cost.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    started = dt.datetime.now(dt.timezone.utc)
    backend = Backend.load("smollm2-135m")
    prompts = load_prompts("chitchat", args.prompts, seed=11)
    spec = AuditSpec(mode="greedy", max_tokens=args.max_tokens)
    bands = find_bands(backend.model_id, spec.signature())
    honest = bands.honest_bands()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, misconfig in PROVIDERS.items():
            slug = "".join(c if c.isalnum() else "-" for c in name)[:40]
            with serve_in_thread(backend, ServeConfig(misconfig=misconfig, max_batch=8)) as url:
                t0 = time.monotonic()
                result = run_audit([Endpoint(slug, url, backend.model_id, None)], prompts, spec,
                                   LocalReference(backend), Path(tmp), bands=bands, fpr=args.fpr, concurrency=8)
                wall = time.monotonic() - t0
            a = result.providers[0]
            seq = a.sequences
            rng = np.random.default_rng(0)
            stops_tokens, stops_requests = [], []
            for _ in range(args.orders):
                order = rng.permutation(len(seq))
                needed = pooled_verdict(seq[order], honest, args.fpr, seed=int(rng.integers(2**31))).tokens_needed
                if needed is not None:
                    stops_tokens.append(needed)
                    stops_requests.append(int(np.searchsorted(np.cumsum(seq[order][:, 0]), needed) + 1))
            v = a.verdict
            row = {
                "provider": name, "misconfig": list(misconfig), "requests": len(seq), "tokens": v.tokens,
                "prompt_tokens": int(sum(len(c.prompt_token_ids) for c in a.claims)),
                "exact_match": v.exact_match_rate, "statistic": v.statistic, "ci": [v.ci_low, v.ci_high],
                "p_value": v.p_value, "consistent": v.consistent, "resembles": v.resembles,
                "orders_with_verdict": len(stops_tokens) / args.orders,
                "tokens_needed_median": float(np.median(stops_tokens)) if stops_tokens else None,
                "tokens_needed_p90": float(np.percentile(stops_tokens, 90)) if stops_tokens else None,
                "requests_needed_median": float(np.median(stops_requests)) if stops_requests else None,
                "requests_needed_p90": float(np.percentile(stops_requests, 90)) if stops_requests else None,
                "audit_wall_s": round(wall, 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    fmt = lambda x, f="{:.0f}": "-" if x is None else f.format(x)  # noqa: E731
    lines = [
        "# Audit cost: tokens and requests for a verdict",
        "",
        f"Command: `python benchmarks/audit_cost.py --prompts {args.prompts} --max-tokens {args.max_tokens} "
        f"--orders {args.orders} --fpr {args.fpr:g}`  ",
        f"Date: {started:%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {describe(args.threads)}  ",
        f"Load average (1/5/15 min) at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}  ",
        f"Setup: `verinfer serve` on loopback per configuration (SmolLM2-135M fp32, server batch 8), greedy chat "
        f"requests for {args.prompts} chitchat prompts (up to {args.max_tokens} tokens each, token ids returned), "
        f"local fp32 reference, bands `{Path(bands.source).name}` (honest bands: fp32 reference and bf16, "
        f"{' and '.join(str(len(b)) for b in honest)} sequences; p-value = the larger of the two), target FPR {args.fpr:.0%}; tokens / requests needed over {args.orders} random "
        "orders of the sequences (sequential doubling looks, Bonferroni over looks).",
        "",
        "| provider | requests | tokens | exact match | mean clipped margin (95% CI) | p-value | verdict | "
        "orders with a verdict | tokens needed (median / p90) | requests needed (median / p90) | audit wall s |",
        "|---|---:|---:|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['provider']} | {r['requests']} | {r['tokens']} | {r['exact_match']:.1%} | "
            f"{r['statistic']:.4f} ({r['ci'][0]:.4f}-{r['ci'][1]:.4f}) | {r['p_value']:.3g} | "
            f"{'consistent' if r['consistent'] else 'INCONSISTENT'}"
            f"{'' if r['consistent'] else ' (resembles ' + str(r['resembles']) + ')'} | "
            f"{r['orders_with_verdict']:.0%} | {fmt(r['tokens_needed_median'])} / {fmt(r['tokens_needed_p90'])} | "
            f"{fmt(r['requests_needed_median'])} / {fmt(r['requests_needed_p90'])} | {r['audit_wall_s']} |")
    lines += ["", "Raw rows: `audit_cost.json` beside this file."]
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
