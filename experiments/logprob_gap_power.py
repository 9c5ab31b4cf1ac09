"""Power of the logprobs test, paired (logprob-gap bands) and unpaired (KS), over hidden system prompts
the project never tuned on, precision deviations and honest providers (issue #42 items 1 and 3).

    python experiments/logprob_gap_power.py [--pool N] [--resamplings R] [--budgets 25,100]

For each provider configuration the provider simulator samples one completion for each of ``--pool``
chitchat prompts (prompt sample seed 31: neither the bands' prompts, seed 1, nor the audit's default,
seed 0), T = 1, ``--max-tokens`` tokens, and returns its top-5 raw logprobs from its own model on the
prompt it saw (``auditing.logprobs.returned_logprobs``); the local fp32 reference scores the same
tokens. Audits of B queries are drawn ``--resamplings`` times from each pool (without replacement
within an audit) and judged at 1% FPR

    paired     ``pooled_verdict`` of the per-position mean clipped gap against the shipped logprob-gap
               bands' honest fp32 and bf16 groups (what ``--mode logprobs`` and ``auto`` run)
    unpaired   the two-sample KS test of the same values (LOGIC; what ran before, and still runs
               without bands)

Resampled audits share completions (a pool of 100 gives many 25-query audits, one 100-query audit),
so the rejection rates are estimates from one pool per configuration, not independent trials; the
Wilson interval shown treats them as independent and is too narrow for that reason.

The five hidden system prompts below were written for this experiment and never used to choose the
statistic, the clip or the bands (the bands contain no hidden-prompt group).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from verinfer.auditing.bands import find_bands  # noqa: E402
from verinfer.auditing.logprobs import (gap_rows, gap_signature, logprob_verdict, position_gaps,  # noqa: E402
                                        provider_values, reference_values, returned_logprobs)
from verinfer.files import write_atomic  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.models.backend import Backend  # noqa: E402
from verinfer.models.load import cache_root  # noqa: E402
from verinfer.prompts import load_prompts  # noqa: E402
from verinfer.sampling.params import SamplingParams  # noqa: E402
from verinfer.simulate.generate import build_requests  # noqa: E402
from verinfer.simulate.variants import get_variant  # noqa: E402
from verinfer.stats.evaluation import wilson_interval  # noqa: E402
from verinfer.stats.verdict import pooled_verdict  # noqa: E402

HIDDEN = ("You are a customer support agent for a phone company.",
          "Reply in a cheerful, enthusiastic tone.",
          "Do not discuss politics or religion.",
          "Keep every answer under three sentences.",
          "You are Max, a helpful assistant created by Example Inc.")
VARIANTS = {"honest fp32": "honest", "honest bf16": "bf16", "8-bit (w8)": "w8", "fp8 KV cache": "fp8-kv",
            "4-bit (w4)": "w4", **{f"hidden prompt {i + 1}": f"system-prompt:{t}" for i, t in enumerate(HIDDEN)}}
CLAIMED = SamplingParams(profile="torch-exponential", temperature=1.0)


def pool(backend, name: str, prompts, args, cache: Path) -> list[dict]:
    """Per completion: returned and reference values and their position structure (cached)."""
    path = cache / f"{name.replace(':', '_').replace(' ', '_').replace('.', '')[:60]}-{args.pool}-{args.max_tokens}.json"
    if path.exists():
        return json.loads(path.read_text())
    t0 = time.time()
    variant = get_variant(name)
    built = variant.build(backend)
    requests = build_requests(backend, prompts, CLAIMED.with_(seed=77_000), id_prefix="gap-")
    ids = [list(r.prompt_token_ids) for r in requests]
    outputs = [list(t.output_token_ids) for t in variant.generate(backend, requests, args.max_tokens, 16, backend=built)]
    seen = [list(variant.prompt(built, r).prompt_token_ids) for r in requests] if variant.prompt else ids
    returned = returned_logprobs(built, ids, outputs, seen)
    theirs, ours = provider_values(returned), reference_values(backend, returned)
    gaps = position_gaps(returned, theirs, ours)
    rows = [{"theirs": a.tolist(), "ours": b.tolist(), "gaps": g.tolist(), "tokens": len(r.token_ids)}
            for r, a, b, g in zip(returned, theirs, ours, gaps)]
    write_atomic(path, json.dumps(rows))
    print(f"{name}: pool of {len(rows)} in {time.time() - t0:.0f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--resamplings", type=int, default=200)
    parser.add_argument("--budgets", default="25,100")
    parser.add_argument("--fpr", type=float, default=0.01)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "logprob_gap_power.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = dt.datetime.now().astimezone()
    command = " ".join(["python experiments/logprob_gap_power.py", *sys.argv[1:]])
    backend = Backend.load()
    bands = find_bands(backend.model_id, gap_signature(CLAIMED), kind="logprob-gap")
    if bands is None:
        sys.exit("no shipped logprob-gap bands for the bundled model (verinfer audit bands --mode logprobs)")
    cache = cache_root() / "experiments" / "logprob_gap_power"
    cache.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts("chitchat", args.pool, seed=31, distinct=True)
    budgets = [int(b) for b in args.budgets.split(",")]
    rows = []
    for label, name in VARIANTS.items():
        data = [d for d in pool(backend, name, prompts, args, cache) if d["tokens"]]
        gap = float(np.mean([np.mean(d["gaps"]) for d in data]))
        cells = []
        for b in budgets:
            rng = np.random.default_rng(1000 + b)
            hits = {"paired": 0, "unpaired": 0}
            runs = args.resamplings if b < len(data) else 1
            for r in range(runs):
                pick = rng.choice(len(data), size=min(b, len(data)), replace=False)
                chosen = [data[i] for i in pick]
                seq = gap_rows([np.asarray(d["gaps"]) for d in chosen], bands.clip)
                v = pooled_verdict(seq, bands.honest_bands(), args.fpr, seed=r)
                hits["paired"] += not v.consistent
                u = logprob_verdict([np.asarray(d["theirs"]) for d in chosen], [np.asarray(d["ours"]) for d in chosen],
                                    np.array([d["tokens"] for d in chosen]), args.fpr)
                hits["unpaired"] += not u.consistent
            cells.append((b, runs, hits))
        rows.append((label, name, len(data), gap, cells))
        print(label, f"mean gap {gap:.4f}", [(b, {k: v / n for k, v in h.items()}) for b, n, h in cells], flush=True)

    def rate(k: int, n: int) -> str:
        w = wilson_interval(k, n)
        return f"{k / n:.2f} [{w.low:.2f}, {w.high:.2f}]" if n > 1 else f"{'rejected' if k else 'not rejected'} (1 audit)"

    head = ["| provider | completions | mean gap (nats / position) | " + " | ".join(
        f"{b} queries: paired | {b} queries: unpaired (KS)" for b in budgets) + " |",
            "|---|---:|---:|" + "---|---|" * len(budgets)]
    body = [f"| {label} | {n} | {gap:.4f} | " + " | ".join(
        f"{rate(h['paired'], runs)} | {rate(h['unpaired'], runs)}" for _, runs, h in cells) + " |"
            for label, _, n, gap, cells in rows]
    hidden = "\n".join(f"- hidden prompt {i + 1}: {t!r}" for i, t in enumerate(HIDDEN))
    lines = ["# The logprobs test, paired and unpaired", "", f"Command: `{command}`  ", f"Date: {started:%Y-%m-%d %H:%M %Z}  ",
             f"Machine: {describe(1)}  ", f"Bands: {bands.source} (clip {bands.clip:.4g})  ",
             f"Pools: {args.pool} chitchat prompts (seed 31), one completion each, T = 1, up to {args.max_tokens} tokens; "
             f"{args.resamplings} resampled audits per budget (one when the budget takes the whole pool); rejection "
             f"rate at {args.fpr:.0%} FPR with a Wilson 95% interval (too narrow: resampled audits share completions).",
             "", *head, *body, "", hidden, ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, "\n".join(lines))
    print("\n".join(head + body) + f"\n\nwrote {args.out}")


if __name__ == "__main__":
    main()
