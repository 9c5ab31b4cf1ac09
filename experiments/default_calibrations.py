"""Build the calibrations shipped in ``src/verinfer/stats/data`` (``verinfer.stats.shipped``).

    python experiments/default_calibrations.py

For every sampler profile that replays seeded sampling (``PROFILES``) it generates honest traces
of the bundled model (or ``--model``) with ``verinfer generate``'s default sampling (T=1, top-k 50, top-p 0.95)
from an fp32 and a bf16 provider on calibration prompts (the first ones of
``experiments/sampler_deviation.py``'s pool, disjoint from its held-out prompts; its trace cache
and ``traces_for``, which decodes 12 prompts per batch, here in cached chunks of ``--chunk``
prompts taken in turn across profiles), verifies them with the fp32 reference (scores cached
beside the traces) and writes the pooled fp32 + bf16 calibration at 1% FPR, each
precision one group of the sampler-shape null, recording both precisions, the profile and the
tokens as its coverage. Batch sizes are those of ``BATCH_SIZES`` that the honest tokens fill
with the disjoint-batch guarantee (``min_batches``). ``--generate-only`` fills the cache.

``--held-out N`` then judges, per profile, traces that fit nothing: honest fp32 and bf16 traces of N
held-out prompts (``sampler_deviation.py``'s, from ``TEST_OFFSET``, in its cached chunks; vllm's are
that experiment's own) under the shipped default that ``verify`` picks, and the fp32 traces
claiming the next request's seed (a wrong seed), as ``verify`` would (scores cached too).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from sampler_deviation import CLAIM, POOL, TEST_OFFSET, held_out, traces_for  # noqa: E402

from verinfer.files import write_atomic  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.models.backend import Backend  # noqa: E402
from verinfer.models.load import cache_root  # noqa: E402
from verinfer.prompts import load_prompts  # noqa: E402
from verinfer.scoring.scores import read_scores, verified_signature  # noqa: E402
from verinfer.scoring.traces import COMPACT, score_traces  # noqa: E402
from verinfer.stats.calibration import Calibrator, min_batches  # noqa: E402
from verinfer.stats.shipped import DATA_DIR, calibration_filename, find_calibration  # noqa: E402
from verinfer.stats.summary import fit_calibrator, summarize  # noqa: E402
from verinfer.trace import Trace  # noqa: E402

# The profiles ``verinfer generate`` samples with seeds (greedy has no sampling null of its own;
# transformers traces record each request's batch row and width, ``sampling.stream``, as generate batched them).
PROFILES = ("vllm", "vllm-v1", "vllm-v1-cuda", "vllm-cpu", "sglang", "llama.cpp", "transformers")
PRECISIONS = {"honest": "float32", "bf16": "bfloat16"}  # simulator variant -> the provider's precision
# The verdict judges with the largest that fits the tokens, and one flagged batch never rejects (verdict.py):
# larger sizes would leave a few hundred tokens a single batch.
BATCH_SIZES = (10, 20, 50, 100)
FPR = 0.01


def spec(text: str, profile: str) -> int:
    """``PROFILE=N,...,*=N`` -> N for ``profile``."""
    try:
        counts = {k: int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise SystemExit(f"{text!r}: expected PROFILE=N,...,*=N") from None
    return counts.get(profile, counts.get("*", 0))


def chunk_split(profile: str, start: int, size: int) -> str:
    """The cache split of ``size`` calibration prompts from ``start`` (``traces_for``'s file layout;
    the vllm split of 200 from 0 is ``cal200``, as ``sampler_deviation.py --cal-prompts 200`` reads it)."""
    return f"cal{size}" + (f"@{start}" if start else "") + ("" if profile == "vllm" else f"-{profile}")


def honest_chunk(backend: Backend, profile: str, start: int, size: int, max_tokens: int, cache: Path) -> tuple[dict, dict]:
    """Per precision, the score columns of the honest traces of ``profile`` on prompts ``start`` to
    ``start + size`` (generated and scored once, cached; request seeds continue across chunks), and
    the traces' signature (model, verifier dtype, sampling settings)."""
    chosen = load_prompts("chitchat", POOL, seed=28)[start:start + size]
    split = chunk_split(profile, start, size)
    claim = CLAIM.with_(profile=profile, seed=CLAIM.seed + start)
    cols, sig = {}, None
    for variant, precision in PRECISIONS.items():
        began = time.perf_counter()
        traces = traces_for(backend, variant, chosen, split, max_tokens, cache, claim)
        made = time.perf_counter() - began
        cols[precision] = scored(backend, traces, cache / f"{split}-m{max_tokens}-{variant}.scores.parquet")
        sig = verified_signature(traces, backend)
        if made > 5:
            tokens = sum(len(t.output_token_ids) for t in traces)
            print(f"{split} {precision}: {len(traces)} traces, {tokens} tokens in {made:.0f} s "
                  f"({tokens / made:.1f} tokens/s wall)", flush=True)
    return cols, sig


