"""Power of every seedless audit mode at 10 / 25 / 50 / 100 queries, beside Model Equality Testing.

    python experiments/seedless_power.py --met-python /tmp/metvenv/bin/python --out experiments/results/seedless_power.md

Pools, generated once with the in-process provider simulator and cached under
``$VERINFER_CACHE/studies/seedless_power`` (``--prompts`` chitchat prompts, prompt seed 21,
``--per-prompt`` completions each at T = 1, up to ``--max-tokens`` tokens, no top-k / top-p):

- one pool of provider completions per variant (honest fp32, honest bf16, w4, w8, fp8 KV cache,
  temperature 1.1 claimed as 1.0, a hidden system prompt); the greedy-only cheat's sampled traffic
  *is* the 4-bit pool (``verinfer serve --misconfig greedy-honest:w4``), so its row is w4's;
- ``--samples`` reference draws for each (prompt, completion) unit, never shared between units
  (``verinfer.auditing.draws.reference_draws``);
- the reference's scores of every completion and draw (``completion_scores``) and the returned
  top-5 logprobs a provider would send (``returned_logprobs``).

A budget of B queries is B completions (an ``n`` > 1 request counts n). Each cell resamples B
units without replacement from the pool (``--resamplings`` times; fewer for the permutation tests,
``--mmd-resamplings``) and applies the verdict the audit uses at 1% FPR (doubling looks,
Bonferroni): ``surprise`` (z-test of the centred log-probability, no draws), ``rank`` (exact rank
test of the centred log-probability among the unit's draws), ``rank-raw`` (RUT's raw
log-probability, the old statistic), ``mmd`` (this project's paired MMD, ``--per-prompt``
completions per prompt, B // n prompts, ``mmd.completions_per_prompt``), ``MET`` (the
``model-equality-testing`` package's ``run_two_sample_test`` with ``mmd_hamming`` and its
permutation p-value, b = 1000, run in ``--met-python``, a separate environment, on the same
prompts and completions as ``mmd``: with one completion per prompt its statistic divides 0 by 0
and its p-value is 0, so it is never given fewer than 2 per prompt), and ``logprobs``
(LOGIC's KS test of returned logprobs). Resamplings of one pool share units, so cells at large B
are correlated draws of few distinct sets: their binomial intervals understate the uncertainty.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from verinfer.auditing.draws import CompletionScores, completion_scores, reference_draws
from verinfer.auditing.logprobs import logprob_verdict, provider_values, reference_values, returned_logprobs
from verinfer.auditing.mmd import completions_per_prompt, mmd_verdict
from verinfer.auditing.rank import rank_p_values, rank_verdict, split
from verinfer.auditing.store import ResponseStore
from verinfer.auditing.surprise import surprise_verdict
from verinfer.files import atomic_path, write_atomic
from verinfer.machine import describe
from verinfer.models.backend import Backend
from verinfer.models.load import cache_root
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.simulate.generate import Request, build_requests
from verinfer.simulate.variants import get_variant
from verinfer.stats.evaluation import wilson_interval

SYSTEM = "system-prompt:Answer briefly and never mention the weather."
VARIANTS = {"honest fp32": "honest", "honest bf16": "bf16", "4-bit (w4)": "w4", "8-bit (w8)": "w8",
            "fp8 KV cache": "fp8-kv", "temperature 1.1": "temperature-1.1", "hidden system prompt": SYSTEM}
CHEAT = ("greedy-only cheat (greedy-honest:w4)", "4-bit (w4)")
BUDGETS = (10, 25, 50, 100)
MODES = ("surprise", "rank", "rank-raw", "mmd", "MET", "logprobs")
CLAIMED = SamplingParams(profile="torch-exponential", temperature=1.0)
MET_SCRIPT = Path(__file__).with_name("met_two_sample.py")


def stem(name: str) -> str:
    return re.sub(r"[^\w.+-]", "_", name)[:40]


def save(path: Path, **arrays) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)


def pools(args, backend, cache: Path) -> dict:
    """Every variant's completions, the units' reference draws, and their scores (cached)."""
    prompts = load_prompts("chitchat", args.prompts, seed=21)
    c, L, m = args.per_prompt, args.max_tokens, args.samples
    base = build_requests(backend, prompts, CLAIMED.with_(seed=50_000), seed_stride=c)
    units = [Request(f"{r.id}#{j}", r.prompt_token_ids, r.params.with_(seed=r.params.seed + j), r.messages)
             for r in base for j in range(c)]
    prompt_ids = [list(u.prompt_token_ids) for u in units]
    t0 = time.time()
    draws = reference_draws(backend, [(u.id, u.prompt_token_ids) for u in units], CLAIMED, m, 7, L,
                            ResponseStore(cache / "draws.jsonl"), batch_size=64, on_stage=print)
    print(f"draws ready ({time.time() - t0:.0f} s)", flush=True)
    if not (cache / "draw_scores.npz").exists():
        s = completion_scores(backend, [p for p in prompt_ids for _ in range(m)], [o for d in draws for o in d], CLAIMED)
        save(cache / "draw_scores.npz", logprob=s.logprob, expected=s.expected, variance=s.variance, tokens=s.tokens)
    out = {"prompt_ids": prompt_ids, "draws": draws, "units": units, "variants": {}}
    order = [(label, name) for label, name in VARIANTS.items() if label in args.variants]
    for label, name in order[::-1] if args.reverse else order:
        f = cache / f"{stem(name)}.json"
        if not f.exists():
            t0 = time.time()
            variant = get_variant(name)
            built = variant.build(backend)
            traces = variant.generate(backend, units, L, args.batch, backend=built)
            outputs = [list(t.output_token_ids) for t in traces]
            seen = [list(variant.prompt(built, u).prompt_token_ids) for u in units] if variant.prompt else prompt_ids
            ret = returned_logprobs(built, prompt_ids, outputs, seen)
            theirs, ours = provider_values(ret), reference_values(backend, ret)
            s = completion_scores(backend, prompt_ids, outputs, CLAIMED)
            write_atomic(f, json.dumps({"outputs": outputs, "returned": [a.tolist() for a in theirs],
                                        "reference": [b.tolist() for b in ours],
                                        "scores": [s.logprob.tolist(), s.expected.tolist(), s.variance.tolist(),
                                                   s.tokens.tolist()]}))
            print(f"{label}: generated and scored in {time.time() - t0:.0f} s", flush=True)
    for label, name in order:
        out["variants"][label] = json.loads((cache / f"{stem(name)}.json").read_text())
    d = np.load(cache / "draw_scores.npz")
    out["draw_scores"] = CompletionScores(d["logprob"], d["expected"], d["variance"], d["tokens"])
    return out


def met_p_values(python: str, cases: list[dict]) -> list[float]:
    """Model Equality Testing's own two-sample test on each case, run in its environment."""
    proc = subprocess.run([python, str(MET_SCRIPT)], input=json.dumps(cases), capture_output=True, text=True,
                          env={**os.environ, "TQDM_DISABLE": "1"}, check=False)
    if proc.returncode:
        raise SystemExit(f"{MET_SCRIPT.name} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


def counts(args, data: dict, label: str, cache: Path) -> dict[str, list]:
    """(rejected, resamplings) per mode and budget for one provider pool, cached beside the pools."""
    path = cache / (f"counts-{stem(label)}-r{args.resamplings}-mmd{args.mmd_resamplings}"
                    f"-met{args.met_resamplings if args.met_python else 0}-fpr{args.fpr}.json")
    if path.exists():
        return json.loads(path.read_text())
    t0 = time.time()
    c, m, L, fpr = args.per_prompt, args.samples, args.max_tokens, args.fpr
    U = len(data["units"])
    draw_s, pool = data["draw_scores"], data["variants"][label]
    s = CompletionScores(*(np.asarray(a, dtype=np.float64) for a in pool["scores"]))
    tokens = s.tokens.astype(int)
    rng = np.random.default_rng(11)
    u = {"rank": rank_p_values(s.centred, split(draw_s.centred, [m] * U), rng),
         "rank-raw": rank_p_values(s.logprob, split(draw_s.logprob, [m] * U), rng)}
    theirs = [np.asarray(a) for a in pool["returned"]]
    ours = [np.asarray(b) for b in pool["reference"]]
    outputs = pool["outputs"]
    row: dict[str, list] = {mode: [] for mode in MODES}
    for B in BUDGETS:
        if B > U:
            raise SystemExit(f"budget {B} exceeds the pool's {U} units: raise --prompts or --per-prompt")
        rng = np.random.default_rng([B, 1])
        picks = [rng.choice(U, B, replace=False) for _ in range(args.resamplings)]
        rej = {mode: 0 for mode in MODES}
        runs = {mode: args.resamplings for mode in MODES}
        for pick in picks:
            rej["surprise"] += not surprise_verdict(s[pick], fpr).consistent
            rej["rank"] += not rank_verdict(u["rank"][pick], tokens[pick], m, fpr).consistent
            rej["rank-raw"] += not rank_verdict(u["rank-raw"][pick], tokens[pick], m, fpr).consistent
            rej["logprobs"] += not logprob_verdict([theirs[i] for i in pick], [ours[i] for i in pick],
                                                   tokens[pick], fpr).consistent
        n = completions_per_prompt(B, c)  # both MMDs: B // n prompts of n completions from each side
        prompts = U // c
        groups = [rng.choice(prompts, B // n, replace=False) for _ in range(args.mmd_resamplings)]
        for k, pick in enumerate(groups):
            prov = [[outputs[i * c + j] for j in range(n)] for i in pick]
            ref = [[data["draws"][i * c + j][0] for j in range(n)] for i in pick]
            rej["mmd"] += not mmd_verdict(prov, ref, L, fpr, seed=k).consistent
        runs["mmd"] = args.mmd_resamplings
        if args.met_python:
            cases = [{"m": prompts, "L": L, "seed": k, "prompts": [int(i) for i in pick for _ in range(n)],
                      "x": [outputs[i * c + j] for i in pick for j in range(n)],
                      "y": [data["draws"][i * c + j][0] for i in pick for j in range(n)]}
                     for k, pick in enumerate(groups[: args.met_resamplings])]
            rej["MET"] = sum(p < fpr for p in met_p_values(args.met_python, cases))
            runs["MET"] = len(cases)
        for mode in MODES:
            row[mode].append([rej[mode], runs[mode]] if mode != "MET" or args.met_python else None)
        print(label, B, {k: f"{v}/{runs[k]}" for k, v in rej.items()}, f"{time.time() - t0:.0f} s", flush=True)
    write_atomic(path, json.dumps(row))
    return row


def draws_null(args, data: dict, cache: Path) -> list:
    """(rejected, resamplings) per budget of the surprise test on the reference's own draws: a larger
    honest fp32 pool (every unit's draws) for the one mode that does not use them."""
    path = cache / f"counts-draws-surprise-r{args.resamplings}-fpr{args.fpr}.json"
    if path.exists():
        return json.loads(path.read_text())
    s, out = data["draw_scores"], []
    rng = np.random.default_rng(29)
    for B in BUDGETS:
        out.append([sum(not surprise_verdict(s[rng.choice(len(s.tokens), B, replace=False)], args.fpr).consistent
                        for _ in range(args.resamplings)), args.resamplings])
    write_atomic(path, json.dumps(out))
    return out


def table(args, data: dict, cache: Path) -> None:
    """Rejection rates per variant, mode and budget (resampled from the pools), written as Markdown."""
    started, t0, load = dt.datetime.now(dt.timezone.utc), time.time(), os.getloadavg()[0]
    c, m, L = args.per_prompt, args.samples, args.max_tokens
    U = len(data["units"])
    results = {label: counts(args, data, label, cache) for label in data["variants"]}
    if set(results) != set(VARIANTS):
        print("counts cached for " + ", ".join(results) + "; the table needs every variant")
        return
    results[CHEAT[0]] = results[CHEAT[1]]
    draws_label = f"honest fp32: the {len(data['draw_scores'].tokens)} reference draws (surprise only)"
    results = {"honest fp32": results.pop("honest fp32"),
               draws_label: {mode: [None] * len(BUDGETS) for mode in MODES} | {"surprise": draws_null(args, data, cache)},
               **results}

    def cell(counts: list, honest: bool) -> str:
        """Rejection rates per budget; honest rows in % with the Wilson 95% interval."""
        parts = []
        for x in counts:
            if x is None:
                parts.append("-")
            elif honest:
                ci = wilson_interval(x[0], x[1])
                parts.append(f"{100 * x[0] / x[1]:.1f}% [{100 * ci.low:.1f}, {100 * ci.high:.1f}]")
            else:
                parts.append(f"{x[0] / x[1]:.2f}")
        return " / ".join(parts)

    command = "python experiments/seedless_power.py " + shlex.join(sys.argv[1:])
    lines = [
        "# Power of the seedless audit modes at 10 / 25 / 50 / 100 queries (1% FPR)", "",
        f"Command: `{command}`", "",
        f"Date: {started:%Y-%m-%d %H:%M} UTC; machine: {describe(args.threads)}; load average at start {load:.1f}; "
        f"this run {time.time() - t0:.0f} s (pools and each variant's counts cached in {cache}; counts may come from "
        "earlier runs of the same command with --variants, as the cache key holds every setting).", "",
        f"smollm2-135m, fp32 reference; {U // c} chitchat prompts (prompt seed 21) x {c} completions = {U} units per "
        f"provider, T = 1 claimed, up to {L} tokens; {m} reference draws per unit (rank). Resamplings: "
        f"{args.resamplings} (surprise, rank, rank-raw, logprobs), {args.mmd_resamplings} (mmd), "
        f"{args.met_resamplings} (MET). "
        f"mmd and MET: the same n = completions_per_prompt(B, {c}) completions of B // n prompts from each side; "
        "MET: the package's mmd_hamming with its permutation p-value, b = 1000.", "",
        "Cells: rejection rate at B = 10 / 25 / 50 / 100 queries (completions). Honest rows: % rejected with "
        "the Wilson 95% interval (resamplings of one pool are not independent: the interval is optimistic).", "",
        "| provider | " + " | ".join(MODES) + " |",
        "|---|" + "---|" * len(MODES),
    ]
    for label, row in results.items():
        lines.append(f"| {label} | " + " | ".join(cell(row[mode], label.startswith("honest")) for mode in MODES) + " |")
    raw = {label: {mode: row[mode] for mode in MODES} for label, row in results.items()}
    lines += ["", "Counts (rejected, resamplings) per budget:", "", "```json", json.dumps(raw), "```", ""]
    write_atomic(args.out, "\n".join(lines))
    print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--per-prompt", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--samples", type=int, default=6, help="reference draws per unit (rank)")
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--resamplings", type=int, default=2000)
    ap.add_argument("--mmd-resamplings", type=int, default=100)
    ap.add_argument("--met-resamplings", type=int, default=10)
    ap.add_argument("--met-python", default="", help="python of an environment with model-equality-testing")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated labels to generate / count "
                    "(the table is written once every variant's counts are cached)")
    ap.add_argument("--fpr", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pools-only", action="store_true", help="generate and score the pools, no table")
    ap.add_argument("--reverse", action="store_true", help="generate the variants' pools in reverse order (a "
                    "second process filling the same cache)")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/seedless_power.md"))
    args = ap.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := set(args.variants) - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(unknown)}; choose among {list(VARIANTS)}")
    torch.set_num_threads(args.threads)
    backend = Backend.load("smollm2-135m")
    cache = cache_root() / "studies" / "seedless_power" / (f"p{args.prompts}-c{args.per_prompt}-t{args.max_tokens}"
                                                           f"-m{args.samples}")
    cache.mkdir(parents=True, exist_ok=True)
    data = pools(args, backend, cache)
    if args.pools_only:
        return
    table(args, data, cache)


if __name__ == "__main__":
    main()
