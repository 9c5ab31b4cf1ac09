"""Sampler deviations against the pooled fp32 + bf16 honest calibration: margin-only vs margin + sides.

    python experiments/sampler_deviation.py --cal-prompts 200 --cal-max-tokens 80 --test-prompts 128 \
        --max-tokens 40 --batch-sizes 20,100 --min-p --fpr-prompts 144 \
        --out experiments/results/sampler_deviation.md

Generates traces on chitchat prompts with vLLM's seeded sampler claiming T=1, top-k 50, top-p 0.95,
from honest providers (fp32; bf16 as GPU providers run; every other honest variant of the catalogue:
batch-1 / 4 / 8 / 16, prefill-vs-decode, eager and SDPA attention) and from providers whose sampler
deviates (top-k 40 / 25 / 60, top-p 0.76, temperature 1.1 / 0.9) while claiming the honest settings;
with ``--min-p`` also a claim of min-p 0.05 alone (its own honest fp32 + bf16 calibration; served
min-p 0.04 / 0.06). The fp32 reference scores them; a calibration is fitted on honest fp32 + bf16
traces of calibration prompts (disjoint from the held-out prompts), with the margin detector only
(``shape=False``, the verdict before issue #28), with the two side counts of session 12
(``narrower``, ``wider``) and with all three sampler-shape detectors (``narrower``, ``wider``,
``beyond``: ``verinfer.stats.sides``), and each variant's held-out traces are judged by the one
verdict rule, whole and in random (overlapping) sets of whole traces holding 500 and 2,000 tokens.
``--fpr-prompts`` adds honest bf16 traces of that many further prompts (chitchat prompts whose text
is in neither half of the pool), so that the honest bf16 held-out traces split into *disjoint* sets:
their rejection count is the false-positive rate measured without overlap (Wilson 95% interval).

Traces and scores are cached under ``$VERINFER_CACHE/experiments/sampler_deviation`` (fixed seeds;
held-out prompts in chunks of 48, so more prompts reuse the earlier ones; a rerun only re-analyses).
The calibration pool of 200 prompts x 80 tokens is the one ``experiments/default_calibrations.py``
builds (same cache and seeds).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import os
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from verinfer.files import atomic_path, write_atomic
from verinfer.machine import describe
from verinfer.models.backend import Backend
from verinfer.models.load import cache_root
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.scoring.scores import read_scores
from verinfer.scoring.traces import score_traces
from verinfer.simulate.generate import build_requests
from verinfer.simulate.variants import get_variant
from verinfer.stats.calibration import min_batches
from verinfer.stats.evaluation import wilson_interval
from verinfer.stats.sides import side_counts
from verinfer.stats.summary import fit_calibrator
from verinfer.stats.verdict import calibrated_verdict
from verinfer.trace import read_traces, write_traces

CLAIM = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=7000)
MIN_P_CLAIM = SamplingParams(profile="vllm", temperature=1.0, min_p=0.05, seed=7000)  # min-p alone decides the kept set
ORDER = ("honest", "bf16", "top-k-40", "top-k-60", "temperature-1.1", "top-p-0.76", "temperature-0.9", "top-k-25")
HONEST_EXTRA = ("batch-8", "attn-eager", "batch-1", "prefill-vs-decode", "batch-4", "batch-16",
                "attn-sdpa")  # the catalogue's other honest variants (last; first chunk only)
MIN_P_ORDER = ("honest", "bf16", "min-p-0.04", "min-p-0.06")  # claiming MIN_P_CLAIM
POOL, TEST_OFFSET = 400, 200  # prompts drawn once; calibration takes the first ones, held-out ones start at 200
FPR_SEED = 2801  # the seeded draw of the further honest prompts (--fpr-prompts)
CHUNK = 48  # held-out prompts are generated (and cached) in chunks of this many


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


def held_out(backend: Backend, variant: str, prompts, max_tokens: int, cache: Path, claim: SamplingParams = CLAIM,
             tag: str = ""):
    """Held-out traces of ``variant`` on ``prompts`` (those from ``TEST_OFFSET`` on), generated in cached chunks
    of ``CHUNK`` prompts (request seeds continue across chunks, so any number of prompts reuses earlier chunks)."""
    out = []
    for start in range(0, len(prompts), CHUNK):
        part = prompts[start:start + CHUNK]
        split = f"{tag}test{len(part)}" + (f"@{TEST_OFFSET + start}" if start else "")
        out += traces_for(backend, variant, part, split, max_tokens, cache, claim.with_(seed=claim.seed + start))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cal-prompts", type=int, default=24, help="calibration prompts per honest precision")
    ap.add_argument("--test-prompts", type=int, default=12, help="held-out prompts per variant")
    ap.add_argument("--max-tokens", type=int, default=40, help="tokens per held-out completion")
    ap.add_argument("--cal-max-tokens", type=int, default=40, help="tokens per calibration completion")
    ap.add_argument("--min-p", action="store_true", help=f"also claim {MIN_P_CLAIM.signature()} (its own calibration)")
    ap.add_argument("--min-p-cal-prompts", type=int, default=32, help="calibration prompts per precision for min-p")
    ap.add_argument("--batch-sizes", default="10,20", help="calibrated batch sizes (the verdict uses the largest)")
    ap.add_argument("--generate-only", action="store_true", help="fill the trace cache and stop")
    ap.add_argument("--set-tokens", type=lambda v: [int(x) for x in v.split(",")], default=[500, 2000],
                    help="random sets of whole held-out traces holding at least these many tokens")
    ap.add_argument("--draws", type=int, default=200, help="random sets per variant")
    ap.add_argument("--resample", type=int, default=None, help="bootstrap this many windows per batch size "
                    "(thresholds without the disjoint-batch FPR guarantee) for batches the honest tokens cannot fill")
    ap.add_argument("--fpr-prompts", type=int, default=0, help="honest bf16 traces of this many further prompts "
                    "(not in the pool) for the false-positive rate on disjoint sets")
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
    cal = {v: traces_for(backend, v, cal_prompts, f"cal{args.cal_prompts}", args.cal_max_tokens, cache)
           for v in ("honest", "bf16")}
    test = {v: held_out(backend, v, test_prompts, args.max_tokens, cache) for v in ORDER}
    if args.min_p:
        tag = f"minp{MIN_P_CLAIM.min_p:g}-"
        min_p_cal = {v: traces_for(backend, v, prompts[:args.min_p_cal_prompts], f"{tag}cal{args.min_p_cal_prompts}",
                                   args.max_tokens, cache, MIN_P_CLAIM) for v in ("honest", "bf16")}
        min_p_test = {v: held_out(backend, v, test_prompts, args.max_tokens, cache, MIN_P_CLAIM, tag)
                      for v in MIN_P_ORDER}
    test.update({v: held_out(backend, v, test_prompts[:CHUNK], args.max_tokens, cache) for v in HONEST_EXTRA})
    extra = held_out(backend, "bf16", fpr_prompts(prompts, args.fpr_prompts), args.max_tokens, cache,
                     tag=f"fpr{FPR_SEED}-") if args.fpr_prompts else []
    if args.generate_only:
        return 0
    batch_sizes = tuple(int(s) for s in args.batch_sizes.split(","))
    sections = [section(backend, CLAIM, cal, test, "", batch_sizes, args, cache, args.cal_max_tokens, extra)]
    if args.min_p:
        sections.append(section(backend, MIN_P_CLAIM, min_p_cal, min_p_test, tag, batch_sizes, args, cache,
                                args.max_tokens))
    command = " ".join(shlex.quote(a) for a in ["python", "experiments/sampler_deviation.py", *sys.argv[1:]])
    text = "\n".join([
        f"# Sampler deviations: margin-only vs margin + sides verdict ({dt.date.today()})", "",
        f"Command: `{command}`  ",
        f"Machine: {describe(torch.get_num_threads())}; load average {os.getloadavg()[0]:.1f} at the report  ",
        f"Held-out: {args.test_prompts} prompts per variant (from prompt {TEST_OFFSET} on; the first {CHUNK} for "
        f"{', '.join(HONEST_EXTRA)}), up to {args.max_tokens} tokens each. Each cell: the verdict on all held-out tokens of the variant (p-value, tokens at the first rejecting "
        f"look, the detector with the smallest p), then the share of {args.draws} random sets of held-out traces "
        f"holding at least {' / '.join(map(str, args.set_tokens))} tokens called INCONSISTENT (sets overlap; n/a: the "
        f"held-out set has fewer than 1.25 times the set's tokens). "
        f"Sides: the mismatches with depth_shift > 0 / < 0 (claim shallower / deeper than the verifier's token).",
        "", *sections])
    print(text)
    if args.out:
        write_atomic(args.out, text)
    return 0


def fpr_prompts(pool, n: int):
    """``n`` chitchat prompts whose text is in neither half of ``pool`` (a seeded draw of its own)."""
    seen = {p.messages for p in pool}
    fresh = [p for p in load_prompts("chitchat", 4 * n + len(pool), seed=FPR_SEED, distinct=True) if p.messages not in seen]
    if len(fresh) < n:
        raise SystemExit(f"--fpr-prompts {n}: only {len(fresh)} chitchat prompts outside the pool were drawn")
    return fresh[:n]


def disjoint(cols: dict[str, np.ndarray], tokens: int):
    """Score columns of runs of whole traces (in order of first appearance), each holding at least
    ``tokens`` tokens: no trace in two sets; the remainder that fills no set is left out."""
    ids = np.asarray(cols["trace_id"])
    names, first = np.unique(ids, return_index=True)
    take: list[np.ndarray] = []
    for t in names[np.argsort(first)]:
        take.append(np.flatnonzero(ids == t))
        if sum(map(len, take)) >= tokens:
            pick = np.concatenate(take)
            yield {k: np.asarray(v)[pick] for k, v in cols.items()}
            take = []


def subsets(cols: dict[str, np.ndarray], tokens: int, draws: int, rng: np.random.Generator):
    """Score columns of ``draws`` random sets of whole traces holding at least ``tokens`` tokens (sets overlap)."""
    ids = np.asarray(cols["trace_id"])
    names = np.unique(ids)
    rows = {t: np.flatnonzero(ids == t) for t in names}
    for _ in range(draws):
        order = rng.permutation(names)
        total = np.cumsum([rows[t].size for t in order])
        take = order[: int(np.searchsorted(total, tokens)) + 1]
        pick = np.concatenate([rows[t] for t in take])
        yield {k: np.asarray(v)[pick] for k, v in cols.items()}


def scored(backend: Backend, traces, stem: Path, reuse: Path | None = None) -> dict[str, np.ndarray]:
    """Score columns of ``traces``, scored once (the file name holds their token count); ``reuse``: a score
    file of the same traces written by another script (``default_calibrations.py``), used when complete."""
    n = sum(len(t.output_token_ids) for t in traces)
    if reuse is not None and reuse.exists():
        cols = read_scores(reuse)
        if "depth_shift" in cols and len(cols["margin"]) == n:
            return cols
    path = stem.with_name(f"{stem.name}-n{n}.scores.parquet")
    if not path.exists():
        with atomic_path(path) as tmp:
            score_traces(backend, traces, tmp)
    return read_scores(path)


def section(backend, claim: SamplingParams, cal, test, tag: str, batch_sizes, args, cache: Path,
            cal_max_tokens: int, extra=()) -> str:
    """One claim's table: its pooled fp32 + bf16 calibration, then every held-out variant judged with each
    calibration; with ``extra`` honest bf16 traces, the false-positive rate on disjoint honest bf16 sets."""
    honest = {v: scored(backend, t, cache / f"{tag}cal{len(t)}-{v}", cache / f"{tag}cal{len(t)}-m{cal_max_tokens}-{v}.scores.parquet")
              for v, t in cal.items()}
    pooled = {k: np.concatenate([c[k] for c in honest.values()]) for k in honest["honest"]}
    groups = {"float32" if v == "honest" else "bfloat16": c for v, c in honest.items()}
    if args.resample is None:  # the sizes the honest tokens fill with enough disjoint batches
        batch_sizes = tuple(n for n in batch_sizes if n * min_batches(0.01) <= pooled["margin"].size)
    shape = fit_calibrator(pooled, batch_sizes, resample=args.resample, groups=groups)
    two_sides = copy.deepcopy(shape)  # session 12's null: the two side counts without ``beyond``
    two_sides.sides = [{k: v for k, v in g.items() if k != "beyond"} for g in shape.sides]
    calibrations = {"margin only": fit_calibrator(pooled, batch_sizes, shape=False, resample=args.resample),
                    "margin + sides": two_sides, "margin + sides + beyond": shape}
    null = ", ".join(f"{g['group']} {g['positive']}+ / {g['negative']}- ({g['beyond']} beyond) of {g['tokens']} tokens"
                     for g in shape.sides)
    rows, held = [], {}
    for variant, traces in test.items():
        cols = scored(backend, traces, cache / f"{tag}test{args.test_prompts}-{variant}",
                      cache / f"{tag}test{len(traces)}-m{args.max_tokens}-{variant}.scores.parquet")
        held[variant] = cols
        cells = []
        for cal_ in calibrations.values():
            v = calibrated_verdict(cols, cal_)
            shares = []
            for tokens in args.set_tokens:
                if tokens > 0.8 * len(cols["margin"]):
                    shares.append("n/a")  # the sets would be (nearly) the whole held-out set
                    continue
                rng = np.random.default_rng(0)
                shares.append(f"{np.mean([not calibrated_verdict(c, cal_).consistent for c in subsets(cols, tokens, args.draws, rng)]):.1%}")
            cells.append(f"{v.label} (p = {v.p_value:.2g}{f', after {v.tokens_needed} tokens' if v.tokens_needed else ''}"
                         f"{f', by {v.decided_by}' if not v.consistent and len(v.detectors) > 1 else ''}); "
                         + " / ".join(shares))
        exact = float(np.mean(cols["exact_match"]))
        counts = side_counts(cols["depth_shift"], cols["margin"])
        kind = "honest" if get_variant(variant).honest else "deviation"
        rows.append(f"| {variant} ({kind}) | {len(cols['margin'])} | {exact:.2%} | {counts['positive']} / "
                    f"{counts['negative']} ({counts['beyond']}) | {' | '.join(cells)} |")
    lines = [
        f"## Claim: {claim.signature()}", "",
        f"Calibration: honest fp32 + bf16 traces of {len(cal['honest'])} prompts each, up to {cal_max_tokens} tokens "
        f"({sum(len(c['margin']) for c in honest.values())} tokens; sides {null}), "
        f"{'disjoint batches' if args.resample is None else f'{args.resample} bootstrap windows'} of {batch_sizes} "
        f"tokens (the verdict uses the largest that fits), 1% FPR.", "",
        f"| variant | tokens | exact match | sides + / - (beyond) | {' | '.join(calibrations)} |",
        f"|---|---|---|---|{'---|' * len(calibrations)}", *rows, ""]
    if len(extra):
        lines += disjoint_fpr(backend, extra, held, calibrations, args, cache)
    return "\n".join(lines)


def disjoint_fpr(backend, extra, held: dict[str, dict], calibrations: dict, args, cache: Path) -> list[str]:
    """Rejections of disjoint honest sets: bf16 (the held-out traces and ``extra``), and every fp32 honest
    variant's held-out traces pooled, split into runs of whole traces of ``args.set_tokens`` tokens."""
    more = scored(backend, extra, cache / f"fpr{FPR_SEED}-{args.fpr_prompts}-bf16")
    pools = {"honest bf16": {k: np.concatenate([held["bf16"][k], more[k]]) for k in more},
             "honest fp32 variants": {k: np.concatenate([c[k] for v, c in held.items() if get_variant(v).honest
                                                         and v != "bf16"]) for k in more}}
    rows = []
    for name, cols in pools.items():
        for tokens in args.set_tokens:
            sets = list(disjoint(cols, tokens))
            cells = []
            for cal_ in calibrations.values():
                k = sum(not calibrated_verdict(c, cal_).consistent for c in sets)
                ci = wilson_interval(k, len(sets))
                cells.append(f"{k} of {len(sets)} (95% CI {ci.low:.1%}-{ci.high:.1%})")
            rows.append(f"| {name} | {len(cols['margin'])} | {tokens} | {' | '.join(cells)} |")
    head = (f"False positives on disjoint honest sets: the honest bf16 held-out traces above plus {len(extra)} "
            f"traces of {args.fpr_prompts} further prompts (seed {FPR_SEED}, texts in neither half of the pool); "
            "the fp32 honest variants' held-out traces pooled. Each set: consecutive whole traces holding at least "
            "the tokens named, no trace in two sets; INCONSISTENT sets of all sets, Wilson 95% interval.")
    return [head, "",
            f"| honest pool | tokens | set tokens | {' | '.join(calibrations)} |",
            f"|---|---|---|{'---|' * len(calibrations)}", *rows, ""]


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
