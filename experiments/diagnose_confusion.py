"""Confusion table of `verinfer diagnose`: the configuration a provider really ran vs the one diagnosed.

    python experiments/diagnose_confusion.py --out experiments/results/diagnose_confusion.md

Every provider below claims vLLM's sampler at T=1, top-k 50, top-p 0.95 (seed 7000 + i) on the
bundled SmolLM2-135M in fp32, and runs something else: each misconfiguration of the catalogue
(``simulate.variants``) that changes the sampler or the model (temperature-1.1, top-p-0.85, wrong-seed,
bug-top2, bug-top32, w8-channel, the four w4 variants, the four fp8-kv variants), the honest bf16
provider, the honest fp32 one, and configurations built here that are not in the catalogue (top-k 20,
min-p 0.05, temperature 0.8, repetition penalty 1.2 and presence penalty 0.5 (a token hook that
re-samples penalized logits, vLLM's penalty rule), seeds shifted by one, one seed for every request,
vLLM's V1 sampler profile) plus one outside the candidate grid (seeds shifted by 17), whose
expected diagnosis is "no candidate explains it". Each set is diagnosed with every model band of the
catalogue but the attention kernels (``--variants``; default ``catalogue``, one extra prefill each);
``--cases sampler`` leaves the bands out for the providers whose truth is not a model band, and
``--cases model`` runs only the model-side providers (with the bands), so the two halves can run
apart on a slow machine.

The honest bf16 provider is expected to keep the claim: its prefill reproduces bf16 decode no
better than the fp32 reference does (RESULTS 20), so replay cannot tell the bf16 band from honest
fp32 noise at these sizes, and diagnose promises only that it is consistent with the claim.

``--cache DIR`` keeps each provider's traces (``DIR/<case>-<prompts>x<tokens>.jsonl``) and reuses
them, so a rerun with another diagnosis does not decode again.

``--honest-bound DIR`` measures instead what the sampler-bug test assumes (``diagnosis.HONEST_OFF_BOUNDARY``):
how often honest bf16 providers emit tokens only a bug explains (``diagnosis.off_boundary``), on the
honest traces cached by ``experiments/default_calibrations.py`` and ``experiments/sampler_deviation.py``
in DIR (``~/.cache/verinfer/experiments/sampler_deviation``): the shipped calibrations' bf16 traces
(every profile but SGLang, whose inverse-CDF replay leaves 15% of honest bf16 tokens unexplained, so
that diagnose already answers "no candidate explains it" there) give the 99% Clopper-Pearson bound; the
held-out bf16 traces (vLLM, top-k 50 / top-p 0.95 and min-p 0.05 claims) are then diagnosed with the
claim and the bug candidates, and must name no bug.

Not covered (the diagnosis has no candidate for them): speculative decoding (spec-*, no-spec),
hidden system prompts and smaller models (layers-N).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from verinfer.files import write_atomic
from verinfer.machine import describe
from verinfer.models.backend import Backend
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.scoring.diagnosis import ALPHA, HONEST_OFF_BOUNDARY, candidate_grid, penalized
from verinfer.scoring.diagnosis_run import diagnose, diagnose_traces, resolve_bands
from verinfer.simulate.generate import build_requests, sample_rows
from verinfer.simulate.variants import Variant, get_variant
from verinfer.trace import read_traces, write_traces

CLAIM = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=7000)
NONE = "no candidate explains it"


class PenaltyHook:
    """Re-samples each step from penalized logits (``diagnosis.penalized``: vLLM's rule) with the
    request's own sampler, so a provider with a penalty left on is simulated exactly."""

    def __init__(self, kind: str, value: float):
        self.kind, self.value = kind, value
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.profiles: dict = {}

    def __call__(self, logits, tokens, requests, step):
        rows = penalized(logits.float(), [(r.prompt_token_ids, self.outputs[r.id]) for r in requests],
                         self.kind, self.value)
        out = sample_rows(rows, list(range(len(requests))), requests, self.profiles, step)
        for r, t in zip(requests, out.tolist()):
            self.outputs[r.id].append(t)
        return out


def built(name: str, **kw) -> Variant:
    return Variant(name, "built for the diagnose experiment", **kw)


# (provider, how it is made, the diagnosis expected)
CASES: list[tuple[str, Variant, str]] = [
    ("honest fp32", get_variant("honest"), "claim"),
    ("bf16 (honest)", get_variant("bf16"), "claim"),  # replay cannot tell bf16 from fp32 noise (docstring)
    *[(n, get_variant(n), label) for n, label in (
        ("temperature-1.1", "temperature 1.1"), ("top-p-0.85", "top-p 0.85"), ("wrong-seed", "seed +1000003"),
        ("bug-top2", "bug: tokens uniform in top 2"), ("bug-top32", "bug: tokens uniform in top 32"))],
    *[(n, get_variant(n), f"model {n}") for n in ("w8-channel", "w4-g128", "w4-g32", "w4-g128-asym", "w4-g32-asym",
                                                  "fp8-kv", "fp8-kv-tensor", "fp8-kv-head", "fp8-kv-fresh")],
    ("top-k 20 (built)", built("top-k-20", sampling=lambda p: p.with_(top_k=20)), "top-k 20"),
    ("min-p 0.05 (built)", built("min-p-0.05", sampling=lambda p: p.with_(min_p=0.05)), "min-p 0.05"),
    ("temperature 0.8 (built)", built("t-0.8", sampling=lambda p: p.with_(temperature=0.8)), "temperature 0.8"),
    ("repetition penalty 1.2 (built)", built("rep-1.2", hook=lambda: PenaltyHook("repetition", 1.2)),
     "repetition penalty 1.2"),
    ("presence penalty 0.5 (built)", built("pres-0.5", hook=lambda: PenaltyHook("presence", 0.5)),
     "presence penalty 0.5"),
    ("seeds + 1 (built)", built("seed+1", sampling=lambda p: p.with_(seed=p.seed + 1)), "seed +1"),
    ("one seed for all (built)", built("seed-same", sampling=lambda p: p.with_(seed=CLAIM.seed)),
     "one seed for every request"),
    ("profile vllm-v1 (built)", built("vllm-v1", sampling=lambda p: p.with_(profile="vllm-v1")), "profile vllm-v1"),
    ("seeds + 17 (outside the grid)", built("seed+17", sampling=lambda p: p.with_(seed=p.seed + 17)), NONE),
]


def provider_traces(variant: Variant, name: str, ref, requests, max_tokens: int, cache: Path | None,
                    decode_batch: int | None = None):
    """The provider's traces, decoded once per (case, size) when ``cache`` is given, in batches of
    ``decode_batch`` requests (default all: the fp8-KV providers fit their scales on the whole batch)."""
    path = None if cache is None else cache / f"{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}-" \
        f"{len(requests)}x{max_tokens}.jsonl"
    if path is not None and path.is_file():
        return read_traces(path)
    traces = variant.generate(ref, requests, max_new_tokens=max_tokens, batch_size=decode_batch or len(requests))
    if path is not None:
        write_traces(traces, path)
    return traces


def diagnosed(d) -> str:
    if not d.explained:
        return NONE
    return d.best.candidate.label if d.claim_rejected else "claim"


FIT = "cal*-m80-bf16.jsonl"  # the shipped calibrations' honest bf16 traces (default_calibrations.py)
HELD_OUT = ("cal32-m40-bf16", "test48-m40-bf16", "test32@296-m40-bf16", "test48@248-m40-bf16",
            "minp0.05-test48-m40-bf16", "minp0.05-test32@296-m40-bf16", "minp0.05-test48@248-m40-bf16")


def honest_bound(ref: Backend, cache: Path) -> list[str]:
    """Lines of the honest off-boundary measurement (module docstring): per trace file, the tokens,
    the claim's unexplained ones and the off-boundary ones among the top 32 (the widest bug's count);
    then the fit's 99% bound (the rate the test assumes) and the held-out diagnoses."""
    from scipy.stats import beta

    fit = sorted(p for p in cache.glob(FIT) if "sglang" not in p.name)
    held = [cache / f"{name}.jsonl" for name in HELD_OUT]
    lines = ["| set | file | claim | tokens | claim unexplained | off-boundary (top 32) | best | p (Bonferroni over the full grid) |",
             "|---|---|---|---|---|---|---|---|"]
    totals = {"fit": [0, 0], "held out": [0, 0]}
    for kind, paths in (("fit", fit), ("held out", held)):
        for path in paths:
            traces = read_traces(path)
            grid = candidate_grid(traces[0].sampling)
            bugs = [c for c in grid if c.axis in ("claim", "bug")]
            d = diagnose_traces(ref, traces, bugs)
            top = max((r for r in d.ranked if r.candidate.bug), key=lambda r: r.candidate.bug)
            n, events = d.claim.tokens, top.events
            totals[kind][0] += n
            totals[kind][1] += events
            p_full = min(1.0, d.best.p * (len(grid) - 1) / (len(bugs) - 1))
            lines.append(f"| {kind} | {path.name} | {traces[0].sampling.profile} k{traces[0].sampling.top_k} "
                         f"p{traces[0].sampling.top_p} min-p {traces[0].sampling.min_p} | {n} | "
                         f"{round(d.claim.unexplained * n)} | {events} | {d.best.candidate.label} | {p_full:.2g} |")
            print(lines[-1], flush=True)
    n, k = totals["fit"]
    bound = float(beta.ppf(0.99, k + 1, n - k))
    lines += ["", f"Fit: {k} off-boundary tokens among the top 32 of {n} honest bf16 tokens; 99% Clopper-Pearson "
              f"upper bound {bound:.3g} per token (diagnosis.HONEST_OFF_BOUNDARY = {HONEST_OFF_BOUNDARY:g}). "
              f"Held out: {totals['held out'][1]} of {totals['held out'][0]}."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--variants", default="catalogue", help="model variants ranked (diagnose --variants)")
    ap.add_argument("--only", default=None, help="comma-separated substrings of provider names to run")
    ap.add_argument("--cases", choices=("all", "sampler", "model"), default="all",
                    help="sampler: the providers that run the claimed model (diagnosed without model variants); "
                    "model: the bf16 / w8 / w4 / fp8-kv providers (with --variants)")
    ap.add_argument("--cache", type=Path, default=None, help="directory keeping each provider's traces")
    ap.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="leave out prompts longer than this (rendered tokens); default none")
    ap.add_argument("--decode-batch", type=int, default=None,
                    help="requests a provider decodes together (default all; a sampler case's tokens do not "
                         "depend on it, and hundreds of requests in one batch exhaust the memory)")
    ap.add_argument("--bugs-only", action="store_true",
                    help="diagnose with the claim and the sampler-bug candidates only (read from the claim's replay: "
                    "their counts and p-values are those of the full grid, p Bonferroni-corrected over the full grid); "
                    "whether another candidate would rank above the bug is not checked")
    ap.add_argument("--honest-bound", type=Path, default=None, metavar="DIR",
                    help="measure honest providers' rate of tokens only a bug explains on DIR's cached traces "
                    "(module docstring) instead of the confusion table")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.honest_bound is not None:
        started = time.time()
        lines = honest_bound(Backend.load(), args.honest_bound)
        text = "\n".join(["# diagnose: honest providers' tokens that only a sampler bug explains", "",
                          f"Command: `python experiments/{Path(__file__).name} {shlex.join(sys.argv[1:])}`  ",
                          f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
                          f"{describe(torch.get_num_threads())}; wall time {time.time() - started:.0f} s", "",
                          *lines, ""])
        print(text)
        if args.out:
            write_atomic(args.out, text)
        return
    bands = [b for b in resolve_bands(args.variants) if not b.startswith("attn-")]  # attention kernels: fp32 noise
    ref = Backend.load()
    requests = build_requests(ref, load_prompts("chitchat", args.prompts), CLAIM)
    if args.max_prompt_tokens:  # the chitchat set holds one prompt of 15,002 tokens
        requests = [r for r in requests if len(r.prompt_token_ids) <= args.max_prompt_tokens]
    rows, hits, total, conclusions = [], 0, 0, []
    started = time.time()
    for name, variant, expected in CASES:
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        model_case = variant.transform is not None  # the provider runs another model (bf16 included)
        if args.cases != "all" and (args.cases == "model") != model_case:
            continue
        traces = provider_traces(variant, name, ref, requests, args.max_tokens, args.cache, args.decode_batch)
        t0 = time.time()
        scale = 1.0
        if args.bugs_only:  # the claim and the bug candidates; Bonferroni over the full grid (``alpha`` scaled)
            grid = candidate_grid(traces[0].sampling)
            sub = [c for c in grid if c.axis in ("claim", "bug")]
            scale = (len(grid) - 1) / (len(sub) - 1)
            d = diagnose_traces(ref, traces, sub, alpha=ALPHA / scale)
        else:
            d = diagnose(traces, ref, name, bands if model_case or args.cases == "all" else [])
        got = diagnosed(d)
        ok = got == expected
        hits, total = hits + ok, total + 1
        b, c = d.best, d.claim
        rows.append(f"| {name} | {expected} | {got} | {'yes' if ok else 'NO'} | {b.candidate.label} | "
                    f"{b.exact:.1%} | {b.unexplained:.1%} | {c.exact:.1%} | {c.unexplained:.1%} | {min(1.0, b.p * scale):.2g} | {c.tokens} | "
                    f"{time.time() - t0:.0f} |")
        conclusions.append(f"- {name}: {d.text}")
        print(rows[-1], conclusions[-1], sep="\n", flush=True)
    header = ("| provider ran | expected | diagnosed | match | ranked first | best: exact | best: unexplained | "
              "claim: exact | claim: unexplained | p (best vs claim) | tokens | s |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|")
    text = "\n".join([
        "# diagnose: confusion table", "",
        f"Command: `python experiments/{Path(__file__).name} {shlex.join(sys.argv[1:])}`  ",
        f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {describe(torch.get_num_threads())}; "
        f"load average at the end {os.getloadavg()[0]:.1f}  ",
        f"Data: cases {args.cases}{'; claim and bug candidates only (--bugs-only)' if args.bugs_only else ''}; {args.prompts} chitchat prompts x {args.max_tokens} new tokens per provider, "
        "claiming vLLM T=1, "
        f"top-k 50, top-p 0.95 (seed 7000 + i) on {ref.model_id} fp32; bands: "
        f"{'none' if args.cases == 'sampler' or args.bugs_only else ', '.join(bands)}  ",
        f"Recovered: {hits} of {total}; wall time {time.time() - started:.0f} s", "",
        "`diagnosed` is the best candidate when the LR test rejects the claim (Vuong, Bonferroni, p < 0.01), "
        "`claim` when it does not, and `no candidate explains it` when every candidate leaves more than 2% "
        "of tokens unexplained. fp8-KV variants are replayed by their own KV-cache decode of the traces' "
        "tokens (one batch, as the providers here decoded them).", "", header, *rows, "", "Conclusions:", "",
        *conclusions, ""])
    print(text)
    if args.out:
        write_atomic(args.out, text)


if __name__ == "__main__":
    main()