def scored(backend: Backend, traces: list[Trace], path: Path) -> dict[str, np.ndarray]:
    """The verdict's score columns of ``traces``, cached at ``path`` (rescored when a column is missing)."""
    scores = read_scores(path) if path.exists() else {}
    if any(k not in scores for k in COMPACT):  # absent, or written before a column was added
        scores = score_traces(backend, traces, path).columns
    return {k: np.asarray(scores[k]) for k in COMPACT}


def judge_held_out(backend: Backend, profile: str, n: int, max_tokens: int, cache: Path) -> list[str]:
    """Table rows: honest fp32 and bf16 traces of ``n`` held-out prompts, and the fp32 ones claiming the
    next request's seed, each judged under the shipped default calibration ``verify`` picks for them."""
    prompts = load_prompts("chitchat", POOL, seed=28)[TEST_OFFSET:TEST_OFFSET + n]
    tag = "" if profile == "vllm" else f"{profile}-"  # vllm: sampler_deviation.py's own held-out traces
    rows = []
    for variant, precision in PRECISIONS.items():
        traces = held_out(backend, variant, prompts, max_tokens, cache, CLAIM.with_(profile=profile), tag)
        sets = {f"honest {precision}": (traces, variant)}
        if variant == "honest":
            sets["fp32 claiming seed + 1"] = ([replace(t, sampling=t.sampling.with_(seed=t.sampling.seed + 1))
                                               for t in traces], f"{variant}-seed+1")
        for label, (ts, name) in sets.items():
            cols = scored(backend, ts, cache / f"{tag}held{n}-m{max_tokens}-{name}.scores.parquet")
            path = find_calibration(verified_signature(ts, backend))
            if path is None:
                raise SystemExit(f"{profile}: no shipped calibration fits its held-out traces; build it first")
            summary = summarize(cols, Calibrator.load(path))
            v = summary.verdict
            flagged = ", ".join(f"{d} {e['flagged']}" if "flagged" in e else f"{d} {e['on_side']}/{e['mismatches']}"
                                for d, e in v.detectors.items())
            rows.append(f"| {profile} | {label} | {summary.traces} | {summary.tokens:,} | {summary.exact_match_rate:.1%} "
                        f"| **{v.label}** | {v.p_value:.3g} | {v.units} x {v.batch_size} | {flagged} | {v.decided_by} |")
            print(rows[-1], flush=True)
    return rows


