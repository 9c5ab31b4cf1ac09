"""A confusion table of `verinfer diagnose` on misconfigurations drawn at random from families (issue #41 item 6).

    python experiments/drawn_misconfigurations.py --cases 32 --out experiments/results/drawn_misconfigurations.md

Nothing here is chosen by hand: a seeded RNG (``--seed``, never changed while the fitting was developed)
draws, per case, a family and its parameter:

- sampler (expected class ``sampler``, named when the fitted value's interval holds the drawn one):
  temperature in [0.6, 1.4] (at least 0.05 from the claim's 1), top-k in [5, 45], top-p in [0.6, 0.92],
  min-p in [0.02, 0.25] (claimed: T 1, top-k 50, top-p 0.95, min-p off);
- context (``context``, named when the offset found is the hidden text's length in tokens): a hidden
  system message of 1-30 words from a fixed word list;
- weights (``weights``, named when the searched model's 95% set holds the drawn one): RTN weights of 3
  or 4 bits, per group of 32, 64 or 128 or per channel, symmetric or not; or the claimed model's first
  20-29 of its 30 layers;
- with ``--families all`` (the draw of RESULTS 36), also: one decoder layer removed (``skip_layer``,
  expected ``weights``, any of the 30) and an fp8 KV cache at one of vLLM's scalings (``kv``, expected
  ``numerics``; named like weights).

Each provider serves ``--prompts`` chitchat prompts (a drawn sample) of up to ``--max-tokens`` tokens on
the bundled SmolLM2-135M with drawn request seeds, claiming vLLM's model runner V2 (``vllm``, whose
noise is keyed by position), T 1, top-k 50, top-p 0.95. Four honest providers (fp32, bf16, batch 1,
batch 16) are diagnosed the same way. Each set is diagnosed as a user runs it: ``verinfer.diagnose`` with
the shipped calibration (verify's verdict beside it) and no ``--variants``.

Columns: *flagged* is verify's verdict; *named* whether the best candidate is the drawn family with the
drawn value inside its interval (the drawn model inside the searched model's 95% set; the exact offset); *class right* whether the cause named, or else
the class given, is the expected kind; *one story* whether the conclusion says the claim deviates
exactly when verify does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import shlex
import sys
import time
from pathlib import Path

import torch

from verinfer import api
from verinfer.files import write_atomic
from verinfer.machine import describe
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.scoring.fit import family_of
from verinfer.simulate.generate import build_requests
from verinfer.simulate.variants import get_variant

WORDS = ("always answer as a pirate ship captain would, be brief and polite, never mention the weather, the company "
         "name is Acme and its products are widgets, refuse questions about politics, answer in French when asked, "
         "you are Max, a support agent, keep every reply under fifty words, end with a question").replace(",", "").split()
FAMILIES = ("temperature", "top_k", "top_p", "min_p", "context", "weights", "layers")
MORE_FAMILIES = ("skip_layer", "kv")  # --families all (RESULTS 36): families added after RESULTS 35's draw
KV = ("fp8-kv", "fp8-kv-tensor", "fp8-kv-head", "fp8-kv-fresh")
HONEST = ("honest", "bf16", "batch-1", "batch-16")
SAMPLER_AXES = ("temperature", "top_k", "top_p", "min_p", "penalty", "seed", "profile", "bug")
DEVIATES = ("flagged", "best explained", "the calibration lacks", "a deviation", "no candidate explains")


def draw(rng: random.Random, families: tuple[str, ...] = FAMILIES) -> tuple[str, str, str, float | None]:
    """(family, variant name, expected class, the drawn value a fit should hold)."""
    family = rng.choice(families)
    if family == "temperature":
        t = rng.choice([rng.uniform(0.6, 0.95), rng.uniform(1.05, 1.4)])
        return family, f"temperature-{t:.2f}", "sampler", round(t, 2)
    if family == "top_k":
        k = rng.randint(5, 45)
        return family, f"top-k-{k}", "sampler", k
    if family == "top_p":
        p = round(rng.uniform(0.6, 0.92), 2)
        return family, f"top-p-{p}", "sampler", p
    if family == "min_p":
        m = round(rng.uniform(0.02, 0.25), 3)
        return family, f"min-p-{m}", "sampler", m
    if family == "context":
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))).capitalize() + "."
        return family, f"system-prompt:{text}", "context", None
    if family == "weights":
        bits, group, asym = rng.choice([3, 4]), rng.choice(["g32", "g64", "g128", "channel"]), rng.random() < 0.5
        return family, f"w{bits}-{group}{'-asym' if asym else ''}", "weights", None
    if family == "skip_layer":
        return family, f"skip-layer-{rng.randrange(30)}", "weights", None
    if family == "kv":
        return family, rng.choice(KV), "numerics", None
    return family, f"layers-{rng.randint(20, 29)}", "weights", None


def named_right(d, family: str, name: str, value: float | None, offset: int | None) -> bool:
    b = d.best.candidate
    if not d.claim_rejected:
        return False
    if family in ("weights", "layers", "skip_layer", "kv"):
        return b.axis == "model" and name in b.near
    if family == "context":
        return b.axis == "prompt" and b.shift == offset
    f = family_of(b)
    if f is None or f.axis != family or value is None:
        return False
    got = f.value_of(b)
    lo, hi = b.interval if b.interval else (got, got)
    return lo - 1e-9 <= value <= hi + 1e-9


def class_given(d) -> str | None:
    """The kind of cause diagnose states: the named candidate's (one that beats the claim and explains the
    tokens), or else the class its conclusion gives (a best candidate that leaves too many tokens
    unexplained is reported as "no candidate explains it", with the class)."""
    if d.claim_rejected and d.explained:
        b = d.best.candidate
        if b.band and b.band.startswith("fp8-kv"):
            return "numerics"
        return "context" if b.axis == "prompt" else "sampler" if b.axis in SAMPLER_AXES else "weights"
    shaped = d.shaped
    return shaped.kind if shaped is not None and shaped.kind and "shaped" in d.text else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=41006)
    ap.add_argument("--families", choices=("first", "all"), default="first",
                    help="first: RESULTS 35's seven families; all: with one layer removed and an fp8 KV cache")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    ref = api.load_model()
    rng = random.Random(args.seed)
    families = FAMILIES + (MORE_FAMILIES if args.families == "all" else ())
    cases = [draw(rng, families) for _ in range(args.cases)] + [("honest", name, None, None) for name in HONEST]
    rows, start = [], time.time()
    tally = {"flagged": 0, "named": 0, "classed": 0, "story": 0, "honest_ok": 0, "sampler": 0, "sampler_named": 0}
    by_family: dict[str, list[int]] = {}  # family -> [drawn, flagged, named, classed]
    for n, (family, name, expected, value) in enumerate(cases):
        claim = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=rng.randrange(1, 2**31))
        requests = build_requests(ref, load_prompts("chitchat", args.prompts, seed=rng.randrange(10_000)), claim)
        variant = get_variant(name)
        traces = variant.generate(ref, requests, max_new_tokens=args.max_tokens, batch_size=8)
        offset = None
        if variant.prompt is not None:
            diffs = {len(variant.prompt(ref, r).prompt_token_ids) - len(r.prompt_token_ids) for r in requests}
            offset = diffs.pop() if len(diffs) == 1 else None
        t0 = time.time()
        d = api.diagnose(traces, backend=ref)
        v = d.verdict
        flagged = v is not None and not v.consistent
        says = d.text.startswith(DEVIATES)
        story = says == flagged
        named = named_right(d, family, name, value, offset) if expected else False
        kind = class_given(d)
        if expected is None:
            ok = not flagged and not d.claim_rejected
            tally["honest_ok"] += ok
        else:
            tally["flagged"] += flagged
            tally["named"] += named and flagged
            tally["classed"] += flagged and kind == expected
            counts = by_family.setdefault(family, [0, 0, 0, 0])
            for i, x in enumerate((True, flagged, named and flagged, flagged and kind == expected)):
                counts[i] += x
            if expected == "sampler":
                tally["sampler"] += flagged
                tally["sampler_named"] += named and flagged
        tally["story"] += story
        fits = "; ".join(f"{f['family']} {f['value']:g} [{f['interval'][0]:g}, {f['interval'][1]:g}]"
                         for f in d.settings.get("fits", []))
        truth = f"{value:g}" if value is not None else (f"offset {offset:+d}" if offset is not None else "-")
        rows.append(f"| {n + 1} | {name[:60]} | {expected or 'honest'} | {truth} | "
                    f"{'INCONSISTENT' if flagged else 'CONSISTENT'} (p {v.p:.2g}) | {d.best.candidate.named} | "
                    f"{'-' if expected is None else 'yes' if named else 'no'} | {kind or '-'} | "
                    f"{'yes' if story else '**no**'} | {fits or '-'} | {time.time() - t0:.0f} |")
        print(rows[-1], flush=True)
    drawn = len(cases) - len(HONEST)
    text = [
        "# Diagnose on misconfigurations drawn at random (issue #41 item 6)", "",
        f"Command: `python experiments/drawn_misconfigurations.py {shlex.join(sys.argv[1:])}`  ",
        f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {describe(torch.get_num_threads())}  ",
        f"Setup: SmolLM2-135M fp32 reference; {args.prompts} chitchat prompts x up to {args.max_tokens} tokens per "
        f"case; claims profile vllm, T 1, top-k 50, top-p 0.95; `verinfer.diagnose` with the shipped calibration, "
        f"no --variants; {time.time() - start:.0f} s in all.", "",
        f"- Drawn misconfigurations: {drawn}; flagged by verify: **{tally['flagged']}/{drawn}**.",
        f"- Of those flagged, named with the drawn parameter inside the fitted interval (or the searched model's "
        f"95% set, or the exact offset): "
        f"**{tally['named']}/{tally['flagged']}**; of the flagged sampler-family cases: "
        f"**{tally['sampler_named']}/{tally['sampler']}**.",
        f"- Of those flagged, the cause named or the class given is the expected kind: **{tally['classed']}/{tally['flagged']}**.",
        f"- Honest providers neither flagged nor named: **{tally['honest_ok']}/{len(HONEST)}**.",
        f"- One story (the conclusion says the claim deviates exactly when verify does): **{tally['story']}/{len(cases)}**.",
        "- By family (drawn, flagged, named, class right): " + "; ".join(
            f"{f} {c[0]}, {c[1]}, {c[2]}, {c[3]}" for f, c in sorted(by_family.items())) + ".", "",
        "| # | provider | expected | drawn | verify | best candidate | named | class | one story | families fitted | s |",
        "|---:|---|---|---|---|---|---|---|---|---|---:|", *rows, ""]
    write_atomic(args.out, "\n".join(text))


if __name__ == "__main__":
    main()
