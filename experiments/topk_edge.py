"""A smaller top-k than claimed, on disjoint sets: flagged by verify and named by diagnose (issue #41 item 4).

    python experiments/topk_edge.py --sets 10 --set-tokens 2000 --honest-sets 4 \\
        --out experiments/results/topk_edge.md

A provider samples with vLLM's seeded sampler at T = 1, top-k 40, top-p 0.95 on the bundled SmolLM2-135M
in fp32 and claims top-k 50 (the issue's case: caught before only at the edge of the level). Its traces
(chitchat prompts drawn with prompt seed 4100, used by no calibration; seeds 900000 + i; 48 tokens) are
split into ``--sets`` disjoint sets of whole traces holding ``--set-tokens`` tokens each; every set is
judged by ``verinfer.verify`` with the shipped calibration for the claim (the pooled fp32 + bf16 one, as a
user gets it) and diagnosed by ``verinfer.diagnose`` (the sampler candidates, no model variants). Honest
sets (bf16, the claimed settings, the same prompts' next traces) are judged the same way: they show that
the verdict and diagnose leave honest traffic alone on these sets; they are far too few to measure a 1%
FPR (RESULTS 14: that needs about 380 disjoint honest sets).

Traces are cached under ``$VERINFER_CACHE/experiments/topk_edge`` (a rerun only judges again).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from verinfer import api  # noqa: E402
from verinfer.files import write_atomic  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.models.load import cache_root  # noqa: E402
from verinfer.prompts import load_prompts  # noqa: E402
from verinfer.stats.evaluation import wilson_interval  # noqa: E402
from verinfer.trace import read_traces  # noqa: E402

CLAIM = dict(temperature=1.0, top_k=50, top_p=0.95)
MAX_TOKENS = 48
PROMPT_SEED = 4100
SEED = 900_000


def traces_for(name: str, n: int, dtype: str, top_k: int, backend, offset: int = 0) -> list:
    """``n`` traces of one provider (cached), claiming ``CLAIM`` whatever it sampled with."""
    path = cache_root() / "experiments" / "topk_edge" / f"{name}-{n}x{MAX_TOKENS}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        model = backend if dtype == "float32" else None
        api.generate(load_prompts("chitchat", offset + n, seed=PROMPT_SEED)[offset:], n=n, dtype=dtype,
                     backend=model, seed=SEED + offset, max_tokens=MAX_TOKENS,
                     **{**CLAIM, "top_k": top_k}, out=path)
        print(f"{name}: {n} traces generated in {time.monotonic() - t0:.0f} s", flush=True)
    return [replace(t, sampling=replace(t.sampling, **CLAIM)) for t in read_traces(path)]


def split(traces: list, sets: int, tokens: int) -> list[list]:
    """Consecutive disjoint sets of whole traces, each holding at least ``tokens`` tokens."""
    out, current, held = [], [], 0
    for t in traces:
        current.append(t)
        held += len(t.output_token_ids)
        if held >= tokens:
            out.append(current)
            current, held = [], 0
            if len(out) == sets:
                break
    return out


def judge(name: str, groups: list[list], backend) -> list[dict]:
    rows = []
    for i, group in enumerate(groups):
        t0 = time.monotonic()
        d = api.diagnose(group, backend=backend)
        v = d.verdict
        best = d.best.candidate
        rows.append({"provider": name, "set": i, "traces": len(group), "tokens": sum(len(t.output_token_ids)
                                                                                    for t in group),
                     "flagged": not v.consistent, "p": v.p, "best": best.label, "changes": dict(best.changes),
                     "named_significant": d.claim_rejected, "exact": d.claim.exact, "text": d.text,
                     "seconds": round(time.monotonic() - t0, 1)})
        r = rows[-1]
        print(f"{name} set {i}: {r['tokens']} tokens, {'INCONSISTENT' if r['flagged'] else 'CONSISTENT'} p {r['p']:.3g}; "
              f"best {r['best']}{' (significant)' if r['named_significant'] else ''} ({r['seconds']} s)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", type=int, default=10)
    ap.add_argument("--set-tokens", type=int, default=2000)
    ap.add_argument("--honest-sets", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    started = dt.datetime.now(dt.timezone.utc)
    backend = api.load_model()
    per_set = -(-args.set_tokens // (MAX_TOKENS - 6))  # traces per set, allowing for outputs that stop early
    deviating = traces_for("top-k-40", int(args.sets * per_set * 1.15), "float32", 40, backend)
    honest = traces_for("honest-bf16", int(args.honest_sets * per_set * 1.15), "bfloat16", 50, backend,
                        offset=0)
    rows = judge("top-k 40 (claims 50)", split(deviating, args.sets, args.set_tokens), backend)
    rows += judge("honest bf16", split(honest, args.honest_sets, args.set_tokens), backend)
    if args.out is None:
        return
    lines = ["# A smaller top-k than claimed, on disjoint sets (issue #41 item 4)", "",
             f"Command: `python {shlex.join(['experiments/topk_edge.py', *sys.argv[1:]])}`  ",
             f"Date: {started:%Y-%m-%d %H:%M} UTC; machine: {describe(torch.get_num_threads())}  ",
             f"Data: chitchat prompts (prompt seed {PROMPT_SEED}), vLLM sampler, claim T 1 top-k 50 top-p 0.95, "
             f"{MAX_TOKENS} tokens, seeds {SEED} + i; disjoint sets of whole traces of at least {args.set_tokens} "
             "tokens; verdict: the shipped calibration for the claim; diagnose: the sampler candidates", "",
             "| provider | sets | flagged (Wilson 95%) | best candidate top-k 40 | top-k 40 significant by likelihood |",
             "|---|---|---|---|---|"]
    for name in dict.fromkeys(r["provider"] for r in rows):
        mine = [r for r in rows if r["provider"] == name]
        flagged = sum(r["flagged"] for r in mine)
        ci = wilson_interval(flagged, len(mine))
        named = sum(r["changes"] == {"top_k": 40} for r in mine)
        sig = sum(r["changes"] == {"top_k": 40} and r["named_significant"] for r in mine)
        lines.append(f"| {name} | {len(mine)} | {flagged}/{len(mine)} [{ci.low:.2f}, {ci.high:.2f}] | "
                     f"{named}/{len(mine)} | {sig}/{len(mine)} |")
    lines += ["", "| provider | set | tokens | verdict p | best candidate | diagnose says |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['provider']} | {r['set']} | {r['tokens']} | {r['p']:.3g} | {r['best']} | "
              f"{r['text'].replace('|', '/')[:300]} |" for r in rows]
    write_atomic(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