def build(profile: str, pools: dict[str, dict], sig: dict, command: str) -> tuple[Path, str]:
    """Fit and write the pooled fp32 + bf16 calibration of one profile; returns its path and a table row."""
    pooled = {k: np.concatenate([c[k] for c in pools.values()]) for k in COMPACT}
    n = pooled["margin"].size
    sizes = tuple(s for s in BATCH_SIZES if s * min_batches(FPR) <= n)
    if not sizes:
        raise SystemExit(f"{profile}: {n} honest tokens fill no batch size of {BATCH_SIZES} "
                         f"with {min_batches(FPR)} disjoint batches; raise --prompts")
    coverage = {"precisions": sorted(pools), "profiles": [profile],
                "tokens": {p: int(c["margin"].size) for p, c in pools.items()},
                "traces": {p: int(np.unique(c["trace_id"]).size) for p, c in pools.items()},
                "built_by": command}
    calibrator = fit_calibrator(pooled, sizes, FPR, signature=sig, coverage=coverage,
                                groups=pools)
    path = DATA_DIR / calibration_filename(sig["model"], sig["sampling"][0])
    write_atomic(path, json.dumps(calibrator.to_dict(), indent=1))
    exact = ", ".join(f"{p} {np.mean(c['exact_match']):.2%}" for p, c in pools.items())
    row = (f"| {profile} | {coverage['tokens']['float32']:,} ({coverage['traces']['float32']}) | "
           f"{coverage['tokens']['bfloat16']:,} ({coverage['traces']['bfloat16']}) | {exact} | "
           f"{', '.join(map(str, sizes))} | `{path.name}` ({path.stat().st_size:,} bytes) |")
    print(row, flush=True)
    return path, row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="the reference model (a bundled alias or a directory); "
                    "a model other than the default caches its traces in a directory of its own")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--prompts", default="vllm=200,*=100",
                    help=f"calibration prompts per precision, per profile (PROFILE=N, * for the rest; <= {TEST_OFFSET})")
    ap.add_argument("--chunk", default="vllm=200,*=25", help="prompts generated (and cached) together, per profile")
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--generate-only", action="store_true", help="fill the trace and score cache and stop")
    ap.add_argument("--held-out", type=int, default=0, help="then judge honest fp32 / bf16 and wrong-seed traces "
                    f"of this many held-out prompts per profile under the shipped defaults (<= {POOL - TEST_OFFSET})")
    ap.add_argument("--held-out-max-tokens", type=int, default=40, help="tokens per held-out completion")
    ap.add_argument("--out", type=Path, default=None, help="also write the coverage table here (markdown)")
    args = ap.parse_args(argv)
    profiles = args.profiles.split(",")
    plan = {p: (spec(args.prompts, p), spec(args.chunk, p)) for p in profiles}
    for p, (n, chunk) in plan.items():
        if not 0 < n <= TEST_OFFSET or chunk < 1:
            raise SystemExit(f"--prompts / --chunk: {p} needs 1..{TEST_OFFSET} prompts in chunks of >= 1, "
                             f"got {n} and {chunk}")
    cache = cache_root() / "experiments" / "sampler_deviation"
    if args.model != "smollm2-135m":  # the default model's traces are sampler_deviation.py's own
        cache = cache / args.model.replace("/", "_")
    cache.mkdir(parents=True, exist_ok=True)
    backend = Backend.load(args.model, "float32")
    command = " ".join(shlex.quote(a) for a in ["python", "experiments/default_calibrations.py", *(argv or sys.argv[1:])])
    parts: dict[str, list] = {p: [] for p in profiles}
    for start in range(0, max(n for n, _ in plan.values()), min(c for _, c in plan.values())):
        for p, (n, chunk) in plan.items():  # chunk by chunk across profiles, so all advance together
            if start < n and start % chunk == 0:
                parts[p].append(honest_chunk(backend, p, start, min(chunk, n - start), args.max_tokens, cache))
    if args.generate_only:
        return 0
    rows = []
    for p in profiles:
        pools = {precision: {k: np.concatenate([cols[precision][k] for cols, _ in parts[p]]) for k in COMPACT}
                 for precision in PRECISIONS.values()}
        rows.append(build(p, pools, parts[p][0][1], command)[1])
    held = [row for p in profiles for row in judge_held_out(backend, p, args.held_out, args.held_out_max_tokens, cache)
            ] if args.held_out else []
    if args.out:
        write_atomic(args.out, "\n".join([
            f"# Shipped default calibrations ({dt.date.today()})", "",
            f"Command: `{command}`  ", f"Machine: {describe(torch.get_num_threads())}; load average {os.getloadavg()[0]:.1f} at the report  ",
            f"Claim: {args.model}, T={CLAIM.temperature:g}, top-k {CLAIM.top_k}, top-p {CLAIM.top_p:g}, min-p "
            f"{CLAIM.min_p:g} (generate's default sampling) under each profile; "
            f"honest providers fp32 and bf16 (the simulator's `honest` and `bf16` variants), up to {args.max_tokens} "
            "tokens per chitchat prompt, verified by the fp32 reference; pooled calibration at 1% FPR on disjoint "
            "batches. Tokens (traces) per precision; exact match = share of tokens the verifier reproduces.", "",
            "| profile | fp32 tokens (traces) | bf16 tokens (traces) | exact match | batch sizes | file |",
            "|---|---|---|---|---|---|", *rows, "", *([
                "## Held out: honest and wrong-seed traces under the shipped defaults", "",
                f"Traces of {args.held_out} held-out chitchat prompts (prompts {TEST_OFFSET} on of the pool; none fitted a "
                f"shipped file), up to {args.held_out_max_tokens} tokens each, generated like the calibration "
                "traces (other request seeds), judged under the shipped default of their profile that `verify` "
                "picks, by the one verdict rule at 1% FPR; the wrong seed: the honest fp32 traces, each "
                "claiming the next request's seed. Detectors: flagged batches (margin) or mismatches on that "
                "side (narrower, wider, beyond: claims the claimed filters remove).", "",
                "| profile | traces | n | tokens | exact match | verdict | p | batches | detectors | decided by |",
                "|---|---|---|---|---|---|---|---|---|---|", *held, ""] if held else [])]))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
